"""Tree rounds through the engine: greedy identity with plain decoding (table models and stories260K), the
cache after compaction, exact stopping inside a tree, and a chi-square on the first sampled tokens that a
broken sibling rule fails."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest
import torch
from scipy import stats as scipy_stats

import verispec.engine.rounds as rounds_module
from fakes import Alternating, TableLM, TokenCache
from one_sequence import OneSequence
from test_hf_adapter import tiny_model
from verispec import cli
from verispec.api import Speculator, generate
from verispec.costs.policies import ConstantK
from verispec.drafting.base import NoDrafter
from verispec.drafting.draft_model import ModelDrafter, ModelTreeDrafter
from verispec.drafting.ngram import NGramDrafter, NGramTreeDrafter
from verispec.drafting.registry import drafter_names
from verispec.drafting.tree import TreeShape
from verispec.engine.engine import SpeculativeEngine
from verispec.engine.sequence import EngineConfig, GenerationStats
from verispec.models.hf import HFModel
from verispec.models.registry import load_model
from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits
from verispec.verify.tree import SiblingRule, sample_tree_verdict, sibling_rule

V = 6
GREEDY = SamplingParams(temperature=0)
SHAPES = {
    "2x2": TreeShape.full(2, 2),
    "paths": TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]),
    "chain3": TreeShape.chain(3),
    "3x1": TreeShape.full(3, 1),
}


class TreeTokenCache(TokenCache):
    """TokenCache that compacts: the kept slots' token ids move into place."""

    def compact(self, start: int, keep: list[int]) -> None:
        if any(not start <= s < self._length for s in keep) or sorted(set(keep)) != list(keep):
            raise ValueError(f"bad slots {keep} for compaction from {start}")
        self.slots[start : start + len(keep)] = self.slots[list(keep)].clone()
        self._length = start + len(keep)


class TreeTableLM(TableLM):
    """TableLM that also scores token trees: a new token's context is the committed tokens and the new
    tokens its row of the tree mask shows, and its position must be the committed length + its depth."""

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> TreeTokenCache:
        return TreeTokenCache(capacity or self.max_context)

    def forward(self, tokens, positions, cache, tree_mask=None):
        if tree_mask is None:
            return super().forward(tokens, positions, cache)
        start, t = cache.length, tokens.shape[1]
        if start + t > cache.capacity:
            raise ValueError("cache capacity exceeded")
        committed = cache.slots[:start].tolist()
        cache.slots[start : start + t] = tokens[0]
        cache._length = start + t
        self.calls.append(t)
        rows = []
        for j in range(t):
            path = tokens[0][tree_mask[j]].tolist()
            if int(positions[0, j]) != start + len(path) - 1:
                raise ValueError(f"position {int(positions[0, j])} is not the committed length + depth")
            rows.append(self.next_logits(committed + path))
        return torch.stack(rows).unsqueeze(0)

    def next_logits(self, context: list[int]) -> torch.Tensor:
        seq = [self.vocab_size, self.vocab_size, *context]
        return self.table[seq[-2], seq[-1]]


def noisy_copy(model: TableLM, seed: int, noise: float) -> TreeTableLM:
    draft = TreeTableLM(model.vocab_size, seed=seed, max_context=model.max_context)
    draft.table = model.table + noise * draft.table
    return draft


def tree_drafters(target: TreeTableLM, shape: TreeShape, sampling: SamplingParams) -> Iterator:
    yield NGramTreeDrafter(shape, NGramDrafter(max_ngram=3, min_ngram=1))
    yield ModelTreeDrafter(ModelDrafter(noisy_copy(target, 99, 0.7), sampling, target.vocab_size), shape)
    yield ModelTreeDrafter(ModelDrafter(target, sampling, target.vocab_size), shape)  # a perfect draft


def run(engine: SpeculativeEngine, prompt: list[int], config: EngineConfig, check_cache: bool = True):
    """A generation; after every round the target's cache holds the committed tokens but the last (the
    accepted path compacted into place, the rest of the tree dropped)."""
    stats = GenerationStats(engine.drafter.name, "tree")
    out: list[int] = []
    for tokens in engine.stream(prompt, config, stats):
        out += tokens
        if check_cache:
            assert engine.cache.tokens() == (prompt + out)[:-1]
    return out, stats


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("seed", range(3))
def test_greedy_tree_rounds_equal_plain_greedy(shape, seed):
    target = TreeTableLM(V, seed=seed)
    prompt = [seed % V, (seed + 2) % V, 1, 3, 1]
    reference = target.greedy(prompt, 41)
    config = EngineConfig(max_new_tokens=41, sampling=GREEDY)
    for drafter in tree_drafters(target, SHAPES[shape], GREEDY):
        out, stats = run(OneSequence(target, drafter, ConstantK(0)), prompt, config)
        assert out == reference, drafter.name
        assert stats.new_tokens == 41 and stats.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("first", [True, False])
def test_plain_rounds_between_tree_rounds_draft_nothing_and_keep_greedy(first):
    """A K policy's plain rounds (TreeGate's, where trees do not pay) score the last token alone and never
    ask the drafter; the output stays the target's greedy one; the policy hears which rounds drafted."""
    target = TreeTableLM(V, seed=4)
    prompt = [2, 0, 1, 3]
    drafter = ModelTreeDrafter(ModelDrafter(noisy_copy(target, 5, 0.3), GREEDY, V), TreeShape.full(2, 2))
    policy, asked = Alternating(first), []  # asked: whether the policy wanted a tree when the drafter was
    propose_tree = drafter.propose_tree
    drafter.propose_tree = lambda *args, **kwargs: asked.append(policy.next) or propose_tree(*args, **kwargs)
    out, stats = run(OneSequence(target, drafter, policy), prompt, EngineConfig(30, GREEDY))
    assert out == target.greedy(prompt, 30)
    assert policy.drafted[:4] == ([True, False, True, False] if first else [False, True, False, True])
    assert all(asked) and sum(policy.drafted) <= len(asked) < len(policy.drafted)
    plain = [n for n, drafted in zip(target.calls[1:], policy.drafted, strict=False) if not drafted]
    assert plain and set(plain) == {1}  # a plain round's forward: the last token alone


def test_per_depth_acceptance_and_forward_sizes():
    """A perfect draft's full tree accepts its whole depth every round: 4 tokens per target forward of 15
    nodes; the stats count the path per depth and the nodes scored."""
    target = TreeTableLM(V, seed=3)
    shape = TreeShape.full(2, 3)
    draft = noisy_copy(target, 1, 0.0)  # the target's table in a model of its own: its calls are apart
    engine = OneSequence(target, ModelTreeDrafter(ModelDrafter(draft, GREEDY, V), shape), ConstantK(0))
    out, stats = run(engine, [1, 2], EngineConfig(max_new_tokens=24, sampling=GREEDY))
    assert out == target.greedy([1, 2], 24)
    assert stats.target_calls == 6 and stats.tokens_per_target_call == 4.0
    assert stats.acceptance_per_position == [1.0, 1.0, 1.0] and stats.tree_nodes == 6 * 14
    assert target.calls[1:] == [15] * 6  # after the prefill: one forward over the whole tree per round


@pytest.mark.parametrize("max_new", [1, 2, 3, 5])
def test_never_overshoots_max_new_tokens(max_new):
    """The tree's depth is capped by the tokens still allowed: even a perfect draft stops exactly there."""
    target = TreeTableLM(V, seed=5)
    drafter = ModelTreeDrafter(ModelDrafter(target, GREEDY, V), TreeShape.full(2, 4))
    out, stats = run(OneSequence(target, drafter, ConstantK(0)), [0], EngineConfig(max_new, GREEDY))
    assert out == target.greedy([0], max_new)
    assert len(stats.drafted_per_position) <= max_new - 1  # no tree deeper than the tokens left - 1


def test_stops_at_end_of_sequence_inside_the_tree():
    target = TreeTableLM(V, seed=7)
    reference = target.greedy([2, 3], 40)
    eos = reference[10]
    expected = target.greedy([2, 3], 40, eos=frozenset({eos}))
    for drafter in tree_drafters(target, TreeShape.full(2, 3), GREEDY):
        out, stats = run(
            OneSequence(target, drafter, ConstantK(0)),
            [2, 3],
            EngineConfig(max_new_tokens=40, sampling=GREEDY, eos_token_ids=frozenset({eos})),
        )
        assert out == expected and out[-1] == eos and stats.stop_reason == "eos"


def test_stops_at_the_context_limit():
    """Near the end of the context the tree is cut to the slots left, down to the root alone."""
    target = TreeTableLM(V, seed=1, max_context=20)
    drafter = ModelTreeDrafter(ModelDrafter(target, GREEDY, V), TreeShape.full(2, 3))
    out, stats = run(OneSequence(target, drafter, ConstantK(0)), [1, 2, 3], EngineConfig(100, GREEDY))
    assert len(out) == 17 and stats.stop_reason == "context"
    assert out == target.greedy([1, 2, 3], 17)


def test_engine_refuses_what_trees_cannot_use():
    plain = TableLM(V, seed=0)  # its cache cannot compact
    drafter = NGramTreeDrafter(TreeShape.full(2, 2))
    with pytest.raises(ValueError, match="compacts"):
        OneSequence(plain, drafter, ConstantK(0))
    with pytest.raises(ValueError, match="traces"):
        OneSequence(TreeTableLM(V, seed=0), drafter, ConstantK(0), trace=object())
    with pytest.raises(ValueError, match="context of 7"):
        OneSequence(TreeTableLM(V, seed=0, max_context=7), drafter, ConstantK(0))


def test_ngram_tree_keeps_the_other_matches_as_branches():
    """'a b c . a b d . a b' → the latest match proposes 'd', the earlier one 'c': two branches."""
    ids = [0, 1, 2, 5, 0, 1, 3, 5, 0, 1]
    tree = NGramTreeDrafter(TreeShape.full(2, 2)).propose_tree(ids, TreeShape.full(2, 2), torch.Generator())
    assert tree.tokens.tolist() == [1, 3, 2, 5, 5] and tree.parents.tolist() == [-1, 0, 0, 1, 2]
    assert NGramDrafter(3, 1).propose(ids, 2, torch.Generator()).tokens.tolist() == [3, 5]  # the chain's


def test_model_tree_children_are_the_draft_top_k():
    target = TreeTableLM(V, seed=4)
    shape = TreeShape.full(3, 2)
    drafter = ModelTreeDrafter(ModelDrafter(target, GREEDY, V), shape)
    drafter.begin([1, 2])
    tree = drafter.propose_tree([1, 2], shape, torch.Generator())
    assert tree.num_nodes == 13 and tree.q is None
    assert tree.tokens[1:4].tolist() == target.next_logits([1, 2]).topk(3).indices.tolist()
    for node in range(1, 4):
        kids = (tree.parents == node).nonzero().flatten()
        best = target.next_logits([1, 2, int(tree.tokens[node])]).topk(3).indices
        assert tree.tokens[kids].tolist() == best.tolist()
    assert drafter.drafter.cache.length == 2  # no draft slot outlives the proposal


# Chi-square through the whole engine: the first two generated tokens of N seeded generations with a tree
# drafter against the target's exact joint distribution. N = 3000 per case, 4 exact cases, α = 1e-4 / 4
# (Bonferroni); the broken sibling rule must reach a p-value below the same threshold from BROKEN_SAMPLES
# generations (its p-value 5e-15 at 300, 1e-48 at 1000, 1e-180 at 3000: far from exact, fewer suffice, and
# the exact cases' N catches it all the more).
N_SAMPLES = 3000
BROKEN_SAMPLES = 1000
ALPHA = 1e-4 / 4


PROMPT = [1, 0, 1, 2, 1]  # the n-gram tree branches: "1" was followed by "0 1" and by "2 1"


def target_probs(target: TreeTableLM, context: list[int]) -> torch.Tensor:
    return probs_from_logits(target.next_logits(context).double(), SamplingParams())  # [V]


@torch.inference_mode()  # as tests/first_rounds.py: no value changes, each sample cheaper
def first_two_tokens_p_value(kind: str, samples: int = N_SAMPLES) -> float:
    target = TreeTableLM(4, seed=21, sharpness=1.2)
    draft = noisy_copy(target, 22, 1.5)
    shape = TreeShape.full(2, 2)
    counts = torch.zeros(4, 4, dtype=torch.float64)  # [first token, second token]
    for seed in range(samples):
        sampling = SamplingParams(seed=seed, invariant=False)
        if kind == "ngram":
            drafter = NGramTreeDrafter(shape, NGramDrafter(2, 1))
        else:
            drafter = ModelTreeDrafter(ModelDrafter(draft, sampling, 4), shape, sampled=kind != "top-k")
        policy = Alternating(seed % 2 == 0) if kind == "gated" else ConstantK(0)
        out, _ = run(OneSequence(target, drafter, policy), PROMPT, EngineConfig(2, sampling))
        counts[out[0], out[1]] += 1
    expected = torch.zeros(4, 4, dtype=torch.float64)  # exact P(first, second) under the target alone
    for a, b in itertools.product(range(4), repeat=2):
        expected[a, b] = target_probs(target, PROMPT)[a] * target_probs(target, [*PROMPT, a])[b]
    keep = expected.flatten() * samples >= 5  # cells too rare for the chi-square approximation are merged
    obs = torch.cat([counts.flatten()[keep], counts.flatten()[~keep].sum().view(1)])
    exp = torch.cat([expected.flatten()[keep], expected.flatten()[~keep].sum().view(1)]) * samples
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return scipy_stats.chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.mark.parametrize("kind", ["top-k", "sampled", "ngram", "gated"])
def test_engine_first_two_tokens_follow_the_target(kind):
    """Top-k children (single guesses), i.i.d. sampled children (with q), n-gram branches, and sampled
    children in tree rounds that alternate with plain ones (a gate's choices, half the generations
    beginning with each): exact."""
    assert first_two_tokens_p_value(kind) > ALPHA


def test_engine_chi_square_catches_siblings_without_residuals(monkeypatch):
    """The same check fails when each sibling is tried against p instead of the residual the siblings tried
    before it left (the residual not renormalized between siblings)."""

    def stale_siblings(tokens, parents, p, q, generator, eos_token_id=None):
        def rule(u: int, kids: torch.Tensor) -> SiblingRule:
            right = sibling_rule(tokens[kids], p_u=p[u], q_children=None if q is None else q[kids])
            alone = [
                sibling_rule(tokens[k : k + 1], p_u=p[u], q_children=None if q is None else q[k : k + 1])
                for k in kids
            ]
            stale = torch.cat([r.accept_prob for r in alone]) if alone else right.accept_prob
            return SiblingRule(accept_prob=stale, residuals=right.residuals)

        return sample_tree_verdict(tokens, parents, rule, generator, eos_token_id)

    monkeypatch.setattr(rounds_module, "tree_rejection_sample", stale_siblings)
    assert first_two_tokens_p_value("top-k", BROKEN_SAMPLES) < ALPHA


def test_same_seed_same_tokens():
    target = TreeTableLM(V, seed=2, sharpness=1.0)
    draft = noisy_copy(target, 8, 1.0)

    def sample(seed: int) -> list[int]:
        sampling = SamplingParams(seed=seed, invariant=False)
        drafter = ModelTreeDrafter(ModelDrafter(draft, sampling, V), TreeShape.full(2, 2), sampled=True)
        return run(OneSequence(target, drafter, ConstantK(0)), [1], EngineConfig(40, sampling))[0]

    assert sample(123) == sample(123) and sample(123) != sample(124)


def test_transformers_adapter_tree_rounds_equal_plain_greedy():
    """The adapter scores the tree with a custom 4-D mask and compacts its DynamicCache: the same tokens as
    plain decoding; a draft with the target's weights is accepted to the tree's full depth."""
    target = HFModel(tiny_model("llama").eval())
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 3, 14]
    config = EngineConfig(max_new_tokens=24, sampling=GREEDY)
    plain, _ = run(OneSequence(target, NoDrafter(), ConstantK(0)), prompt, config, check_cache=False)
    draft = ModelDrafter(HFModel(tiny_model("llama").eval()), GREEDY, target.vocab_size)
    for drafter in (NGramTreeDrafter(TreeShape.full(2, 2)), ModelTreeDrafter(draft, TreeShape.full(2, 2))):
        engine = OneSequence(target, drafter, ConstantK(0))
        out, stats = run(engine, prompt, config, check_cache=False)
        assert out == plain and engine.cache.length == len(prompt) + len(out) - 1
    assert stats.target_calls == 8  # the model tree: 2 accepted + 1 bonus per forward


# ---------------------------------------------------------------------------------------------- real model

STORY_PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park",
    "The little dog was sad because",
    "Tim had a red ball. He",
    "Once upon a time, there was a little boy named Ben. Ben liked to",
    "Once upon a time, there was a little girl named Lily. She loved to play. Once upon a time,",  # n-grams
]


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


def test_stories_tree_greedy_equals_plain_greedy(stories):
    """6 prompts × (n-gram tree, 2-layer early-exit tree on the target's cache, 2-layer draft with its own
    cache) × 2 shapes == plain greedy, 60 tokens each; the trees were wrong sometimes (compaction of
    partial paths exercised)."""
    model, tokenizer = stories
    plain = Speculator((model, tokenizer), drafter="none")
    speculators = [
        Speculator((model, tokenizer), drafter="ngram", tree=shape)
        for shape in (TreeShape.full(2, 3), TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 0, 0)]))
    ]
    speculators += [
        Speculator((model, tokenizer), draft=draft, tree=TreeShape.full(2, 2))
        for draft in ("layers:2", (model.first_layers(2), tokenizer))
    ]
    partial = ngram_nodes = 0
    for prompt in STORY_PROMPTS:
        reference = plain.generate(prompt, k=0, max_new_tokens=60, sampling=GREEDY).token_ids
        for speculator in speculators:
            result = speculator.generate(prompt, max_new_tokens=60, sampling=GREEDY)
            assert result.token_ids == reference, (prompt, speculator.drafter_name)
            partial += result.stats["target_calls"] > 0 and result.stats["accepted"] < result.stats["drafted"]
            ngram_nodes += result.stats["tree_nodes"] if speculator.drafter_name == "ngram" else 0
    assert partial > 0 and ngram_nodes > 0


# ---------------------------------------------------------------------------------------------- command line


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--tree-width", "2"], "go together"),
        (["--tree-width", "0", "--tree-depth", "2"], "width must be"),
        (["--tree-width", "9", "--tree-depth", "9"], "more than the limit"),
        (["--tree-width", "2", "--tree-depth", "2", "--tree-shape", "x.json"], "not both"),
        (["--tree-shape", "/nonexistent/shape.json"], "cannot read"),
        (["--tree-width", "2", "--tree-depth", "2", "--show-trace"], "traces"),
        (["--tree-nodes", "4"], "--tree-nodes needs a tree"),
        (["--tree-width", "2", "--tree-depth", "2", "--tree-nodes", "0"], "node budget"),
        (["--tree-width", "2", "--tree-depth", "2", "--tree-nodes", "many"], "--tree-nodes takes"),
        (
            ["--drafter", "ngram", "--tree-width", "2", "--tree-depth", "2", "--tree-nodes", "2"],
            "eagle drafter",
        ),
    ],
)
def test_cli_bad_tree_options_are_one_line_errors(capsys, flags, message):
    status = cli.main(["generate", "hi", *flags])
    _, err = capsys.readouterr()
    assert status == 2 and message in err and err.count("\n") == 1


def test_cli_malformed_shape_file(capsys, tmp_path):
    path = tmp_path / "shape.json"
    for paths, message in (([[0], [0, 0, 0]], "gap in depth"), ([[0], [0]], "appears twice")):
        path.write_text(json.dumps(paths))
        assert cli.main(["generate", "hi", "--tree-shape", str(path)]) == 2
        _, err = capsys.readouterr()
        assert message in err and err.count("\n") == 1


def test_cli_generate_with_a_tree(capsys, shared_model, tmp_path):
    """--tree-shape and --tree-width/--tree-depth (and the API's tree="WxD") give plain greedy's tokens on
    stories260K; a tree too big for the context is refused in one line."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    story = "Once upon a time, there was a little girl named Lily. She loved to play. Once upon a time,"
    common = ["generate", story, *model, "--max-new-tokens", "30", "--json"]  # the n-gram tree finds matches
    assert cli.main([*common, "--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    path = tmp_path / "shape.json"
    path.write_text("[[0], [1], [0, 0], [0, 0, 0]]")
    for flags in (["--tree-shape", str(path)], ["--tree-width", "2", "--tree-depth", "3"]):
        assert cli.main([*common, "--drafter", "ngram", *flags]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["token_ids"] == plain["token_ids"]
        assert result["stats"]["k"].startswith("tree ") and result["stats"]["tree_nodes"] > 0
    one_shot = generate(
        story,
        target=str(root / "stories260K.bin"),
        tokenizer=str(root / "tok512.bin"),
        drafter="ngram",
        tree="2x2",
        max_new_tokens=30,
        temperature=0,
    )
    assert one_shot.token_ids == plain["token_ids"] and one_shot.stats["k"] == "tree 2x2"
    assert cli.main([*common, "--drafter", "none", "--tree-width", "2", "--tree-depth", "2"]) == 2
    takers = drafter_names(lambda kind: kind.takes_trees)  # the registry's: eagle3 and eagle2 take trees too
    assert f"token trees need the {takers} drafter" in capsys.readouterr().err and "ngram" in takers
    assert cli.main([*common, "--tree-width", "2", "--tree-depth", "9"]) == 2  # 1023 nodes, context 512
    assert "context of" in capsys.readouterr().err


def test_a_model_draft_reads_a_prompt_without_its_logits(shared_model, monkeypatch):
    """A draft model's first proposal, chain or tree, reads the prompt's positions for their keys and values
    only: logits over the vocabulary at the last position and at each drafted one, never at the prompt's (a
    135 M draft's head over 49,152 tokens at every position of a long prompt). Its first token is what a
    draft fed the whole prompt with its logits picks, and speculative greedy is plain greedy."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    target, tokenizer = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")
    prompt = tokenizer.encode("Once upon a time there was a little dog who")
    draft = target.first_layers(3)
    with_logits: list[int] = []  # the positions of each forward that computes logits
    original = type(draft).forward

    def forward(self, tokens, positions, cache, tree_mask=None):
        with_logits.append(tokens.shape[1])
        return original(self, tokens, positions, cache, tree_mask)

    monkeypatch.setattr(type(draft), "forward", forward)
    chain = ModelDrafter(draft, GREEDY, target.vocab_size)
    chain.begin(prompt)
    proposal = chain.propose(prompt, 4, torch.Generator())
    assert with_logits == [1, 1, 1, 1] and chain.cache.length == len(prompt) + 3
    tree = ModelTreeDrafter(ModelDrafter(draft, GREEDY, target.vocab_size), TreeShape.full(2, 2))
    tree.begin(prompt)
    with_logits.clear()
    tree.propose_tree(prompt, TreeShape.full(2, 2), torch.Generator())
    assert with_logits == [1, 2]  # the root, then its two children (one tree forward)
    monkeypatch.undo()
    whole = draft.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], draft.new_cache())[0, -1]
    assert int(proposal.tokens[0]) == int(whole.argmax())
    config = EngineConfig(max_new_tokens=24, sampling=GREEDY)
    out, _ = run(
        OneSequence(target, ModelDrafter(draft, GREEDY, target.vocab_size), ConstantK(4)),
        prompt,
        config,
        False,
    )
    plain, _ = run(OneSequence(target, NoDrafter(), ConstantK(0)), prompt, config, False)
    assert out == plain

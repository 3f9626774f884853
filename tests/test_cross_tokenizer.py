"""Drafting across tokenizers (verispec.drafting.cross_tokenizer): exact by enumeration, and in use.

The enumeration runs the REAL drafters (token-level intersection, string-level exact match, and auto
choosing between them) on a toy pair whose tokenizers segment the same strings differently: the target has
"ab" and "ca" that the draft lacks, the draft has "bc", "abc" and "cc" that the target lacks, the draft holds
"a" twice, only the draft has a BOS, both have an EOS. Every draft sample is enumerated by replaying the
drafter with scripted draws; every accept/reject branch and fallback token comes from the real rule
functions of :mod:`verispec.verify.chain` in float64. The joint distribution of the first N target tokens is
compared with the target's own (TV <= 1e-12) for every sampling setting; broken variants are caught.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Sequence
from unittest import mock

import numpy as np
import pytest
import torch

from fakes import TableLM, TokenCache
from first_rounds import first_token_counts
from toy import SETTINGS, single_threaded, target_joint
from verispec.drafting import cross_tokenizer
from verispec.drafting.base import Proposal
from verispec.drafting.cross_tokenizer import (
    CrossTokenizerDrafter,
    DraftText,
    StringMatchDrafter,
    TokenIntersectionDrafter,
    VocabularyPair,
    intersect,
    same_vocabulary,
)
from verispec.errors import UsageError
from verispec.options import GenerationOptions, SamplingParams
from verispec.sampling import probs_from_logits
from verispec.verify.chain import Rule, greedy_rule, rejection_rule, single_guess_rule

EXACT_TV = 1e-12
BROKEN_TV = 1e-3
N_TOKENS = 3


class PieceTokenizer:
    """A toy tokenizer over a list of pieces: encode is longest-match, BOS/EOS are roles (spelled b"")."""

    def __init__(self, pieces: Sequence[str], eos: int, bos: int | None = None, prefix_space: bool = False):
        self.pieces = list(pieces)
        self.vocab_size = len(self.pieces)
        self.bos_token_id = bos
        self.eos_token_ids = frozenset({eos})
        self.prefix_space = prefix_space
        roles = {eos} | ({bos} if bos is not None else set())
        self._ids = {p: i for i, p in reversed(list(enumerate(self.pieces))) if i not in roles}

    def token_bytes(self) -> list[bytes]:
        roles = self.eos_token_ids | {self.bos_token_id}
        return [b"" if i in roles else p.encode() for i, p in enumerate(self.pieces)]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        text = " " + text if self.prefix_space and text else text
        ids, i = [], 0
        longest = max(len(p) for p in self._ids)
        while i < len(text):
            for n in range(min(longest, len(text) - i), 0, -1):
                if text[i : i + n] in self._ids:
                    ids.append(self._ids[text[i : i + n]])
                    i += n
                    break
            else:
                raise ValueError(f"cannot encode {text[i]!r}")
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        spelled = self.token_bytes()
        return b"".join(spelled[i] for i in ids).decode()

    def chat_prompt(self, user_message: str) -> str:
        raise UsageError("no chat template")


TARGET_PIECES = ["a", "b", "c", "ab", "ca", "</s>"]  # EOS = 5
DRAFT_PIECES = ["a", "b", "c", "bc", "abc", "a", "cc", "<s>", "</s>"]  # BOS = 7, EOS = 8


def toy_pair() -> tuple[PieceTokenizer, PieceTokenizer]:
    return PieceTokenizer(TARGET_PIECES, eos=5), PieceTokenizer(DRAFT_PIECES, eos=8, bos=7)


@functools.cache
def models() -> tuple[TableLM, TableLM, VocabularyPair]:
    target_tok, draft_tok = toy_pair()
    target = TableLM(len(TARGET_PIECES), seed=11, sharpness=1.5)
    draft = TableLM(len(DRAFT_PIECES), seed=12, sharpness=1.5)
    draft.table = draft.table.double()  # q in float64, as the rules' 1e-12 arithmetic needs
    return target, draft, VocabularyPair.build(target_tok, draft_tok)


@functools.cache
def ptab(setting: str) -> np.ndarray:
    """The target's next-token distributions [V+1, V+1, V] (float64) under ``setting``."""
    target, _, _ = models()
    return probs_from_logits(target.table.double(), SETTINGS[setting]).numpy()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


# ---------------------------------------------------------------------------------------------- enumeration


class Script:
    """Stands in for ``verispec.sampling.sample`` in the drafter: draws the scripted tokens, then the first
    token of positive weight, recording the other choices as scripts still to run."""

    def __init__(self, choices: list[int]) -> None:
        self.choices = list(choices)
        self.position = 0
        self.prob = 1.0
        self.branches: list[list[int]] = []

    def __call__(
        self, weights: torch.Tensor, generator: torch.Generator, num_samples: int = 1
    ) -> torch.Tensor:
        w = weights.double() / weights.double().sum()  # [V]
        if self.position == len(self.choices):
            support = torch.nonzero(w > 0).flatten().tolist()
            self.branches += [[*self.choices, alt] for alt in support[1:]]
            self.choices.append(support[0])
        choice = self.choices[self.position]
        self.position += 1
        self.prob *= float(w[choice])
        return torch.tensor([choice])


def proposals(drafter, context: list[int], k: int) -> list[tuple[float, Proposal, object]]:
    """Every proposal the drafter can make from its state, with its probability and the drafter after it."""
    out, todo = [], [[]]
    while todo:
        script = Script(todo.pop())
        clone = copy.deepcopy(drafter, memo=_shared_memo(drafter))
        with mock.patch.object(cross_tokenizer, "sample", script):
            proposal = clone.propose(list(context), k, torch.Generator())
        todo += script.branches
        out.append((script.prob, proposal, clone))
    assert abs(sum(prob for prob, _, _ in out) - 1) < 1e-12
    return out


def _shared_memo(drafter) -> dict:
    """deepcopy's memo so that the models and the vocabulary pair are shared, not copied."""
    target, draft, pair = models()
    return {id(draft): draft, id(target): target, id(pair): pair, id(drafter.sampling): drafter.sampling}


def _fingerprint(value):
    """A hashable picture of a drafter's state (the models and the pair left out)."""
    if isinstance(value, TokenCache):
        return ("cache", tuple(value.tokens()))
    if isinstance(value, torch.Tensor):
        return tuple(value.flatten().tolist())
    if isinstance(value, dict):
        return tuple(sorted((k, _fingerprint(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_fingerprint(v) for v in value)
    if isinstance(value, (TableLM, VocabularyPair, SamplingParams)):
        return None
    if hasattr(value, "__dict__"):
        return (type(value).__name__, _fingerprint(vars(value)))
    return value


RuleFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, bool], Rule]


def real_rule(x: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, greedy: bool) -> Rule:
    """What the engine does: greedy at temperature 0; with q, rejection sampling; without, single guesses."""
    if greedy:
        return greedy_rule(x, p=p)
    if q is None:
        return single_guess_rule(x, p=p, dtype=torch.float64)
    return rejection_rule(x, q=q.double(), p=p, dtype=torch.float64)


def loop_joint(make_drafter, setting: str, k: int, rule_fn: RuleFn = real_rule) -> np.ndarray:
    """The exact joint distribution [V+1] * N of the first N target tokens of the speculative loop from an
    empty prompt (END = V pads after EOS)."""
    table = ptab(setting)
    vocab = table.shape[-1]
    eos = min(models()[2].target.eos_token_ids)
    greedy = SETTINGS[setting].greedy
    memo: dict = {}

    def p_rows(context: list[int], x: list[int]) -> torch.Tensor:
        seq = [vocab, vocab, *context, *x]
        rows = [table[seq[len(context) + j], seq[len(context) + j + 1]] for j in range(len(x) + 1)]
        return torch.from_numpy(np.stack(rows))  # [K'+1, V]

    def rest(drafter, context: list[int], need: int) -> dict[tuple[int, ...], float]:
        key = (tuple(context), need, _fingerprint(drafter))
        if key in memo:
            return memo[key]
        dist: dict[tuple[int, ...], float] = {}
        for draw_prob, proposal, after in proposals(drafter, context, k):
            x = proposal.tokens.tolist()
            q = None if proposal.q is None else proposal.q[None]  # [1, K', V]
            p = p_rows(context, x)
            rule = rule_fn(torch.tensor([x], dtype=torch.long).view(1, len(x)), q, p[None], greedy)
            accept = rule.accept_prob[0].double().tolist()  # [K']
            fallback = rule.fallback[0].double()  # [K'+1, V]
            reach = 1.0
            for s in range(len(x) + 1):
                stop = 1 - accept[s] if s < len(x) else 1.0
                for y in range(vocab):
                    weight = draw_prob * reach * stop * float(fallback[s, y])
                    if weight == 0:
                        continue
                    emitted = [*x[:s], y]
                    if eos in emitted:
                        emitted = emitted[: emitted.index(eos) + 1]
                    emitted = emitted[:need]
                    if len(emitted) == need or emitted[-1] == eos:
                        out = tuple(emitted) + (vocab,) * (need - len(emitted))
                        dist[out] = dist.get(out, 0.0) + weight
                        continue
                    follower = copy.deepcopy(after, memo=_shared_memo(after))
                    follower.observe(s)
                    for tail, prob in rest(follower, [*context, *emitted], need - len(emitted)).items():
                        whole = tuple(emitted) + tail
                        dist[whole] = dist.get(whole, 0.0) + weight * prob
                if s < len(x):
                    reach *= accept[s]
        memo[key] = dist
        return dist

    drafter = make_drafter(SETTINGS[setting])
    drafter.begin([])
    out = np.zeros((vocab + 1,) * N_TOKENS)
    for seq, prob in rest(drafter, [], N_TOKENS).items():
        out[seq] += prob
    return out


def reference(setting: str) -> np.ndarray:
    eos = min(models()[2].target.eos_token_ids)
    return target_joint(ptab(setting), N_TOKENS, eos)


def tli(sampling: SamplingParams):
    _, draft, pair = models()
    return TokenIntersectionDrafter(draft, pair, sampling)


def string(sampling: SamplingParams, keep_boundary: bool = False):
    _, draft, pair = models()
    return StringMatchDrafter(draft, pair, sampling, keep_boundary=keep_boundary)


def auto(sampling: SamplingParams):
    _, draft, pair = models()
    drafter = CrossTokenizerDrafter(draft, pair, sampling, "auto", cost_ratio=0.3)
    drafter.PROBES = 1  # both algorithms within the few rounds enumerated
    return drafter


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("make", [tli, string, auto], ids=["tli", "string", "auto"])
def test_cross_tokenizer_loop_is_exact(make, setting: str, k: int):
    joint = loop_joint(make, setting, k)
    assert abs(joint.sum() - 1) < 1e-12
    assert tv(joint, reference(setting)) <= EXACT_TV


def test_enumeration_drafts_and_accepts_across_the_pair():
    """The enumeration is not vacuous: the drafters propose, shared and re-encoded tokens get accepted."""
    rounds = {}
    for name, make in (("tli", tli), ("string", string)):
        drafter = make(SETTINGS["t1"])
        drafter.begin([])
        found = [(prob, prop.tokens.tolist()) for prob, prop, _ in proposals(drafter, [0, 1], 2)]
        rounds[name] = found
        assert any(len(tokens) == 2 for _, tokens in found), name
    # TLI proposes only shared tokens (a, b, c, EOS); string-level may propose the target's merged "ab"/"ca"
    assert {t for _, tokens in rounds["tli"] for t in tokens} <= {0, 1, 2, 5}


@pytest.mark.parametrize("setting", ["t1", "greedy"])
@pytest.mark.parametrize("make", [tli, string], ids=["tli", "string"])
def test_first_round_accepts_draft_tokens(make, setting: str):
    """Each algorithm gets draft tokens accepted on the toy pair: the exactness above is not bought by
    proposing nothing acceptable."""
    table, vocab = ptab(setting), len(TARGET_PIECES)
    accepted = 0.0  # expected first-position acceptances over the one-token contexts
    rounds = [
        (first, prob, proposal)
        for first in range(vocab - 1)
        for prob, proposal, _ in _fresh(make, setting, first)
    ]
    for first, prob, proposal in rounds:
        x = proposal.tokens.tolist()
        seq = [vocab, first, *x]
        p = torch.from_numpy(np.stack([table[seq[j], seq[j + 1]] for j in range(len(x) + 1)]))[None]
        q = None if proposal.q is None else proposal.q[None]
        rule = real_rule(torch.tensor([x], dtype=torch.long).view(1, len(x)), q, p, SETTINGS[setting].greedy)
        accepted += prob * float(rule.accept_prob[0, :1].sum()) if x else 0.0
    assert accepted > 0.05


def _fresh(make, setting: str, first: int):
    drafter = make(SETTINGS[setting])
    drafter.begin([])
    return proposals(drafter, [first], 2)


def test_boundary_token_kept_is_still_exact():
    """Keeping the last re-encoded token (maybe a prefix of a longer target token) only makes a worse guess:
    single guesses are exact whatever they are."""
    joint = loop_joint(functools.partial(string, keep_boundary=True), "t1", 2)
    assert tv(joint, reference("t1")) <= EXACT_TV


def test_unrenormalised_intersection_is_refused(monkeypatch):
    """q restricted to the intersection but not renormalised is not a distribution: the verifier refuses
    it."""

    def broken(q, pair):
        restricted = intersect(q, pair)
        if restricted is None:
            return None
        mass = float(torch.where(pair.shared, q, torch.zeros_like(q)).sum())
        return restricted[0], restricted[1] * mass

    monkeypatch.setattr(cross_tokenizer, "intersect", broken)
    with pytest.raises(UsageError, match="q does not sum to 1"):
        loop_joint(tli, "t1", 2)


def test_duplicate_pieces_not_added_up_are_caught(monkeypatch):
    """Two draft ids spell "a": mapping q to target ids by assignment (the last one wins) instead of adding
    them up, renormalised so that it still sums to 1, is not the distribution the token was drawn from."""

    def broken(q, pair):
        restricted = intersect(q, pair)
        if restricted is None:
            return None
        mapped = torch.zeros(pair.target.vocab_size, dtype=q.dtype)
        mapped[pair.to_target[pair.shared]] = restricted[0][pair.shared]
        return restricted[0], mapped / mapped.sum()

    monkeypatch.setattr(cross_tokenizer, "intersect", broken)
    assert tv(loop_joint(tli, "t1", 2), reference("t1")) > BROKEN_TV


def test_string_guesses_verified_as_samples_are_caught():
    """String-level guesses are not samples of any q: verifying them by rejection sampling with some q (here
    uniform) instead of as single guesses is wrong."""

    def as_samples(x, q, p, greedy):
        told = torch.full((1, x.shape[1], p.shape[-1]), 1.0 / p.shape[-1], dtype=torch.float64)
        return rejection_rule(x, q=told, p=p, dtype=torch.float64)

    assert tv(loop_joint(string, "t1", 2, as_samples), reference("t1")) > BROKEN_TV


# ---------------------------------------------------------------------------------------------- the pieces


def test_vocabulary_pair_maps_equal_bytes_and_eos():
    _, _, pair = models()
    # draft a, b, c, a (dup) map to target a, b, c; bc/abc/cc have no target token; EOS to EOS; BOS nothing
    assert pair.to_target.tolist() == [0, 1, 2, -1, -1, 0, -1, -1, 5]
    q = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.2, 0.1, 0.1, 0.0, 0.1])
    restricted, mapped = intersect(q, pair)
    assert torch.allclose(restricted.sum(), torch.tensor(1.0))
    assert torch.allclose(mapped, torch.tensor([0.4, 0.2, 0.2, 0.0, 0.0, 0.2]))


def test_draft_text_rolls_back_to_the_accepted_text():
    _, _, pair = models()
    text = DraftText(pair)
    assert text.sync([0, 1]) == 1  # "ab": the draft's BOS stands, then a, b
    assert text.ids == [7, 0, 1]
    text.push(2)  # drafted "c", then "cc"
    text.push(6)
    # the target accepted "c" then wrote "ab": "abcab" — the drafted "c" stays, "cc" does not
    kept = text.sync([0, 1, 2, 3])
    assert kept == 4 and text.ids == [7, 0, 1, 2, 0, 1]
    assert text.text == b"abcab"


def test_string_level_drops_the_boundary_token():
    _, draft, pair = models()
    drafter = StringMatchDrafter(draft, pair, SETTINGS["greedy"])
    kept = StringMatchDrafter(draft, pair, SETTINGS["greedy"], keep_boundary=True)
    for d in (drafter, kept):
        d.begin([])
    a = drafter.propose([0], 3, torch.Generator()).tokens.tolist()
    b = kept.propose([0], 3, torch.Generator()).tokens.tolist()
    assert b[: len(a)] == a and len(b) == len(a) + 1


def test_disjoint_vocabularies_are_refused():
    target = PieceTokenizer(["a", "b", "</s>"], eos=2)
    draft = PieceTokenizer(["x", "y", "z", "</s>"], eos=3)
    with pytest.raises(UsageError, match=r"shares 0 of its 3 tokens \(0.0%\)"):
        VocabularyPair.build(target, draft)


def test_a_tokenizer_that_cannot_spell_is_refused():
    from fakes import LetterTokenizer

    with pytest.raises(UsageError, match="cannot spell its tokens in bytes"):
        VocabularyPair.build(LetterTokenizer(4), toy_pair()[1])


def test_same_vocabulary():
    target, draft = toy_pair()
    assert same_vocabulary(target, PieceTokenizer(TARGET_PIECES, eos=5))
    assert not same_vocabulary(target, draft)


# ---------------------------------------------------------------------------------------------- a real pair

PROMPTS = ["Once upon a time, there was a little girl named Lily. She", "Tom had a red ball. One day"]


@pytest.fixture(scope="module")
def real_pair(shared_model):
    """SmolLM2-135M (GPT-2 byte-level BPE, 49,152 tokens) and, as its draft, stories260K (SentencePiece,
    512 tokens)."""
    from verispec.models.registry import load_model

    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    try:
        target = load_model("smollm2-135m", precision="auto")
    except ValueError as err:  # no registry access on this machine: say so
        pytest.skip(f"SmolLM2-135M unavailable: {err}")
    return target, load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


def _speculator(real_pair, algorithm: str):
    from verispec.api import Speculator

    target, draft = real_pair
    return Speculator(target, draft=draft, drafter="model", cross_tokenizer=algorithm)


def test_real_pair_is_spelled_and_shared(real_pair):
    spec = _speculator(real_pair, "tli")
    pair = spec.pair
    assert pair is not None and spec.drafter_name == "model-tli"
    assert pair.draft_prefix_space and not pair.target_prefix_space  # SentencePiece's dummy prefix
    assert pair.overlap > 0.9  # most of the 512 pieces are GPT-2 tokens too
    spelled = pair.target_bytes
    assert b"".join(spelled[t] for t in pair.target.encode("Hello wörld\n")) == "Hello wörld\n".encode()
    draft_ids = pair.draft.encode("Once upon a time")
    assert pair.target_tokens(b"".join(pair.draft_bytes[i] for i in draft_ids)) == pair.target.encode(
        " Once upon a time", add_bos=False
    )


@pytest.mark.parametrize("algorithm", ["tli", "string", "auto"])
def test_real_pair_greedy_equals_plain_greedy(real_pair, algorithm: str):
    from verispec.api import Speculator
    from verispec.options import SamplingParams

    greedy = SamplingParams(temperature=0)
    plain = Speculator(real_pair[0], drafter="none")
    spec = _speculator(real_pair, algorithm)
    drafted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=40, sampling=greedy).token_ids
        got = spec.generate(prompt, k=3, max_new_tokens=40, sampling=greedy)
        assert got.token_ids == want
        drafted += got.stats["drafted"]
        assert got.stats["drafter"] == f"model-{algorithm}"
    assert drafted > 0


@pytest.mark.parametrize("algorithm", ["tli", "string"])
def test_real_pair_first_sampled_token_follows_the_target(real_pair, algorithm: str):
    """600 seeded generations through the engine at temperature 1 (their first rounds,
    :func:`first_rounds.first_rounds`): the first token's counts pass a chi-square (α = 1e-3 / 2) against
    SmolLM2's own next-token distribution, and the verifier both accepted and rejected draft tokens."""
    from scipy import stats as scipy_stats

    from verispec.engine.sequence import Request

    target, _ = real_pair
    model, tokenizer = target
    spec = _speculator(real_pair, algorithm)
    prompt, n = "Once upon a time, there was a little girl named", 600

    def request(seed: int) -> Request:
        sampling = SamplingParams(temperature=1.0, seed=seed, invariant=False)
        return spec.request(prompt, GenerationOptions(k=2, max_new_tokens=2, sampling=sampling))[0]

    counts = first_token_counts(model, request, n)
    ids = tokenizer.encode(prompt)
    logits = model.forward(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), model.new_cache())[0, -1]
    expected = probs_from_logits(logits.double(), SamplingParams()).numpy() * n
    big = expected >= 5
    observed, wanted = (
        np.append(counts[big], counts[~big].sum()),
        np.append(expected[big], expected[~big].sum()),
    )
    assert scipy_stats.chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue > 1e-3 / 2


def test_cli_generate_across_tokenizers(real_pair, shared_model, capsys):
    """``generate --draft FILE --draft-tokenizer FILE`` just works, greedy output == ``--drafter none``'s."""
    import json

    from verispec import cli

    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    common = ["generate", PROMPTS[0], "--temperature", "0", "--max-new-tokens", "24", "--json"]
    draft = ["--draft", str(root / "stories260K.bin"), "--draft-tokenizer", str(root / "tok512.bin")]
    assert cli.main([*common, *draft, "--k", "3", "--cross-tokenizer", "string"]) == 0
    across = json.loads(capsys.readouterr().out)
    assert cli.main([*common, "--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert across["token_ids"] == plain["token_ids"] and across["stats"]["drafter"] == "model-string"


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "hi", "--cross-tokenizer", "tli"], "applies to a draft whose tokenizer differs"),
        (["generate", "hi", "--draft-tokenizer", "tok.bin"], "--draft-tokenizer is the tokenizer of a draft"),
        (["generate", "hi", "--cross-tokenizer", "magic"], "invalid choice"),
        (["bench-load", "--draft", "x"], "--draft is the draft model of the method model"),
        (["bench-load", "--methods", "none,model"], "the method model drafts with --draft SPEC"),
        (["bench-load", "--cross-tokenizer", "tli"], "--cross-tokenizer go with --draft"),
        (["bench-serve", "--cross-tokenizer", "tli"], "leave out --cross-tokenizer"),
    ],
)
def test_cli_cross_tokenizer_bad_input(args, message, capsys):
    from verispec import cli

    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_auto_weighs_a_draft_forward_by_the_calibrated_cost():
    """The registry's model drafter across tokenizers: auto's cost per draft forward is the calibrated c when
    there is one, else the models' size ratio (0.1 for models that are not torch modules)."""
    from verispec.drafting.registry import DRAFTERS, DraftInputs

    target, draft, pair = models()
    inputs = DraftInputs(SETTINGS["t1"], target, draft=draft, pair=pair)
    assert DRAFTERS["model"].chain(inputs).cost_ratio == 0.1
    measured = DraftInputs(SETTINGS["t1"], target, draft=draft, pair=pair, cost_ratio=0.37)
    chain = DRAFTERS["model"].chain(measured)
    assert isinstance(chain, CrossTokenizerDrafter) and chain.cost_ratio == 0.37


def test_a_draft_across_tokenizers_has_its_draft_models_cost_identity():
    """Issue 53: calibrated costs are cached under each drafter's cost identity. A draft across tokenizers
    was known by its name alone ("model"), so every draft model drafting for a target shared one cached
    cost; its identity now holds its draft model's, and which algorithm it runs."""
    _, draft, pair = models()
    sampling = SamplingParams(temperature=0)
    longer = TableLM(len(DRAFT_PIECES), seed=12, max_context=512)  # another draft model: a longer context
    identities = [
        TokenIntersectionDrafter(draft, pair, sampling).cost_identity(),
        StringMatchDrafter(draft, pair, sampling).cost_identity(),
        CrossTokenizerDrafter(draft, pair, sampling, "auto").cost_identity(),
        CrossTokenizerDrafter(draft, pair, sampling, "tli").cost_identity(),
        CrossTokenizerDrafter(longer, pair, sampling, "auto").cost_identity(),
    ]
    assert all(identity["model"]["class"] == "TableLM" for identity in identities)
    assert len({json.dumps(identity, sort_keys=True) for identity in identities}) == len(identities)

"""The suffix drafter (verispec.drafting.suffix): its index, the shared cache (budget, eviction, threads,
files, bad input), when outputs enter the cache, the registry entry, and the engine on stories260K (greedy ==
plain alone and in a continuous batch with a warm shared cache, chains and trees; a chi-square of the first
sampled token with an adversarial warm cache)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from first_rounds import first_token_counts
from verispec.api import Speculator
from verispec.costs.policies import ConstantK
from verispec.drafting.registry import DRAFTERS, DraftInputs
from verispec.drafting.suffix import SuffixDrafter, SuffixTreeDrafter
from verispec.drafting.suffix_cache import FORMAT, SuffixCache, tokenizer_identity
from verispec.drafting.suffix_index import SuffixConfig, TokenIndex
from verispec.drafting.tree import TreeShape
from verispec.engine.engine import SpeculativeEngine
from verispec.engine.sequence import EngineConfig, GenerationStats, Request
from verispec.errors import UsageError
from verispec.models.registry import load_model
from verispec.sampling import SamplingParams, probs_from_logits

G = torch.Generator()
GREEDY = SamplingParams(temperature=0)


def chain(cache: SuffixCache, context: list[int], k: int = 8, **config) -> list[int]:
    drafter = SuffixDrafter(cache, SuffixConfig(**config))
    drafter.begin(context[:1])
    return drafter.propose(context, k, G).tokens.tolist()


# ---------------------------------------------------------------------------------------------- the index


def test_the_longest_match_and_the_most_frequent_continuation():
    cache = SuffixCache()
    for tail in ([5, 6, 7], [5, 6, 8], [5, 6, 8], [9, 9, 9]):
        cache.add([], [1, 2, 3, 4, *tail])
    cache.add([], [0, 3, 4, 7, 7, 7])  # a shorter match elsewhere: not the longest
    assert chain(cache, [1, 2, 3, 4]) == [5, 6, 8]  # 5 (3/4), 6, then 8 (2/3 of those)
    assert chain(cache, [1, 2, 3, 4], k=2) == [5, 6]  # capped by K
    assert chain(cache, [3, 4], k=8) == [5, 6]  # alpha · match length: 2 tokens for a 2-token match
    assert chain(cache, [3, 4], k=8, alpha=2.0) == [5, 6, 8]
    assert chain(cache, [1, 2, 3, 4], min_prob=0.9) == []  # 5 is 3/4 likely
    assert chain(cache, [3, 4], min_match=3) == []
    assert chain(cache, [42]) == []


def test_the_request_s_own_text_drafts_and_grows_as_it_commits():
    drafter = SuffixDrafter(SuffixCache())
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    drafter.begin(prompt)
    assert drafter.propose(prompt, 4, G).tokens.tolist() == [3, 4]
    assert drafter.propose([*prompt, 3], 4, G).tokens.tolist() == [4, 5, 6]
    assert drafter.local.size == len(prompt) + 1  # read incrementally


def test_the_tree_ranks_children_by_count_with_distinct_siblings():
    cache = SuffixCache()
    for tail in ([5, 6], [5, 6], [5, 7], [8, 9]):
        cache.add([], [1, 2, *tail])
    shape = TreeShape.full(3, 2)
    tree = SuffixTreeDrafter(shape, SuffixDrafter(cache, SuffixConfig(alpha=2.0)))
    tree.begin([0])
    proposal = tree.propose_tree([0, 1, 2], shape, G)
    assert proposal.tokens.tolist() == [2, 5, 8, 6, 7, 9]
    assert proposal.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert proposal.q is None
    capped = tree.propose_tree([0, 1, 2], shape.capped(1, 10), G)
    assert capped.tokens.tolist() == [2, 5, 8]


def test_eviction_compacts_without_changing_lookups():
    """Evicted positions are skipped, then dropped: lookups equal those of an index of the live sequences."""
    rng = np.random.default_rng(0)
    cache = SuffixCache(budget=300)
    for _ in range(60):
        cache.add([], rng.integers(0, 6, rng.integers(5, 40)).tolist())
        held = cache.sequences()
        assert sum(map(len, held)) == cache.stats()["tokens"] <= 300
        fresh = TokenIndex()
        for sequence in held:
            fresh.extend(sequence)
            fresh.close()
        context = rng.integers(0, 6, 6).tolist()
        config = SuffixConfig()
        assert cache.chain(context, config, 6) == fresh.draft_chain(context, config, 6)
    stats = cache.stats()
    assert stats["evictions"] > 0 and stats["budget"] == 300 and stats["sequences"] == len(cache.sequences())


def _naive_chain(
    flat: list[int], context: list[int], config: SuffixConfig, k: int
) -> tuple[list[int], float]:
    """The definition, on a plain list of tokens (-1 between sequences): the occurrences of the context's
    last token followed by a token (the most recent max_candidates), each one's match length backwards, the
    longest kept; then, depth by depth, the most frequent next token (ties: the smaller), while the path's
    probability stays >= min_prob."""
    ends = [i for i in range(len(flat) - 1) if flat[i] == context[-1] and flat[i + 1] != -1]
    ends = ends[-config.max_candidates :]
    if not ends:
        return [], 0.0

    def length(end: int) -> int:
        n = 0
        while n < min(config.max_depth, len(context)) and end - n >= 0 and flat[end - n] == context[-1 - n]:
            n += 1
        return n

    best = max(map(length, ends))
    if best < config.min_match:
        return [], 0.0
    ends = [e for e in ends if length(e) == best]
    tokens, prob, score = [], 1.0, 0.0
    for depth in range(1, min(k, int(config.alpha * best)) + 1):
        following = [flat[e + depth] if e + depth < len(flat) else -1 for e in ends]
        counts = {t: following.count(t) for t in following if t != -1}
        if not counts:
            break
        token = min(counts, key=lambda t: (-counts[t], t))
        if prob * counts[token] / len(ends) < config.min_prob:
            break
        prob *= counts[token] / len(ends)
        tokens.append(token)
        score += prob
        ends = [e for e, t in zip(ends, following, strict=True) if t == token]
    return tokens, score


@settings(max_examples=120, deadline=None)
@given(
    outputs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=25),
    contexts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=4),
    budget=st.integers(5, 200),
    candidates=st.integers(1, 40),
    depth=st.integers(1, 8),
    k=st.integers(1, 10),
)
def test_chains_equal_the_definition_on_plain_lists(outputs, contexts, budget, candidates, depth, k):
    """A shared cache (evictions and compactions included) and a request's open index draft what the
    definition does on the held sequences as plain lists; a tree shaped as a chain drafts the same."""
    cache = SuffixCache(budget=budget)
    for output in outputs:
        cache.add([], output)
    config = SuffixConfig(max_depth=depth, max_candidates=candidates)
    local = TokenIndex()
    local.extend([t for output in outputs for t in output])  # one open sequence
    for context in contexts:
        held = [t for sequence in cache.sequences() for t in [*sequence, -1]]
        expected = _naive_chain(held, context, config, k)
        tokens, score = cache.chain(context, config, k)
        assert tokens == expected[0] and score == pytest.approx(expected[1])
        nodes, tree_tokens, tree_score = cache.tree(context, TreeShape.chain(k), config)
        assert tree_tokens[1:] == tokens and tree_score == pytest.approx(score)
        expected = _naive_chain([t for output in outputs for t in output], context, config, k)
        tokens, score = local.draft_chain(context, config, k)
        assert tokens == expected[0] and score == pytest.approx(expected[1])


def test_a_match_stops_at_the_first_position_of_a_full_array():
    """A match walking back past position 0 ends there, also when the tokens fill the array's first
    capacity (nothing wraps around to the array's end)."""
    index = TokenIndex()
    index.extend([7, 8] + [0] * (len(index.tokens) - 2))
    assert index.match([0, 7, 8], max_depth=8, max_candidates=8).length == 2
    assert index.draft_chain([0, 7, 8], SuffixConfig(min_match=3), 4) == ([], 0.0)


def test_a_sequence_longer_than_the_budget_keeps_its_end():
    cache = SuffixCache(budget=4)
    cache.add([9], list(range(10)))
    assert cache.sequences() == [[6, 7, 8, 9]]
    cache = SuffixCache(budget=100, prompts=True)
    cache.add([9, 9], [1, 2])
    assert cache.sequences() == [[9, 9], [1, 2]]


def test_threads_share_one_cache():
    cache = SuffixCache(budget=2000)
    errors: list[Exception] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                cache.add([], rng.integers(0, 20, 30).tolist())
                chain(cache, rng.integers(0, 20, 5).tolist())
                cache.stats()
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = cache.stats()
    assert stats["tokens"] == sum(map(len, cache.sequences())) <= 2000
    assert stats["sequences"] + stats["evictions"] == 600


# ------------------------------------------------------------------------------------------- files, bad input


def test_save_and_load(tmp_path):
    cache = SuffixCache(budget=50, vocabulary="512:abc")
    for i in range(10):
        cache.add([], [i, i + 1, i + 2, 7, 8])
    path = tmp_path / "suffix.npz"
    cache.save(path)
    loaded = SuffixCache.load(path, vocabulary="512:abc")
    assert loaded.sequences() == cache.sequences() and loaded.budget == 50
    assert SuffixCache.load(path, budget=12).sequences() == cache.sequences()[-2:]
    assert [p.name for p in tmp_path.iterdir()] == ["suffix.npz"]  # nothing left beside it


@pytest.mark.parametrize(
    "content",
    [b"not a zip", b"", "foreign.npz", "lying.npz", bytes(range(256)) * 20],
    ids=["garbage", "empty", "foreign", "lying", "random-bytes"],
)
def test_a_corrupt_or_foreign_file_is_one_line(tmp_path, content):
    path = tmp_path / "bad.npz"
    if content == "foreign.npz":
        np.savez(path, weights=np.zeros(3))
    elif content == "lying.npz":
        header = {"format": np.array(FORMAT), "vocabulary": np.array(""), "budget": np.array(9)}
        np.savez(
            path, **header, lengths=np.array([5]), tokens=np.array([1, 2])
        )  # lengths and tokens disagree
    else:
        path.write_bytes(content)
    with pytest.raises(UsageError, match="is not a verispec suffix cache") as err:
        SuffixCache.load(path)
    assert "\n" not in str(err.value) and "pickle" not in str(err.value)  # never numpy's advice to unpickle


def test_bad_input_is_one_line(tmp_path):
    path = tmp_path / "c.npz"
    SuffixCache(vocabulary="512:abc").save(path)
    with pytest.raises(UsageError, match="another tokenizer"):
        SuffixCache.load(path, vocabulary="49152:def")
    with pytest.raises(UsageError, match="cannot read"):
        SuffixCache.load(tmp_path / "missing.npz")
    for budget in (0, -5, 1.5, True, "9"):
        with pytest.raises(UsageError, match="budget"):
            SuffixCache(budget)  # type: ignore[arg-type]
    for bad in (
        {"max_depth": 0},
        {"alpha": 0},
        {"min_prob": 1.5},
        {"min_match": 30},
        {"max_candidates": True},
    ):
        with pytest.raises(UsageError, match="suffix"):
            SuffixConfig(**bad)
    with pytest.raises(UsageError, match="dynamic"):
        SuffixTreeDrafter(TreeShape.parse("2x2:3"))


# ---------------------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a bird"]


def run(model, prompts: list[list[int]], drafters, slots: int, k: int = 4, n: int = 40):
    """Each prompt decoded greedily with its drafter in one engine of ``slots`` slots: (ids, stats) each."""
    engine = SpeculativeEngine(model, slots=slots)
    stats = [GenerationStats("suffix", str(k)) for _ in prompts]
    todo = list(zip(prompts, drafters, stats, strict=True))
    running = []
    while todo or engine.running:
        while todo and engine.free_slots:
            prompt, drafter, row = todo.pop(0)
            running.append(
                engine.submit(Request(prompt, EngineConfig(n, GREEDY), drafter, ConstantK(k), row))
            )
        engine.step()
    return [r.ids[len(r.request.prompt) :] for r in running], stats


def test_greedy_equals_plain_alone_and_batched_with_a_warm_shared_cache(stories):
    """Greedy with the suffix drafter == plain greedy: cold, then warm (the cache holds the first pass's
    outputs), alone and in a continuous batch of 3 slots, chains and trees; warm drafts far more accepted
    tokens, and a cancelled request's output never enters."""
    model, tokenizer = stories
    plain = Speculator(stories, drafter="none")
    ids = [plain.encode_prompt(p) for p in PROMPTS]
    reference = [plain.generate(p, max_new_tokens=40, sampling=GREEDY).token_ids for p in PROMPTS]
    cache = SuffixCache(vocabulary=tokenizer_identity(tokenizer))
    cold, cold_stats = run(model, ids, [SuffixDrafter(cache) for _ in ids], slots=1)
    assert cold == reference
    assert cache.stats()["sequences"] == len(PROMPTS)  # each output entered when it finished
    tree = TreeShape.full(2, 3)
    for slots in (1, 3):
        for make in (lambda: SuffixDrafter(cache), lambda: SuffixTreeDrafter(tree, SuffixDrafter(cache))):
            warm, warm_stats = run(model, ids, [make() for _ in ids], slots=slots)
            assert warm == reference
    assert sum(s.accepted for s in warm_stats) > 0
    chain_warm = run(model, ids, [SuffixDrafter(cache) for _ in ids], slots=3)[1]
    assert sum(s.accepted for s in chain_warm) > 2 * sum(s.accepted for s in cold_stats)
    engine = SpeculativeEngine(model)
    held = cache.stats()["sequences"]
    running = engine.submit(Request(ids[0], EngineConfig(40, GREEDY), SuffixDrafter(cache), ConstantK(4),
                                    GenerationStats("suffix", "4")))  # fmt: skip
    engine.step()
    engine.cancel(running)
    assert cache.stats()["sequences"] == held


def test_the_registry_entry_through_the_speculator(stories):
    """``drafter="suffix"``: chains and trees == plain greedy; DraftInputs' shared cache is used, None a
    private one."""
    plain = Speculator(stories, drafter="none")
    kind = DRAFTERS["suffix"]
    assert kind.takes_trees and kind.drafts and not kind.learned and not kind.needs_draft_model
    for tree in (None, TreeShape.full(2, 2)):
        spec = Speculator(stories, drafter="suffix", tree=tree)
        for prompt in PROMPTS[:2]:
            options = dict(max_new_tokens=30, sampling=GREEDY)
            assert spec.generate(prompt, **options).token_ids == plain.generate(prompt, **options).token_ids
    shared = SuffixCache()
    inputs = DraftInputs(GREEDY, stories[0], suffix_cache=shared)
    assert kind.chain(inputs).cache is shared
    assert kind.chain(DraftInputs(GREEDY, stories[0])).cache is not shared
    assert kind.tree(kind.chain(inputs), TreeShape.full(2, 2), None).drafter.cache is shared


@pytest.mark.slow
def test_first_sampled_token_follows_the_target_with_an_adversarial_warm_cache(stories):
    """3000 seeded first rounds drafting from a cache of sampled outputs of the prompt and of the target's
    least likely next tokens: the first token's counts pass a chi-square against the target's distribution."""
    model, tokenizer = stories
    plain = Speculator(stories, drafter="none")
    prompt = "Once upon a time, there was a"
    ids = plain.encode_prompt(prompt)
    logits = model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache())[0, -1]
    p = probs_from_logits(logits.double(), SamplingParams()).numpy()  # [V]
    cache = SuffixCache()
    for seed in range(6):
        out = plain.generate(prompt, max_new_tokens=8, sampling=SamplingParams(seed=seed)).token_ids
        cache.add(ids, out)
    for worst in np.argsort(p)[:3].tolist():
        cache.add([], [*ids[-6:], worst, worst])

    def request(seed: int) -> Request:
        sampling = SamplingParams(seed=seed, invariant=False)
        return Request(ids, EngineConfig(2, sampling), SuffixDrafter(cache), ConstantK(3),
                       GenerationStats("suffix", "3"))  # fmt: skip

    n = 3000
    counts = first_token_counts(model, request, n)
    expected = p * n
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    assert scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def test_bench_suffix_cache_fills_within_the_budget_and_times_lookups(shared_model, tmp_path, capsys):
    """`verispec bench-suffix-cache` on stories260K: the cache held within its budget at every record, both
    proposals timed against a target step; bad settings are one line, exit 2, before a model loads."""
    import json

    from verispec import cli

    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    argv = ["bench-suffix-cache", *model, "--requests", "60", "--budget", "2000", "--lookups", "8"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["fill"][-1]["requests"] == 60 and results["fill"][-1]["evictions"] > 0
    assert all(row["tokens"] <= 2000 for row in results["fill"])
    assert results["target_step_ms"] > 0
    assert {"chain", "tree"} == set(results["lookups"]) and results["lookups"]["tree"]["median_ms"] > 0
    assert "median / target step" in capsys.readouterr().out
    for bad in (["--requests", "0"], ["--budget", "-1"], ["--tree", "0x"]):
        assert cli.main(["bench-suffix-cache", *model, *bad, "--out", str(tmp_path / "no")]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "no").exists()

"""The engine on table-driven models: greedy identity, exact stopping, cache bookkeeping, exact sampling."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

import verispec.engine.rounds as rounds_module
from fakes import TableLM
from one_sequence import OneSequence
from verispec.costs.policies import AdditiveK, ConstantK
from verispec.drafting.base import NoDrafter
from verispec.drafting.draft_model import ModelDrafter
from verispec.drafting.ngram import NGramDrafter
from verispec.engine.engine import SpeculativeEngine
from verispec.engine.sequence import EngineConfig, GenerationStats
from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits
from verispec.verify.chain import rejection_rule, sample_verdict

V = 6
GREEDY = SamplingParams(temperature=0)


def noisy_copy(model: TableLM, seed: int, noise: float) -> TableLM:
    """A draft that agrees with ``model`` often but not always."""
    draft = TableLM(model.vocab_size, seed=seed, max_context=model.max_context)
    draft.table = model.table + noise * draft.table
    return draft


def run(engine: SpeculativeEngine, prompt: list[int], config: EngineConfig, check_cache: bool = True):
    """Runs a generation; after every round checks that the target's cache holds the committed tokens but the
    last. Returns (generated ids, stats)."""
    stats = GenerationStats(engine.drafter.name, engine.k_policy.name)
    out: list[int] = []
    for tokens in engine.stream(prompt, config, stats):
        out += tokens
        if check_cache:
            assert engine.cache.tokens() == (prompt + out)[:-1]
    return out, stats


def drafters(target: TableLM, sampling: SamplingParams):
    yield NoDrafter()
    yield NGramDrafter(max_ngram=3, min_ngram=1)
    yield ModelDrafter(noisy_copy(target, 99, 0.7), sampling, target.vocab_size)
    yield ModelDrafter(target, sampling, target.vocab_size)  # a perfect draft: every token accepted


@pytest.mark.parametrize(
    "policy", [ConstantK(1), ConstantK(3), ConstantK(8), AdditiveK()], ids=lambda p: p.name
)
@pytest.mark.parametrize("seed", range(4))
def test_greedy_output_equals_plain_greedy(policy, seed):
    """At temperature 0 every drafter and k gives the greedy tokens, exactly max_new_tokens of them."""
    target = TableLM(V, seed=seed)
    prompt = [seed % V, (seed + 2) % V, 1]
    config = EngineConfig(max_new_tokens=37, sampling=GREEDY)
    reference = target.greedy(prompt, 37)
    for drafter in drafters(target, GREEDY):
        out, stats = run(OneSequence(target, drafter, policy), prompt, config)
        assert out == reference, drafter.name
        assert stats.new_tokens == 37 and stats.stop_reason == "max_new_tokens"


def test_perfect_draft_needs_one_call_per_k_plus_one_tokens():
    target = TableLM(V, seed=3)
    engine = OneSequence(target, ModelDrafter(target, GREEDY, V), ConstantK(4))
    out, stats = run(engine, [1, 2], EngineConfig(max_new_tokens=25, sampling=GREEDY))
    assert len(out) == 25
    assert stats.target_calls == 5  # 5 tokens per round: 4 accepted + 1 bonus
    assert stats.acceptance_rate == 1.0 and stats.acceptance_per_position == [1.0] * 4


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 9])
def test_never_overshoots_max_new_tokens(max_new):
    """k is capped by the tokens still allowed, so even a fully accepted draft stops exactly at the limit."""
    target, draft = TableLM(V, seed=5), TableLM(V, seed=5)  # the same weights: every draft token is accepted
    engine = OneSequence(target, ModelDrafter(draft, GREEDY, V), ConstantK(8))
    out, stats = run(engine, [0], EngineConfig(max_new_tokens=max_new, sampling=GREEDY))
    assert out == target.greedy([0], max_new)
    assert max(target.calls) <= max_new  # no round scored more positions than tokens it may keep


def test_stops_at_end_of_sequence_inside_a_draft():
    target = TableLM(V, seed=7)
    reference = target.greedy([2, 3], 40)
    eos = reference[10]  # a token the greedy text emits: its first occurrence ends the output
    expected = target.greedy([2, 3], 40, eos=frozenset({eos}))
    for drafter in drafters(target, GREEDY):
        out, stats = run(
            OneSequence(target, drafter, ConstantK(5)),
            [2, 3],
            EngineConfig(max_new_tokens=40, sampling=GREEDY, eos_token_ids=frozenset({eos})),
        )
        assert out == expected and out[-1] == eos and stats.stop_reason == "eos"


def test_stops_at_the_context_limit():
    target = TableLM(V, seed=1, max_context=20)
    engine = OneSequence(target, ModelDrafter(target, GREEDY, V), ConstantK(6))
    out, stats = run(engine, [1, 2, 3], EngineConfig(max_new_tokens=100, sampling=GREEDY))
    assert len(out) == 17 and stats.stop_reason == "context"
    assert out == target.greedy([1, 2, 3], 17)


def test_bad_prompts():
    target = TableLM(V, seed=1, max_context=8)
    engine = OneSequence(target, NoDrafter(), ConstantK(2))
    config = EngineConfig(max_new_tokens=4, sampling=GREEDY)
    with pytest.raises(ValueError, match="empty"):
        run(engine, [], config)
    with pytest.raises(ValueError, match="context holds 8"):
        run(engine, list(range(5)) + [0, 1, 2], config)


def test_engine_config_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        EngineConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="stop strings"):
        EngineConfig(stop=("",))


def test_draft_vocabulary_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differs from the target"):
        ModelDrafter(TableLM(V + 1, seed=0), GREEDY, target_vocab_size=V)


def test_draft_cache_stays_in_sync_after_bonus_tokens():
    """After each round the draft's cache holds a prefix of the committed tokens (never a rejected one)."""
    target = TableLM(V, seed=11)
    drafter = ModelDrafter(noisy_copy(target, 5, 1.5), GREEDY, V)
    engine = OneSequence(target, drafter, AdditiveK())
    prompt = [4, 1]
    stats = GenerationStats("model", "additive")
    out: list[int] = []
    for tokens in engine.stream(prompt, EngineConfig(max_new_tokens=60, sampling=GREEDY), stats):
        out += tokens
        cached = drafter.cache.tokens()
        assert cached == (prompt + out)[: len(cached)]
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # both outcomes were exercised


def test_ngram_drafter_worked_example():
    """the cat sat on the mat . the cat → proposes 'sat on the' (match of the last 2 tokens)."""
    words = "the cat sat on the mat . the cat".split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    ids = [vocab[w] for w in words]
    proposal = NGramDrafter(max_ngram=3, min_ngram=1).propose(ids, 3, torch.Generator())
    assert proposal.q is None
    assert proposal.tokens.tolist() == [vocab["sat"], vocab["on"], vocab["the"]]
    assert NGramDrafter(2, 2).propose([1, 2, 3, 4], 3, torch.Generator()).tokens.numel() == 0
    with pytest.raises(ValueError):
        NGramDrafter(max_ngram=1, min_ngram=2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=40),
    st.lists(st.integers(0, 4), max_size=12),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 5),
)
def test_ngram_index_proposes_the_first_continuation(prompt, grown, low, span, k):
    """The chain drafter's incremental index proposes exactly the first of the scanning lookup's
    continuations (the longest n-gram, its latest occurrence), as the context grows round by round and when
    it is replaced by another one."""
    drafter = NGramDrafter(max_ngram=low + span - 1, min_ngram=low)
    drafter.begin(prompt)
    context = list(prompt)
    for token in [None, *grown]:
        if token is not None:
            context.append(token)
        expected = next(drafter.continuations(context, k), None)
        got = drafter.propose(context, k, torch.Generator()).tokens.tolist()
        assert got == ([] if expected is None else expected.tolist())
    shorter = context[: max(1, len(context) // 2)]  # not a growth of the indexed context: indexed afresh
    expected = next(drafter.continuations(shorter, k), None)
    assert drafter.propose(shorter, k, torch.Generator()).tokens.tolist() == (
        [] if expected is None else expected.tolist()
    )


def test_additive_policy():
    policy = AdditiveK(k_start=4, k_min=1, k_max=7)
    policy.observe(4, 4)
    assert policy.next_k() == 6
    policy.observe(6, 6)
    assert policy.next_k() == 7
    for _ in range(10):
        policy.observe(7, 0)
    assert policy.next_k() == 1
    with pytest.raises(ValueError):
        AdditiveK(k_start=0)
    with pytest.raises(ValueError):
        ConstantK(-1)


def sampled_run(target, drafter, seed: int, n: int, sampling_kw=None) -> list[int]:
    sampling = SamplingParams(seed=seed, invariant=False, **(sampling_kw or {}))
    if isinstance(drafter, ModelDrafter):
        drafter = ModelDrafter(drafter.model, sampling, target.vocab_size)
    out, _ = run(OneSequence(target, drafter, ConstantK(3)), [1], EngineConfig(n, sampling), False)
    return out


def test_same_seed_same_tokens_different_seed_different_tokens():
    target = TableLM(V, seed=2, sharpness=1.0)
    drafter = ModelDrafter(noisy_copy(target, 8, 1.0), SamplingParams(), V)
    a = sampled_run(target, drafter, seed=123, n=40)
    assert a == sampled_run(target, drafter, seed=123, n=40)
    assert a != sampled_run(target, drafter, seed=124, n=40)


# Chi-square through the whole engine: the first two generated tokens of N seeded generations against the
# target's exact joint distribution. N = 4000 per case, 4 cases, α = 1e-4 / 4 (Bonferroni). The broken
# verifier must reach a p-value below α from BROKEN_SAMPLES generations (its p-value 2e-11 at 400, 1e-38 at
# 1000, 2e-185 at 4000: far from exact, fewer suffice, and the exact cases' N catches it all the more).
N_SAMPLES = 4000
BROKEN_SAMPLES = 1000
ALPHA = 1e-4 / 4


@torch.inference_mode()  # as tests/first_rounds.py: no value changes, each sample cheaper
def first_two_tokens_p_value(drafter_kind: str, sampling_kw: dict, samples: int = N_SAMPLES) -> float:
    target = TableLM(4, seed=21, sharpness=1.2)
    draft = noisy_copy(target, 22, 1.5)
    drafter = ModelDrafter(draft, SamplingParams(), 4) if drafter_kind == "model" else NGramDrafter(2, 1)
    counts = torch.zeros(4, 4, dtype=torch.float64)  # [first token, second token]
    for seed in range(samples):
        first, second = sampled_run(target, drafter, seed=seed, n=2, sampling_kw=sampling_kw)
        counts[first, second] += 1
    params = SamplingParams(**sampling_kw)
    expected = torch.zeros(4, 4, dtype=torch.float64)  # exact P(first, second) under the target alone
    p_first = probs_from_logits(target.table[4, 1].double(), params)  # context: "none", prompt token 1
    for a, b in itertools.product(range(4), repeat=2):
        expected[a, b] = p_first[a] * probs_from_logits(target.table[1, a].double(), params)[b]
    keep = expected.flatten() * samples >= 5  # cells too rare for the chi-square approximation are merged
    obs = torch.cat([counts.flatten()[keep], counts.flatten()[~keep].sum().view(1)])
    exp = torch.cat([expected.flatten()[keep], expected.flatten()[~keep].sum().view(1)]) * samples
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return scipy_stats.chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.mark.parametrize(
    "drafter_kind,sampling_kw",
    [("model", {}), ("ngram", {}), ("model", {"temperature": 0.8, "top_p": 0.9})],
    ids=["model", "ngram", "model-top-p"],
)
def test_engine_first_two_tokens_follow_the_target(drafter_kind, sampling_kw):
    assert first_two_tokens_p_value(drafter_kind, sampling_kw) > ALPHA


def test_engine_chi_square_catches_a_broken_verifier(monkeypatch):
    """The same check fails when the engine resamples rejected tokens from p instead of the residual."""

    def resample_from_p(draft_tokens, q, p, generator, eos_token_id=None):
        rule = rejection_rule(draft_tokens, q=q, p=p)
        return sample_verdict(
            dataclasses.replace(rule, fallback=p.clone()), draft_tokens, generator, eos_token_id
        )

    monkeypatch.setattr(rounds_module, "rejection_sample", resample_from_p)
    assert first_two_tokens_p_value("model", {}, BROKEN_SAMPLES) < ALPHA

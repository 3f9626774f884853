"""Exact enumeration: the speculative loop's output distribution equals the target's, to 1e-12.

For a (target, draft) pair of toy models, a verifier's rule and a draft length K, :func:`speculative_joint`
computes *analytically* the joint distribution of the first N tokens that the full speculative loop emits
from an empty prompt: draft K tokens autoregressively from q, verify, commit the emitted tokens, repeat until
N tokens or EOS. Every draft outcome and every accept/reject branch is enumerated; accept probabilities and
fallback distributions come from the REAL rule functions of :mod:`verispec.verify.chain` in float64, one call
per context with all V^K drafts batched. This is compared with the target's own ancestral joint distribution
(:func:`toy.target_joint`) in total variation.

The same machinery checks the tokens-per-round identity E[tokens] = 1 + Σ_i Π_{j≤i} α_j, and shows that
deliberately broken verifiers are caught (TV far above 1e-12, or the identity broken).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from torch import Tensor

from toy import (
    FAMILIES,
    SETTINGS,
    ToyLM,
    accepted_prefix_probs,
    bonus_from_last_position,
    make_pair,
    reachable_contexts,
    recovered_from_p,
    single_threaded,
    target_joint,
)
from verispec.options import SamplingParams
from verispec.verify.chain import Rule, greedy_rule, rejection_rule, single_guess_rule

EXACT_TV = 1e-12  # float64 round-off over a few thousand terms is far below this
BROKEN_TV = 1e-3  # every broken variant below is off by at least this much (most by > 1e-2)
KS = (1, 2, 3, 4)

#: (draft_tokens [R, K], q [R, K, V], p [R, K+1, V]) -> Rule, all float64
RuleFn = Callable[[Tensor, Tensor, Tensor], Rule]

RULES: dict[str, RuleFn] = {
    "rejection": lambda x, q, p: rejection_rule(x, q=q, p=p, dtype=torch.float64),
    # The guesses are drawn from q but verified as point masses, without q: still exact.
    "single_guess": lambda x, q, p: single_guess_rule(x, p=p, dtype=torch.float64),
    "greedy": lambda x, q, p: greedy_rule(x, p=p),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


# ---------------------------------------------------------------------------------------------- enumeration


@functools.cache
def tables(family: str, setting: str) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q): [V+1, V+1, V] float64 target and draft distributions of ``family`` under ``setting``."""
    pair = make_pair(family)
    params = SETTINGS[setting]
    return pair.target.probs(params).numpy(), pair.draft.probs(params).numpy()


@functools.cache
def reference(family: str, setting: str, n: int) -> np.ndarray:
    """The target's own joint distribution of its first n tokens under ``setting``: [V+1] * n."""
    return target_joint(tables(family, setting)[0], n, make_pair(family).eos_token_id)


@functools.cache
def _has_eos(vocab: int, length: int, eos: int) -> np.ndarray:
    """[V] * length bool: the stream of tokens contains EOS."""
    grid = np.indices((vocab,) * length)  # [length, V, ..., V]
    return (grid == eos).any(axis=0)


@functools.cache
def _truncation_map(vocab: int, m: int, eos: int) -> np.ndarray:
    """[(V+1)^m] int: flat index of each m-token sequence → flat index of the sequence cut after its first EOS
    and padded with END (= V)."""
    target = []
    for seq in itertools.product(range(vocab + 1), repeat=m):
        if eos in seq:
            i = seq.index(eos)
            seq = seq[: i + 1] + (vocab,) * (m - i - 1)
        target.append(np.ravel_multi_index(seq, (vocab + 1,) * m))
    return np.array(target, dtype=np.int64)


def truncate_after_eos(dist: np.ndarray, eos: int | None) -> np.ndarray:
    """dist: [V+1] * m over raw sequences. Returns the distribution of the sequences cut after EOS."""
    if eos is None or dist.ndim == 0:
        return dist
    vocab, m = dist.shape[0] - 1, dist.ndim
    flat = np.bincount(_truncation_map(vocab, m, eos), weights=dist.ravel(), minlength=dist.size)
    return flat.reshape(dist.shape)


#: the draft's q: a [V+1, V+1, V] table read along the draft (autoregressive: draft token i given the two
#: tokens before it), or a function (sequences [R, K+2], K) -> [R, K, V] (Medusa heads: the context alone)
DraftQ = np.ndarray | Callable[[np.ndarray, int], np.ndarray]


def draft_rows(q: DraftQ, seq: np.ndarray, k: int) -> np.ndarray:
    """The q of each draft position of ``seq`` [R, K+2] (the context, then K draft tokens): [R, K, V]."""
    return q(seq, k) if callable(q) else q[seq[:, :k], seq[:, 1 : k + 1]]


def round_streams(
    ctx: tuple[int, int],
    k: int,
    qdraw: DraftQ,
    qtold: DraftQ,
    ptab: np.ndarray,
    rule_fn: RuleFn,
    drop_bonus: bool = False,
) -> list[np.ndarray]:
    """The exact distribution of what one round from context ``ctx`` emits, before any EOS cut.

    qdraw: [V+1, V+1, V] the distributions the draft tokens are sampled from; qtold: the q given to the rule
    (equal to qdraw unless testing a bug); ptab: the p given to the rule.
    Returns, for s = 0..K accepted draft tokens, T_s of shape [V] * (s+1): T_s[x_1, .., x_s, y] is the
    probability that the draft starts with x_1..x_s, exactly s tokens are accepted and the recovered/bonus
    token is y. With ``drop_bonus`` (broken variant c), T_K has shape [V] * K: no token after a full accept.
    """
    vocab = ptab.shape[-1]
    drafts = np.array(list(itertools.product(range(vocab), repeat=k)), dtype=np.int64)  # [R, K], R = V^K
    rows = drafts.shape[0]
    seq = np.concatenate([np.tile(np.array(ctx), (rows, 1)), drafts], axis=1)  # [R, K+2]
    p = ptab[seq[:, : k + 1], seq[:, 1 : k + 2]]  # [R, K+1, V]: p_1..p_{K+1} given the draft
    q_draw = draft_rows(qdraw, seq, k)  # [R, K, V]
    q_told = draft_rows(qtold, seq, k)  # [R, K, V]
    draft_prob = np.take_along_axis(q_draw, drafts[..., None], axis=-1)[..., 0].prod(axis=1)  # [R]

    rule = rule_fn(torch.from_numpy(drafts), torch.from_numpy(q_told), torch.from_numpy(p))
    accept = rule.accept_prob.to(torch.float64).numpy()  # [R, K]
    fallback = rule.fallback.to(torch.float64).numpy()  # [R, K+1, V]
    assert accept.shape == (rows, k) and fallback.shape == (rows, k + 1, vocab)
    assert ((accept >= 0) & (accept <= 1)).all()
    ones = np.ones((rows, 1))
    reach = np.concatenate([ones, np.cumprod(accept, axis=1)], axis=1)  # [R, K+1]: first s all accepted
    stop = np.concatenate([1 - accept, ones], axis=1)  # [R, K+1]: ... and the round stops there

    streams = []
    for s in range(k + 1):
        weight = draft_prob * reach[:, s] * stop[:, s]  # [R]
        joint = (weight[:, None] * fallback[:, s]).reshape((vocab,) * (k + 1))  # [V]*K drafts, then [V] y
        t = joint.sum(axis=tuple(range(s, k)))  # [V] * (s+1): (x_1..x_s, y)
        if drop_bonus and s == k:
            t = t.sum(axis=-1)  # [V] * K: the accepted draft and nothing after it
        streams.append(t)
    return streams


def speculative_joint(
    qdraw: DraftQ,
    qtold: DraftQ,
    ptab: np.ndarray,
    k: int,
    n: int,
    rule_fn: RuleFn,
    eos: int | None = None,
    drop_bonus: bool = False,
) -> np.ndarray:
    """The exact joint distribution of the first n tokens of the speculative loop from an empty prompt.

    Returns [V+1] * n (END = V pads after EOS). Dynamic programming over (context, tokens still needed):
    dist[m][a, b] is the distribution of the next m output tokens from context (a, b); the loop is stateless
    between rounds and the toy models are order-2, so that is all a round's continuation depends on.
    """
    vocab = ptab.shape[-1]
    end = vocab
    contexts = reachable_contexts(vocab)
    streams = {c: round_streams(c, k, qdraw, qtold, ptab, rule_fn, drop_bonus) for c in contexts}
    dist = [np.ones((vocab + 1, vocab + 1))]  # dist[m]: [V+1, V+1] + [V+1] * m
    for m in range(1, n + 1):
        dm = np.zeros((vocab + 1, vocab + 1) + (vocab + 1,) * m)
        for c in contexts:
            out = np.zeros((vocab + 1,) * m)  # raw sequences, cut after EOS at the end
            for t in streams[c]:
                length = t.ndim
                if length >= m:  # the round alone fixes the next m tokens
                    out[(slice(0, vocab),) * m] += t.sum(axis=tuple(range(m, length)))
                    continue
                rest = m - length
                if eos is not None:  # a stream holding EOS ends the output
                    ends = _has_eos(vocab, length, eos)  # [V] * length
                    out[(slice(0, vocab),) * length + (end,) * rest] += np.where(ends, t, 0.0)
                    t = np.where(ends, 0.0, t)
                # next round from the context made of the stream's last two tokens
                nxt = dist[rest][c[1], :vocab] if length == 1 else dist[rest][:vocab, :vocab]
                out[(slice(0, vocab),) * length] += t.reshape(t.shape + (1,) * rest) * nxt
            dm[c] = truncate_after_eos(out, eos)
        dist.append(dm)
    return dist[n][vocab, vocab]


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


def loop_tv(family: str, setting: str, verifier: str, k: int) -> float:
    """TV between the enumerated speculative loop and the target (temperature 0 for the greedy verifier)."""
    pair = make_pair(family)
    ptab, qtab = tables(family, setting)
    spec = speculative_joint(qtab, qtab, ptab, k, pair.num_tokens, RULES[verifier], pair.eos_token_id)
    assert abs(spec.sum() - 1) < 1e-12
    ref_setting = "greedy" if verifier == "greedy" else setting
    return total_variation(spec, reference(family, ref_setting, pair.num_tokens))


# ---------------------------------------------------------------------------------------------- exactness


def test_reference_is_a_distribution_and_uses_the_context():
    """Sanity of the reference itself: it sums to 1, and it is not a product of equal marginals (the toy
    models are context dependent, so an emitted token landing in the wrong context would be noticed)."""
    for family in FAMILIES:
        pair = make_pair(family)
        ref = reference(family, "t1", 2)
        assert abs(ref.sum() - 1) < 1e-12
        first, second = ref.sum(axis=1), ref.sum(axis=0)
        assert np.abs(ref - np.outer(first, second)).sum() > 1e-2, family
        assert pair.num_tokens >= 3


@pytest.mark.parametrize("k", KS, ids=lambda k: f"K{k}")
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("verifier", list(RULES))
@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_loop_is_exact(family: str, verifier: str, setting: str, k: int):
    """For every pair family, verifier, sampling setting and K, the first N tokens of the speculative loop are
    distributed exactly as the target's (for the greedy verifier: as the target's greedy decoding):
    TV ≤ 1e-12. N = 5 for V = 3, 4 for V = 4 (so that every position of K = 4 matters), 3 for V = 6."""
    tv = loop_tv(family, setting, verifier, k)
    assert tv <= EXACT_TV, f"TV {tv:.3e}"


def test_enumeration_sees_every_position():
    """The enumeration is not blind beyond the first round: in the p = q family every draft is accepted, so
    with K = 4 and N = 5 the fifth token is a bonus token; a bonus drawn from the wrong position is caught."""
    ptab, qtab = tables("equal", "t1")
    rule = lambda x, q, p: bonus_from_last_position(RULES["rejection"](x, q, p), p)  # noqa: E731
    spec = speculative_joint(qtab, qtab, ptab, 4, 5, rule)
    assert total_variation(spec, reference("equal", "t1", 5)) > BROKEN_TV


# ---------------------------------------------------------------------------------------------- Medusa heads

MEDUSA_HEADS = 3


@functools.cache
def medusa_heads(family: str, setting: str) -> np.ndarray:
    """[H, V+1, V+1, V] float64: the distributions of H toy Medusa heads under ``setting``; head i guesses
    the token i positions after the context from the context alone (the family's draft logits, perturbed
    more for later heads; a draft's forbidden tokens stay forbidden)."""
    logits = make_pair(family).draft.logits
    rng = np.random.default_rng(21)
    heads = [logits + rng.normal(0.0, 0.6 * i, size=logits.shape) for i in range(MEDUSA_HEADS)]
    return np.stack([ToyLM(h).probs(SETTINGS[setting]).numpy() for h in heads])


def heads_on_context(heads: np.ndarray) -> Callable[[np.ndarray, int], np.ndarray]:
    """A Medusa draft: draft token i from head i on the round's context alone (the first two columns)."""
    return lambda seq, k: np.stack([heads[i][seq[:, 0], seq[:, 1]] for i in range(k)], axis=1)


def heads_along_draft(heads: np.ndarray) -> Callable[[np.ndarray, int], np.ndarray]:
    """Broken: head i's q as if it had read the draft tokens before token i (not what drew them)."""
    return lambda seq, k: np.stack([heads[i][seq[:, i], seq[:, i + 1]] for i in range(k)], axis=1)


@pytest.mark.parametrize("k", (1, 2, 3), ids=lambda k: f"K{k}")
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("verifier", list(RULES))
@pytest.mark.parametrize("family", FAMILIES)
def test_medusa_heads_are_exact(family: str, verifier: str, setting: str, k: int):
    """A Medusa-kind draft — token i sampled from head i's q given the round's context only, independent of
    the draft tokens before it — verified with those very q rows: the loop is exact (TV ≤ 1e-12). The
    verifier only needs q_i to be the distribution token i was drawn from given everything before it; the
    heads being sampled independently, that conditional distribution is q_i itself."""
    pair = make_pair(family)
    ptab, _ = tables(family, setting)
    heads = heads_on_context(medusa_heads(family, setting))
    spec = speculative_joint(heads, heads, ptab, k, pair.num_tokens, RULES[verifier], pair.eos_token_id)
    reference_setting = "greedy" if verifier == "greedy" else setting
    tv = total_variation(spec, reference(family, reference_setting, pair.num_tokens))
    assert tv <= EXACT_TV, f"TV {tv:.3e}"


@pytest.mark.parametrize("k", (2, 3), ids=lambda k: f"K{k}")
def test_medusa_q_told_along_the_draft_is_caught(k: int):
    """Reporting head i's q as if it had read the draft tokens before it (what an autoregressive draft
    would report) breaks exactness: the q given to the verifier must be the one the token came from."""
    heads = medusa_heads("generic", "t1")
    ptab, _ = tables("generic", "t1")
    spec = speculative_joint(
        heads_on_context(heads), heads_along_draft(heads), ptab, k, 4, RULES["rejection"]
    )
    assert total_variation(spec, reference("generic", "t1", 4)) > BROKEN_TV


# ---------------------------------------------------------------------------------------------- lookahead


def lookahead_draft(ptab: np.ndarray, heads: np.ndarray, along: bool = False) -> Callable:
    """A lookahead-kind draft (PaSS): draft token 1 from the target's own p on the round's context, token
    i + 1 from lookahead i on the context alone. ``along`` (broken): lookahead i's q as if it had read the
    draft tokens before it."""

    def rows(seq: np.ndarray, k: int) -> np.ndarray:
        first = ptab[seq[:, 0], seq[:, 1]]  # [R, V]
        later = [
            heads[i][seq[:, i + 1], seq[:, i + 2]] if along else heads[i][seq[:, 0], seq[:, 1]]
            for i in range(k - 1)
        ]
        return np.stack([first, *later], axis=1)  # [R, K, V]

    return rows


@pytest.mark.parametrize("k", (1, 2, 3), ids=lambda k: f"K{k}")
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("verifier", list(RULES))
@pytest.mark.parametrize("family", FAMILIES)
def test_lookahead_drafts_are_exact(family: str, verifier: str, setting: str, k: int):
    """A lookahead-kind draft — token 1 sampled from the target's own p, token i + 1 from lookahead i's q on
    the context alone — verified with those very rows: exact (TV ≤ 1e-12)."""
    pair = make_pair(family)
    ptab, _ = tables(family, setting)
    draft = lookahead_draft(ptab, medusa_heads(family, setting))
    spec = speculative_joint(draft, draft, ptab, k, pair.num_tokens, RULES[verifier], pair.eos_token_id)
    reference_setting = "greedy" if verifier == "greedy" else setting
    tv = total_variation(spec, reference(family, reference_setting, pair.num_tokens))
    assert tv <= EXACT_TV, f"TV {tv:.3e}"


@pytest.mark.parametrize("k", (2, 3), ids=lambda k: f"K{k}")
def test_lookahead_q_told_along_the_draft_is_caught(k: int):
    """Reporting a lookahead's q as if it had read the draft tokens before it breaks exactness, as does
    reporting the draft's own q for token 1 when it was drawn from the target's p."""
    heads = medusa_heads("generic", "t1")
    ptab, qtab = tables("generic", "t1")
    drawn = lookahead_draft(ptab, heads)
    for told in (
        lookahead_draft(ptab, heads, along=True),
        lambda seq, k: np.concatenate([qtab[seq[:, :1], seq[:, 1:2]], drawn(seq, k)[:, 1:]], axis=1),
    ):
        spec = speculative_joint(drawn, told, ptab, k, 4, RULES["rejection"])
        assert total_variation(spec, reference("generic", "t1", 4)) > BROKEN_TV


# ---------------------------------------------------------------------------------------------- tokens/round


def expected_tokens(alphas: Sequence[float]) -> float:
    """Expected tokens emitted per verifier call: 1 + Σ_{i=1..K} Π_{j≤i} α_j, where α_j is the probability of
    accepting the j-th draft token given that the j − 1 before it were accepted."""
    total, prod = 1.0, 1.0
    for alpha in alphas:
        prod *= alpha
        total += prod
    return total


def conditional_acceptance(
    ctx: tuple[int, int], k: int, qtab: np.ndarray, ptab: np.ndarray, verifier: str
) -> list[float]:
    """α_1..α_K of a round from ``ctx``: α_j = A_j / A_{j−1} with A_j = P(first j accepted) from the closed
    forms (:func:`toy.accepted_prefix_probs`, which does not use the rule functions)."""
    alphas, before = [], 1.0
    for after in accepted_prefix_probs(ctx, k, qtab, ptab, verifier):
        alphas.append(after / before if before > 0 else 0.0)
        before = after
    return alphas


def enumerated_tokens_per_round(streams: list[np.ndarray]) -> float:
    """E[tokens emitted by one round] from the enumerated round (families without EOS): a stream of s + 1
    tokens is emitted with probability T_s.sum()."""
    assert abs(sum(t.sum() for t in streams) - 1) < 1e-12
    return float(sum(t.sum() * t.ndim for t in streams))


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("verifier", list(RULES))
@pytest.mark.parametrize("family", [f for f in FAMILIES if make_pair(f).eos_token_id is None])
def test_tokens_per_round_identity(family: str, verifier: str, setting: str):
    """The exact expected number of tokens per verifier call, from the enumeration of one round through the
    real rule, equals 1 + Σ_i Π_{j≤i} α_j with α_j from the closed-form acceptance probabilities (1e-12)."""
    ptab, qtab = tables(family, setting)
    bos = ptab.shape[-1]
    for k, ctx in itertools.product(KS, [(bos, bos), (bos, 0), (1, 2)]):
        streams = round_streams(ctx, k, qtab, qtab, ptab, RULES[verifier])
        got = enumerated_tokens_per_round(streams)
        want = expected_tokens(conditional_acceptance(ctx, k, qtab, ptab, verifier))
        assert abs(got - want) <= 1e-12, f"K={k} ctx={ctx}: {got} vs {want}"


# ---------------------------------------------------------------------------------------------- broken


def broken_rule(breakage: Callable[[Rule, Tensor], Rule]) -> RuleFn:
    return lambda x, q, p: breakage(RULES["rejection"](x, q, p), p)


@pytest.mark.parametrize(
    ("family", "k"), [("onehot", 1), ("onehot", 3), ("generic", 2)], ids=lambda v: str(v)
)
def test_broken_recovered_from_p_is_caught(family: str, k: int):
    """(a) Resampling a rejected token from p instead of the residual max(p − q, 0) over-weights the rejected
    token: far from exact."""
    pair = make_pair(family)
    ptab, qtab = tables(family, "t1")
    spec = speculative_joint(qtab, qtab, ptab, k, pair.num_tokens, broken_rule(recovered_from_p))
    assert total_variation(spec, reference(family, "t1", pair.num_tokens)) > BROKEN_TV


@pytest.mark.parametrize(("family", "k"), [("equal", 1), ("equal", 3), ("generic", 1)], ids=lambda v: str(v))
def test_broken_bonus_distribution_is_caught(family: str, k: int):
    """(b) Drawing the bonus token from p_K instead of p_{K+1} puts it in the wrong context: far from
    exact."""
    pair = make_pair(family)
    ptab, qtab = tables(family, "t1")
    spec = speculative_joint(qtab, qtab, ptab, k, pair.num_tokens, broken_rule(bonus_from_last_position))
    assert total_variation(spec, reference(family, "t1", pair.num_tokens)) > BROKEN_TV


@pytest.mark.parametrize(("family", "k"), [("equal", 2), ("generic", 1), ("tiny", 3)], ids=lambda v: str(v))
def test_dropped_bonus_is_exact_but_breaks_tokens_per_round(family: str, k: int):
    """(c) Dropping the bonus token leaves the output distribution EXACT: the loop is stateless, so the next
    round drafts from the same context and emits the next token from p_{K+1} anyway (as a draft token accepted
    by rejection sampling, or as a recovered/bonus token), which is what the bonus would have been. Only
    speed is lost, so the output distribution cannot catch it; the tokens-per-round identity does (short by
    P(all K accepted))."""
    pair = make_pair(family)
    ptab, qtab = tables(family, "t1")
    spec = speculative_joint(qtab, qtab, ptab, k, pair.num_tokens, RULES["rejection"], drop_bonus=True)
    assert total_variation(spec, reference(family, "t1", pair.num_tokens)) <= EXACT_TV

    ctx = (pair.vocab, pair.vocab)
    streams = round_streams(ctx, k, qtab, qtab, ptab, RULES["rejection"], drop_bonus=True)
    got = enumerated_tokens_per_round(streams)
    want = expected_tokens(conditional_acceptance(ctx, k, qtab, ptab, "rejection"))
    assert want - got > BROKEN_TV


def _topp_tables(family: str) -> dict[str, np.ndarray]:
    """Raw (temperature 1) and top-p target/draft tables for the transform-mismatch variants."""
    pair = make_pair(family)
    raw, topp = SamplingParams(), SamplingParams(top_p=0.8)
    return {
        "p_raw": pair.target.probs(raw).numpy(),
        "q_raw": pair.draft.probs(raw).numpy(),
        "p_topp": pair.target.probs(topp).numpy(),
        "q_topp": pair.draft.probs(topp).numpy(),
    }


TOPP_FAMILY = "generic"


@pytest.mark.parametrize("k", (1, 3), ids=lambda k: f"K{k}")
@pytest.mark.parametrize(
    ("draw", "told"),
    [("q_topp", "q_raw"), ("q_raw", "q_topp")],
    ids=["drawn-topp-told-raw", "drawn-raw-told-topp"],
)
def test_broken_transform_mismatch_is_caught(draw: str, told: str, k: int):
    """(d) The draft samples from one transform of q but the verifier is told another: the acceptance ratio
    p/q uses the wrong q, and the output is far from the top-p target."""
    t = _topp_tables(TOPP_FAMILY)
    n = make_pair(TOPP_FAMILY).num_tokens
    spec = speculative_joint(t[draw], t[told], t["p_topp"], k, n, RULES["rejection"])
    assert total_variation(spec, target_joint(t["p_topp"], n)) > BROKEN_TV


@pytest.mark.parametrize("k", (1, 3), ids=lambda k: f"K{k}")
def test_topp_on_draft_only_is_caught(k: int):
    """(e) Top-p applied to the draft but not to the target: the loop samples the untransformed target, which
    is far from the top-p target the user asked for."""
    t = _topp_tables(TOPP_FAMILY)
    n = make_pair(TOPP_FAMILY).num_tokens
    spec = speculative_joint(t["q_topp"], t["q_topp"], t["p_raw"], k, n, RULES["rejection"])
    assert total_variation(spec, target_joint(t["p_topp"], n)) > BROKEN_TV
    assert total_variation(spec, target_joint(t["p_raw"], n)) <= EXACT_TV  # it is exact for the raw target


@pytest.mark.parametrize("k", KS, ids=lambda k: f"K{k}")
def test_topp_on_target_only_is_exact(k: int):
    """(f) Top-p applied to the target but not to the draft is still exact for the top-p target: rejection
    sampling is exact for ANY q it is told truthfully (tokens outside the target's top-p set have p = 0, so
    they are always rejected, and the residual puts the mass back where p has it)."""
    t = _topp_tables(TOPP_FAMILY)
    n = make_pair(TOPP_FAMILY).num_tokens
    spec = speculative_joint(t["q_raw"], t["q_raw"], t["p_topp"], k, n, RULES["rejection"])
    assert total_variation(spec, target_joint(t["p_topp"], n)) <= EXACT_TV


def test_greedy_reference_is_deterministic():
    """The greedy verifier's reference is a single sequence (the greedy rows above check token identity)."""
    for family in FAMILIES:
        ref = reference(family, "greedy", make_pair(family).num_tokens)
        assert ref.max() == 1.0

"""Unit tests for :mod:`verispec.verify.chain`.

What is checked here: the closed-form values of each rule on hand-computed examples and against a plain-Python
reference, the edge cases named in the module's docstrings, input validation, vocabulary padding, end of
sequence, ragged rows, greedy verification, dtype and determinism, and the invariants every verdict must hold
(hypothesis). Distribution-level exactness is proved elsewhere (test_enumeration.py, test_chisquare.py).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from verispec.verify.chain import (
    Rule,
    Verdict,
    greedy_rule,
    greedy_targets,
    greedy_verify,
    greedy_verify_targets,
    rejection_rule,
    rejection_sample,
    sample_verdict,
    single_guess_rule,
    single_guess_sample,
)

F64 = torch.float64
NAN = float("nan")


# ---------------------------------------------------------------------------------------------- helpers


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def t64(values) -> Tensor:
    return torch.tensor(values, dtype=F64)


def ids(values) -> Tensor:
    return torch.tensor(values, dtype=torch.long)


def onehot(index, vocab: int) -> Tensor:
    """[B, P] ids -> [B, P, vocab] float64 point masses."""
    return torch.nn.functional.one_hot(ids(index), vocab).to(F64)


def random_probs(g: torch.Generator, shape: tuple[int, ...], zero_frac: float = 0.0, dtype=F64) -> Tensor:
    """Random distributions [..., V]; about ``zero_frac`` of the entries are exactly 0 (never a whole row)."""
    w = torch.rand(shape, generator=g, dtype=F64)
    if zero_frac > 0:
        drop = torch.rand(shape, generator=g, dtype=F64) < zero_frac  # [..., V]
        keep = torch.randint(shape[-1], shape[:-1], generator=g)  # [...]
        drop.scatter_(-1, keep.unsqueeze(-1), False)
        w = w.masked_fill(drop, 0.0)
    return (w / w.sum(-1, keepdim=True)).to(dtype)


def draft_from(q: Tensor, g: torch.Generator) -> Tensor:
    """Sample draft tokens [B, K] from q [B, K, V]."""
    b, k, v = q.shape
    if k == 0:
        return torch.zeros(b, 0, dtype=torch.long)
    return torch.multinomial(q.reshape(b * k, v).double(), 1, generator=g).view(b, k)


def reference_rejection(draft: Tensor, q: Tensor, p: Tensor, lengths: list[int]) -> tuple[Tensor, Tensor]:
    """Plain-Python closed form of rejection sampling: accept_prob [B, K], fallback at used positions
    [B, K+1, V] (zero rows at unused positions), with both vocabularies padded to max(Vp, Vq)."""
    b, k = draft.shape
    vp, vq = p.shape[-1], q.shape[-1]
    v = max(vp, vq)
    acc = torch.zeros(b, k, dtype=F64)
    fb = torch.zeros(b, k + 1, v, dtype=F64)
    for r in range(b):
        for t in range(lengths[r] + 1):
            pt = [float(p[r, t, i]) if i < vp else 0.0 for i in range(v)]
            qt = [float(q[r, t, i]) if t < lengths[r] and i < vq else 0.0 for i in range(v)]
            if t < lengths[r]:
                x = int(draft[r, t])
                if qt[x] == 0:  # ratio +inf when p > 0, and 0/0 rejects
                    acc[r, t] = 1.0 if pt[x] > 0 else 0.0
                else:
                    acc[r, t] = min(1.0, pt[x] / qt[x])
            res = [max(a - c, 0.0) for a, c in zip(pt, qt, strict=True)]
            mass = sum(res)
            fb[r, t] = t64([x / mass for x in res] if mass > 0 else pt)
    return acc, fb


def check_verdict(v: Verdict, draft: Tensor, lengths: list[int], vocab: int, eos: set[int] | None = None):
    """Assert the invariants every verdict holds (see the Verdict docstring)."""
    b, k = draft.shape
    assert v.tokens.shape == (b, k + 1) and v.tokens.dtype == torch.int64
    for name in ("num_accepted", "num_tokens", "num_drafted"):
        assert getattr(v, name).shape == (b,) and getattr(v, name).dtype == torch.int64
    assert v.num_drafted.tolist() == lengths
    for r in range(b):
        n, a, m = lengths[r], int(v.num_accepted[r]), int(v.num_tokens[r])
        row = v.tokens[r].tolist()
        assert 0 <= a <= n
        assert row[:a] == draft[r, :a].tolist()  # the accepted prefix is the draft's
        assert all(t == -1 for t in row[m:])  # padding after the emitted tokens
        assert all(0 <= t < vocab for t in row[:m])  # emitted tokens are target tokens
        assert v.row(r) == row[:m]
        eos_at = [i for i, t in enumerate(row[:a]) if eos and t in eos]
        if eos_at:  # an accepted EOS is the last emitted token; nothing follows it
            assert eos_at == [a - 1] and m == a
            assert not bool(v.bonus[r])
        else:
            assert m == a + 1 and 1 <= m <= n + 1
            assert bool(v.bonus[r]) == (a == n)
            assert bool(v.recovered[r]) == (a < n)


def check_rule(rule: Rule, lengths: list[int], vp: int) -> None:
    """Assert the invariants of a rule: probabilities in [0, 1], 0 after the draft, fallback distributions."""
    b, k = rule.accept_prob.shape
    assert rule.fallback.shape[:2] == (b, k + 1)
    assert rule.num_drafted.tolist() == lengths
    assert ((rule.accept_prob >= 0) & (rule.accept_prob <= 1)).all()
    for r in range(b):
        assert (rule.accept_prob[r, lengths[r] :] == 0).all()
        used = rule.fallback[r, : lengths[r] + 1]  # [n+1, V]
        assert (used >= 0).all()
        torch.testing.assert_close(
            used.sum(-1).double(), torch.ones(lengths[r] + 1, dtype=F64), atol=1e-5, rtol=0
        )
        assert (used[:, vp:] == 0).all()  # never a token the target does not have


# ---------------------------------------------------------------------------------------------- closed form


def test_rejection_rule_closed_form_hand_example():
    """accept = min(1, p/q), fallback = normalize(max(p - q, 0)), bonus = p_{K+1}, on hand-computed values."""
    draft = ids([[0, 0]])  # [1, 2]
    q = t64([[[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]])  # [1, 2, 3]
    p = t64([[[0.25, 0.5, 0.25], [0.6, 0.2, 0.2], [0.1, 0.7, 0.2]]])  # [1, 3, 3]
    rule = rejection_rule(draft, q=q, p=p, dtype=F64)
    torch.testing.assert_close(rule.accept_prob, t64([[0.5, 1.0]]))  # 0.25/0.5, min(1, 0.6/0.2)
    torch.testing.assert_close(rule.fallback[0, 0], t64([0.0, 1.0, 0.0]))  # residual [0, .25, 0]
    torch.testing.assert_close(rule.fallback[0, 1], t64([1.0, 0.0, 0.0]))  # residual [.4, 0, 0]
    torch.testing.assert_close(rule.fallback[0, 2], p[0, 2])  # bonus
    assert rule.num_drafted.tolist() == [2]


def test_rejection_rule_residual_normalizes_several_entries():
    """The residual keeps the relative sizes of the positive parts of p - q."""
    p = t64([[[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3]]])  # [1, 2, 3]
    q = t64([[[0.2, 0.2, 0.6]]])  # [1, 1, 3]
    rule = rejection_rule(ids([[2]]), q=q, p=p, dtype=F64)
    torch.testing.assert_close(rule.accept_prob, t64([[0.2 / 0.6]]))
    torch.testing.assert_close(rule.fallback[0, 0], t64([0.75, 0.25, 0.0]))  # [.3, .1, 0] / .4


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    b=st.integers(1, 4),
    k=st.integers(0, 4),
    vp=st.integers(1, 6),
    dv=st.integers(-2, 2),
    zero_frac=st.sampled_from([0.0, 0.3, 0.7]),
)
def test_rejection_rule_matches_plain_python_reference(seed, b, k, vp, dv, zero_frac):
    """On random inputs (sparse ones too, so that q(x) = 0 and p(x) = 0 occur), the rule equals a
    plain-Python evaluation of the closed form, including vocabulary padding and ragged rows."""
    g = gen(seed)
    vq = max(1, vp + dv)
    q = random_probs(g, (b, k, vq), zero_frac)
    p = random_probs(g, (b, k + 1, vp), zero_frac)
    draft = torch.randint(vq, (b, k), generator=g)  # any draft id the draft has, also ones with q = 0
    lengths = torch.randint(k + 1, (b,), generator=g)
    rule = rejection_rule(draft, q=q, p=p, draft_lengths=lengths, dtype=F64)
    acc, fb = reference_rejection(draft, q, p, lengths.tolist())
    torch.testing.assert_close(rule.accept_prob, acc)
    for r in range(b):
        n = int(lengths[r])
        torch.testing.assert_close(rule.fallback[r, : n + 1], fb[r, : n + 1])
    check_rule(rule, lengths.tolist(), vp)


def test_single_guess_rule_hand_example():
    """single guess: accept x with probability p(x); on rejection sample p without x, renormalized."""
    p = t64([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])  # [1, 2, 3]
    rule = single_guess_rule(ids([[1]]), p=p, dtype=F64)
    torch.testing.assert_close(rule.accept_prob, t64([[0.3]]))
    torch.testing.assert_close(rule.fallback[0, 0], t64([5 / 7, 0.0, 2 / 7]))
    torch.testing.assert_close(rule.fallback[0, 1], p[0, 1])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), b=st.integers(1, 3), k=st.integers(0, 4), v=st.integers(1, 6))
def test_single_guess_rule_is_rejection_with_one_hot_q(seed, b, k, v):
    """single_guess_rule(x, p) == rejection_rule(x, onehot(x), p) for random guesses and ragged rows."""
    g = gen(seed)
    p = random_probs(g, (b, k + 1, v), zero_frac=0.4)
    draft = torch.randint(v, (b, k), generator=g)
    lengths = torch.randint(k + 1, (b,), generator=g)
    got = single_guess_rule(draft, p=p, draft_lengths=lengths, dtype=F64)
    onehot = torch.nn.functional.one_hot(draft, v).to(F64)
    want = rejection_rule(draft, q=onehot, p=p, draft_lengths=lengths, dtype=F64)
    torch.testing.assert_close(got.accept_prob, want.accept_prob)
    torch.testing.assert_close(got.fallback, want.fallback)
    p_x = p[:, :k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, K]
    drafted = torch.arange(k) < lengths.unsqueeze(1)  # [B, K]
    torch.testing.assert_close(got.accept_prob, torch.where(drafted, p_x, 0.0))


# ---------------------------------------------------------------------------------------------- edge cases


def test_q_zero_at_draft_token():
    """q(x) = 0: accepted with probability 1 when p(x) > 0 (ratio +inf), 0 when p(x) = 0 too."""
    draft = ids([[0], [0]])  # [2, 1]
    q = t64([[[0.0, 1.0]], [[0.0, 1.0]]])  # [2, 1, 2]
    p = t64([[[0.5, 0.5], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]]])  # [2, 2, 2]
    assert rejection_rule(draft, q=q, p=p).accept_prob.tolist() == [[1.0], [0.0]]


def test_p_zero_at_draft_token_always_rejected():
    """p(x) = 0: accept probability 0, and no sample ever accepts it."""
    b = 200
    draft = torch.zeros(b, 1, dtype=torch.long)  # [200, 1]
    q = t64([[[0.9, 0.1]]]).expand(b, 1, 2)  # [200, 1, 2]
    p = t64([[[0.0, 1.0], [0.5, 0.5]]]).expand(b, 2, 2)  # [200, 2, 2]
    assert (rejection_rule(draft, q=q, p=p).accept_prob == 0).all()
    v = rejection_sample(draft, q=q, p=p, generator=gen(1))
    assert (v.num_accepted == 0).all() and (v.tokens[:, 0] == 1).all() and v.recovered.all()


def test_p_equal_q_zero_residual_falls_back_to_p_and_never_rejects():
    """p = q: the residual has mass 0, the fallback is p, and every draft token is accepted."""
    b, k = 100, 3
    g = gen(2)
    q = random_probs(g, (b, k, 5), dtype=torch.float32)  # [100, 3, 5]
    p = torch.cat([q, random_probs(g, (b, 1, 5), dtype=torch.float32)], dim=1)  # [100, 4, 5]
    draft = draft_from(q, g)
    rule = rejection_rule(draft, q=q, p=p)
    assert (rule.accept_prob == 1).all()
    torch.testing.assert_close(rule.fallback, p)
    v = sample_verdict(rule, draft, gen(3))
    assert (v.num_accepted == k).all() and v.bonus.all()


def test_zero_residual_where_p_at_most_q_after_rounding():
    """p ≤ q everywhere at a position (rounding can make p slightly below q): the fallback is p itself."""
    p = torch.tensor([[[0.5, 0.5 - 1e-7], [0.5, 0.5]]])  # [1, 2, 2], sums 1 within tolerance
    q = torch.tensor([[[0.5, 0.5]]])  # [1, 1, 2]
    rule = rejection_rule(ids([[0]]), q=q, p=p)
    torch.testing.assert_close(rule.fallback[0, 0], p[0, 0])


@pytest.mark.parametrize("kind", ["rejection", "single_guess", "greedy"])
def test_k_zero_is_plain_decoding(kind):
    """K = 0: no draft; one token from p_1 (here a point mass on 2), num_accepted 0, flagged as bonus."""
    b, v = 3, 4
    draft = torch.zeros(b, 0, dtype=torch.long)  # [3, 0]
    p = onehot([[2]] * b, v)  # [3, 1, 4]
    if kind == "rejection":
        rule = rejection_rule(draft, q=torch.zeros(b, 0, v, dtype=F64), p=p, dtype=F64)
        verdict = rejection_sample(draft, q=torch.zeros(b, 0, v), p=p.float(), generator=gen())
    elif kind == "single_guess":
        rule = single_guess_rule(draft, p=p, dtype=F64)
        verdict = single_guess_sample(draft, p=p.float(), generator=gen())
    else:
        rule = greedy_rule(draft, p=p)
        verdict = greedy_verify(draft, p=p)
    assert rule.accept_prob.shape == (b, 0)
    torch.testing.assert_close(rule.fallback, p)
    assert verdict.tokens.tolist() == [[2]] * b
    assert verdict.num_accepted.tolist() == [0] * b and verdict.num_tokens.tolist() == [1] * b
    assert verdict.bonus.all() and not verdict.recovered.any()


def test_k_zero_samples_from_p():
    """K = 0 with a spread-out p: emitted tokens lie in p's support, and several different ones occur."""
    b = 300
    p = t64([[[0.5, 0.0, 0.25, 0.25]]]).expand(b, 1, 4)  # [300, 1, 4]
    v = rejection_sample(torch.zeros(b, 0, dtype=torch.long), q=torch.zeros(b, 0, 4), p=p, generator=gen(4))
    assert set(v.tokens[:, 0].tolist()) == {0, 2, 3}


def test_empty_batch():
    """B = 0 gives empty verdicts of the right shapes."""
    draft = torch.zeros(0, 2, dtype=torch.long)  # [0, 2]
    v = rejection_sample(draft, q=torch.zeros(0, 2, 3), p=torch.zeros(0, 3, 3), generator=gen())
    assert v.tokens.shape == (0, 3) and v.num_tokens.shape == (0,)
    assert greedy_verify(draft, p=torch.zeros(0, 3, 3)).tokens.shape == (0, 3)


# ---------------------------------------------------------------------------------------------- validation


def _valid(b: int = 2, k: int = 3, v: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    g = gen(5)
    q = random_probs(g, (b, k, v), dtype=torch.float32)  # [B, K, V]
    p = random_probs(g, (b, k + 1, v), dtype=torch.float32)  # [B, K+1, V]
    return draft_from(q, g), q, p


@pytest.mark.parametrize(
    "which, value, message",
    [
        ("p", NAN, "p has NaN or Inf at row 1, position 2"),
        ("p", float("inf"), "p has NaN or Inf at row 1, position 2"),
        ("q", NAN, "q has NaN or Inf at row 1, position 2"),
        ("q", float("-inf"), "q has NaN or Inf at row 1, position 2"),
        ("p", -0.25, "p has a negative probability at row 1, position 2"),
        ("q", -0.25, "q has a negative probability at row 1, position 2"),
    ],
)
def test_bad_values_name_row_and_position(which, value, message):
    """NaN, ±Inf and negative entries raise ValueError naming the tensor, the row and the position."""
    draft, q, p = _valid()
    bad = q if which == "q" else p
    bad[1, 2, 1] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        rejection_rule(draft, q=q, p=p)
    if which == "p":
        with pytest.raises(ValueError, match=re.escape(message)):
            single_guess_rule(draft, p=p)


@pytest.mark.parametrize("which", ["p", "q"])
def test_rows_not_summing_to_one(which):
    """A row whose sum is off by more than the tolerance raises, naming the row and the position."""
    draft, q, p = _valid()
    bad = q if which == "q" else p
    bad[0, 1] *= 1.01
    with pytest.raises(ValueError, match=re.escape(f"{which} does not sum to 1 at row 0, position 1")):
        rejection_rule(draft, q=q, p=p)


def test_float32_rounding_within_tolerance_is_accepted():
    """float32 rounding (a sum off by 1e-5) is not an error."""
    draft, q, p = _valid()
    p[0, 0] *= 1 + 1e-5
    q[1, 2] *= 1 - 1e-5
    rejection_rule(draft, q=q, p=p)


def test_greedy_nan_names_row_and_position():
    """Greedy verification rejects NaN in the scores it uses, naming the row and position."""
    draft, _, p = _valid()
    p[1, 3, 0] = NAN
    with pytest.raises(ValueError, match=re.escape("p has NaN at row 1, position 3")):
        greedy_verify(draft, p=p)
    with pytest.raises(ValueError, match=re.escape("p has NaN at row 1, position 3")):
        greedy_rule(draft, p=p)


def test_greedy_accepts_infinite_logits():
    """Logits may hold -inf (masked tokens); only NaN is an error for greedy verification."""
    draft = ids([[1]])  # [1, 1]
    p = torch.tensor([[[float("-inf"), 0.0, -1.0], [0.0, float("-inf"), 2.0]]])  # [1, 2, 3]
    assert greedy_verify(draft, p=p).row(0) == [1, 2]


_B, _K, _V = 2, 3, 4


@pytest.mark.parametrize(
    "draft, q, p, lengths",
    [
        pytest.param(torch.zeros(_B, _K), None, None, None, id="float-draft"),
        pytest.param(torch.zeros(_B * _K, dtype=torch.long), None, None, None, id="1d-draft"),
        pytest.param(torch.full((_B, _K), -1), None, None, None, id="negative-draft-id"),
        pytest.param(torch.full((_B, _K), _V), None, None, None, id="draft-id-beyond-q"),
        pytest.param(None, torch.full((_B, _K + 1, _V), 1 / _V), None, None, id="q-too-many-positions"),
        pytest.param(None, torch.full((_B + 1, _K, _V), 1 / _V), None, None, id="q-wrong-batch"),
        pytest.param(None, torch.full((_B, _K * _V), 1 / _V), None, None, id="q-2d"),
        pytest.param(None, torch.zeros(_B, _K, 0), None, None, id="q-empty-vocab"),
        pytest.param(None, torch.ones(_B, _K, 1, dtype=torch.long), None, None, id="q-integer"),
        pytest.param(None, None, torch.full((_B, _K, _V), 1 / _V), None, id="p-too-few-positions"),
        pytest.param(None, None, torch.full((_B, _K + 1), 1.0), None, id="p-2d"),
        pytest.param(None, None, torch.zeros(_B, _K + 1, 0), None, id="p-empty-vocab"),
        pytest.param(None, None, None, torch.tensor([1, 2, 3]), id="lengths-wrong-shape"),
        pytest.param(None, None, None, torch.tensor([1.0, 2.0]), id="lengths-float"),
        pytest.param(None, None, None, torch.tensor([1, _K + 1]), id="lengths-above-k"),
        pytest.param(None, None, None, torch.tensor([-1, 2]), id="lengths-negative"),
    ],
)
def test_invalid_inputs_raise_value_error(draft, q, p, lengths):
    """Wrong dtypes, shapes, draft ids and draft lengths raise ValueError from rejection_rule."""
    d0, q0, p0 = _valid(_B, _K, _V)
    draft = d0 if draft is None else draft
    with pytest.raises(ValueError):
        rejection_rule(draft, q=q0 if q is None else q, p=p0 if p is None else p, draft_lengths=lengths)


@pytest.mark.parametrize(
    "draft, p, lengths",
    [
        pytest.param(torch.zeros(_B, _K), None, None, id="float-draft"),
        pytest.param(torch.full((_B, _K), -1), None, None, id="negative-draft-id"),
        pytest.param(None, torch.full((_B, _K, _V), 1 / _V), None, id="p-too-few-positions"),
        pytest.param(None, torch.full((_B + 1, _K + 1, _V), 1 / _V), None, id="p-wrong-batch"),
        pytest.param(None, torch.full((_B, _K + 1), 1.0), None, id="p-2d"),
        pytest.param(None, torch.zeros(_B, _K + 1, 0), None, id="p-empty-vocab"),
        pytest.param(None, None, torch.tensor([_K + 1, 0]), id="lengths-above-k"),
        pytest.param(None, None, torch.tensor([[1, 2]]), id="lengths-2d"),
    ],
)
@pytest.mark.parametrize("fn", ["single_guess", "greedy_rule", "greedy_verify"])
def test_invalid_inputs_raise_value_error_other_verifiers(fn, draft, p, lengths):
    """The same validation in single_guess_rule, greedy_rule and greedy_verify."""
    d0, _, p0 = _valid(_B, _K, _V)
    draft = d0 if draft is None else draft
    p = p0 if p is None else p
    call = {"single_guess": single_guess_rule, "greedy_rule": greedy_rule, "greedy_verify": greedy_verify}[fn]
    with pytest.raises(ValueError):
        call(draft, p=p, draft_lengths=lengths)


def test_single_guess_rejects_zero_dim_p():
    """A 0-dimensional p is a shape error (ValueError), not an IndexError."""
    with pytest.raises(ValueError):
        single_guess_rule(ids([[0]]), p=torch.tensor(1.0))


def test_sample_verdict_rejects_mismatched_rule():
    """A rule built for another draft shape is refused."""
    draft, q, p = _valid()
    rule = rejection_rule(draft, q=q, p=p)
    with pytest.raises(ValueError, match="rule does not match"):
        sample_verdict(rule, draft[:, :2], gen())
    with pytest.raises(ValueError, match="rule does not match"):
        sample_verdict(rule, draft[:1], gen())


def test_draft_tokens_int32_accepted():
    """int32 draft tokens and draft lengths work like int64."""
    draft, q, p = _valid()
    lengths = torch.tensor([3, 1], dtype=torch.int32)
    a = rejection_sample(draft.int(), q=q, p=p, generator=gen(6), draft_lengths=lengths)
    b = rejection_sample(draft, q=q, p=p, generator=gen(6), draft_lengths=lengths.long())
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


# ---------------------------------------------------------------------------------------------- vocabularies


def test_draft_vocab_larger_than_target():
    """Vq > Vp: a draft token ≥ Vp has p = 0 and is always rejected; nothing ≥ Vp is ever emitted."""
    b, vp, vq = 200, 3, 5
    g = gen(7)
    q = t64([[[0.1, 0.1, 0.1, 0.3, 0.4]]]).expand(b, 1, vq)  # [200, 1, 5]
    p = random_probs(g, (b, 2, vp))  # [200, 2, 3]
    draft = torch.full((b, 1), 4)  # [200, 1], a token the target does not have
    rule = rejection_rule(draft, q=q, p=p, dtype=F64)
    assert rule.fallback.shape == (b, 2, vq)
    assert (rule.accept_prob == 0).all() and (rule.fallback[..., vp:] == 0).all()
    v = rejection_sample(draft, q=q, p=p, generator=gen(8))
    assert (v.num_accepted == 0).all() and (v.tokens[:, 0] < vp).all()
    check_verdict(v, draft, [1] * b, vp)


def test_draft_vocab_smaller_than_target():
    """Vq < Vp: a target token ≥ Vq has q = 0, keeps its full p mass in the residual and can be recovered."""
    q = t64([[[0.5, 0.5]]])  # [1, 1, 2]
    p = t64([[[0.25, 0.25, 0.5], [0.0, 0.0, 1.0]]])  # [1, 2, 3]
    rule = rejection_rule(ids([[0]]), q=q, p=p, dtype=F64)
    torch.testing.assert_close(rule.accept_prob, t64([[0.5]]))
    torch.testing.assert_close(rule.fallback[0, 0], t64([0.0, 0.0, 1.0]))  # residual [0, 0, .5]
    torch.testing.assert_close(rule.fallback[0, 1], p[0, 1])
    b = 100
    v = rejection_sample(ids([[0]] * b), q=q.expand(b, 1, 2), p=p.expand(b, 2, 3), generator=gen(9))
    rejected = v.num_accepted == 0
    assert rejected.any() and (v.tokens[rejected, 0] == 2).all()  # the recovered token is one q lacks
    assert (v.tokens[~rejected] == ids([0, 2])).all()


def test_draft_id_outside_smaller_draft_vocab_raises():
    """Vq < Vp: a draft id ≥ Vq is not a token the draft can have proposed: ValueError."""
    q = t64([[[0.5, 0.5]]])  # [1, 1, 2]
    p = t64([[[0.2, 0.2, 0.6], [1 / 3, 1 / 3, 1 / 3]]])  # [1, 2, 3]
    with pytest.raises(ValueError, match="draft vocabulary of size 2"):
        rejection_rule(ids([[2]]), q=q, p=p)


def test_single_guess_id_beyond_target_vocab_always_rejected():
    """A guess the target does not have (id ≥ Vp) is rejected, and the recovered token comes from p."""
    p = t64([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])[..., :2]  # [1, 2, 2]
    rule = single_guess_rule(ids([[5]]), p=p, dtype=F64)
    assert rule.accept_prob.tolist() == [[0.0]]
    torch.testing.assert_close(rule.fallback[0, 0, :2], p[0, 0])
    assert (rule.fallback[0, :, 2:] == 0).all()
    b = 100
    v = single_guess_sample(ids([[5]] * b), p=p.expand(b, 2, 2), generator=gen(10))
    assert (v.num_accepted == 0).all() and set(v.tokens[:, 0].tolist()) == {0, 1}


def test_greedy_draft_id_beyond_target_vocab_rejected():
    """Greedy: a draft id ≥ V never matches the argmax, so it is rejected."""
    p = onehot([[1, 0]], 3)  # [1, 2, 3]
    assert greedy_verify(ids([[7]]), p=p).row(0) == [1]


# ------------------------------------------------------------------------------------------- end of sequence

EOS = 3


def _greedy_case(draft_row: list[int], argmax_row: list[int], v: int = 5) -> tuple[Tensor, Tensor]:
    return ids([draft_row]), onehot([argmax_row], v)  # [1, K], [1, K+1, V]


@pytest.mark.parametrize("verifier", ["greedy_verify", "greedy_rule", "rejection", "single_guess"])
def test_accepted_eos_ends_output(verifier):
    """An accepted EOS at index 1 ends the row: 2 tokens, num_accepted 2, no recovered or bonus token."""
    draft, p = _greedy_case([1, EOS, 2], [1, EOS, 2, 4])  # all accepted without EOS handling
    if verifier == "greedy_verify":
        v = greedy_verify(draft, p=p, eos_token_id=EOS)
    elif verifier == "greedy_rule":
        v = sample_verdict(greedy_rule(draft, p=p), draft, gen(), eos_token_id=EOS)
    elif verifier == "rejection":
        v = rejection_sample(draft, q=torch.full((1, 3, 5), 0.2), p=p, generator=gen(), eos_token_id=EOS)
    else:
        v = single_guess_sample(draft, p=p, generator=gen(), eos_token_id=EOS)
    assert v.tokens.tolist() == [[1, EOS, -1, -1]]
    assert v.num_accepted.tolist() == [2] and v.num_tokens.tolist() == [2]
    assert not v.bonus.any()


def test_accepted_eos_is_not_recovered():
    """An accepted EOS before the end of the draft is the last token: it is neither recovered nor bonus."""
    draft, p = _greedy_case([1, EOS, 2], [1, EOS, 2, 4])
    v = greedy_verify(draft, p=p, eos_token_id=EOS)
    assert not v.recovered.any()


def test_accepted_eos_at_end_of_draft():
    """An accepted EOS as the last draft token: no bonus token, num_tokens = K."""
    draft, p = _greedy_case([1, 2, EOS], [1, 2, EOS, 4])
    v = greedy_verify(draft, p=p, eos_token_id=EOS)
    assert v.row(0) == [1, 2, EOS] and v.num_tokens.tolist() == [3] and v.num_accepted.tolist() == [3]
    assert not v.bonus.any() and not v.recovered.any()


def test_rejected_eos_does_not_end_output():
    """A rejected EOS is replaced by a recovered token; an EOS after the rejection is irrelevant."""
    draft, p = _greedy_case([EOS, 1, EOS], [2, 1, EOS, 0])
    v = greedy_verify(draft, p=p, eos_token_id=EOS)
    assert v.row(0) == [2] and v.recovered.all()
    draft, p = _greedy_case([1, 0, EOS], [1, 2, EOS, 0])
    v = greedy_verify(draft, p=p, eos_token_id=EOS)
    assert v.row(0) == [1, 2] and v.num_tokens.tolist() == [2] and v.recovered.all()


def test_eos_as_recovered_and_bonus_token():
    """EOS may be the recovered or the bonus token: it is emitted as the last token, counted normally."""
    draft, p = _greedy_case([1, 2], [1, EOS, 0])
    v = greedy_verify(draft, p=p, eos_token_id=EOS)
    assert v.row(0) == [1, EOS] and v.num_tokens.tolist() == [2] and v.recovered.all()
    draft, p = _greedy_case([1, 2], [1, 2, EOS])
    v = greedy_verify(draft, p=p, eos_token_id=EOS)
    assert v.row(0) == [1, 2, EOS] and v.num_tokens.tolist() == [3] and v.bonus.all()


def test_eos_none_keeps_tokens_after_eos():
    """Without eos_token_id an accepted EOS id is an ordinary token."""
    draft, p = _greedy_case([1, EOS, 2], [1, EOS, 2, 4])
    assert greedy_verify(draft, p=p).row(0) == [1, EOS, 2, 4]


def test_several_eos_ids():
    """eos_token_id may be a sequence: the first accepted token among them ends the row."""
    draft, p = _greedy_case([1, 4, EOS], [1, 4, EOS, 0])
    assert greedy_verify(draft, p=p, eos_token_id=[EOS, 4]).row(0) == [1, 4]
    assert greedy_verify(draft, p=p, eos_token_id=(EOS,)).row(0) == [1, 4, EOS]


def test_eos_beyond_row_draft_length_is_ignored():
    """An EOS id in the padding after a row's draft is not part of the row and does not cut it."""
    draft, p = _greedy_case([1, EOS, EOS], [1, 2, 0, 0])
    v = greedy_verify(draft, p=p, draft_lengths=ids([1]), eos_token_id=EOS)
    assert v.row(0) == [1, 2] and v.bonus.all()


# ---------------------------------------------------------------------------------------------- ragged rows


def test_ragged_rows_use_their_own_bonus_position():
    """Rows of lengths 3, 1, 0: all accepted; row b's bonus token comes from p at position length_b."""
    draft = ids([[0, 1, 2], [0, 9, 9], [9, 9, 9]])  # [3, 3]; 9s lie after each row's draft
    argmax = [[0, 1, 2, 3], [0, 4, 9, 9], [4, 9, 9, 9]]
    p = onehot([[min(a, 4) for a in row] for row in argmax], 5)  # [3, 4, 5]
    q = torch.full((3, 3, 5), 0.2, dtype=F64)  # [3, 3, 5]
    lengths = ids([3, 1, 0])
    # positions after each row's draft (q) and after its bonus position (p) may hold anything, NaN too
    q[1, 1:] = NAN
    q[2, :] = NAN
    p[1, 2:] = NAN
    p[2, 1:] = -1.0
    draft_ok = torch.where(torch.arange(3) < lengths.unsqueeze(1), draft, 0)  # [3, 3], in-vocab everywhere
    for v in (
        rejection_sample(draft, q=q, p=p, generator=gen(), draft_lengths=lengths),
        single_guess_sample(draft_ok, p=p, generator=gen(), draft_lengths=lengths),
        greedy_verify(draft, p=p, draft_lengths=lengths),
    ):
        assert [v.row(b) for b in range(3)] == [[0, 1, 2, 3], [0, 4], [4]]
        assert v.num_accepted.tolist() == [3, 1, 0] and v.num_tokens.tolist() == [4, 2, 1]
        assert v.bonus.all() and not v.recovered.any()
        assert v.tokens[1, 2:].tolist() == [-1, -1] and v.tokens[2, 1:].tolist() == [-1, -1, -1]


def test_ragged_rule_zero_after_draft_and_bonus_at_length():
    """accept_prob is 0 after each row's draft; the fallback at position length_b is p at length_b."""
    g = gen(11)
    q = random_probs(g, (2, 3, 4))  # [2, 3, 4]
    p = random_probs(g, (2, 4, 4))  # [2, 4, 4]
    rule = rejection_rule(draft_from(q, g), q=q, p=p, draft_lengths=ids([2, 0]), dtype=F64)
    assert (rule.accept_prob[0, 2:] == 0).all() and (rule.accept_prob[1] == 0).all()
    assert (rule.accept_prob[0, :2] > 0).all()
    torch.testing.assert_close(rule.fallback[0, 2], p[0, 2])
    torch.testing.assert_close(rule.fallback[1, 0], p[1, 0])


def test_ragged_rejection_gives_recovered_token():
    """A rejection inside a short row: recovered flag set, tokens after it are -1."""
    draft = ids([[1, 2, 0], [1, 0, 0]])  # [2, 3]
    p = onehot([[1, 3, 0, 0], [1, 1, 0, 0]], 4)  # row 0 rejects at 1; row 1 (length 2) rejects at 1
    v = greedy_verify(draft, p=p, draft_lengths=ids([3, 2]))
    assert [v.row(0), v.row(1)] == [[1, 3], [1, 1]]
    assert v.recovered.tolist() == [True, True] and v.bonus.tolist() == [False, False]
    assert v.tokens.tolist() == [[1, 3, -1, -1], [1, 1, -1, -1]]


def test_negative_padding_after_draft_is_ignored():
    """Draft ids after a row's draft length, -1 padded, are ignored like the q and p entries there."""
    draft = ids([[1, -1]])  # [1, 2]
    p = onehot([[1, 2, 0]], 3)  # [1, 3, 3]
    assert greedy_verify(draft, p=p, draft_lengths=ids([1])).row(0) == [1, 2]


def test_verdict_helpers():
    """Verdict.row, .bonus and .recovered on a hand-built verdict."""
    v = Verdict(
        tokens=ids([[5, 6, 7], [5, -1, -1], [8, -1, -1]]),
        num_accepted=ids([2, 0, 0]),
        num_tokens=ids([3, 1, 1]),
        num_drafted=ids([2, 2, 0]),
    )
    assert [v.row(b) for b in range(3)] == [[5, 6, 7], [5], [8]]
    assert v.bonus.tolist() == [True, False, True]
    assert v.recovered.tolist() == [False, True, False]


# ---------------------------------------------------------------------------------------------- greedy


def test_greedy_hand_example_and_first_argmax():
    """Accept while x_t = argmax p_t (first index among ties), then emit the argmax at the mismatch."""
    draft = ids([[2, 0, 3]])  # [1, 3]
    p = t64([[[0, 0, 5, 1], [4, 1, 4, 0], [0, 3, 3, 1], [0, 0, 0, 1]]])  # [1, 4, 4]; ties at 0/2 and 1/2
    v = greedy_verify(draft, p=p)
    assert v.row(0) == [2, 0, 1] and v.num_accepted.tolist() == [2] and v.recovered.all()
    rule = greedy_rule(draft, p=p)
    assert rule.accept_prob.tolist() == [[1.0, 1.0, 0.0]]
    assert rule.fallback.argmax(-1).tolist() == [[2, 0, 1, 3]]
    assert ((rule.fallback == 0) | (rule.fallback == 1)).all() and (rule.fallback.sum(-1) == 1).all()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    b=st.integers(1, 4),
    k=st.integers(0, 4),
    v=st.integers(1, 5),
    eos=st.none() | st.integers(0, 4),
)
def test_greedy_verify_equals_sampled_greedy_rule(seed, b, k, v, eos):
    """greedy_verify is the (deterministic) outcome of sample_verdict(greedy_rule(...)) for any generator, and
    equals greedy_verify on softmax(logits)."""
    g = gen(seed)
    logits = torch.randint(-3, 4, (b, k + 1, v), generator=g).double()  # [B, K+1, V], small ints: many ties
    target = logits.argmax(-1)  # [B, K+1]
    guess = torch.randint(v, (b, k), generator=g)
    draft = torch.where(torch.rand(b, k, generator=g) < 0.6, target[:, :k], guess)  # [B, K], often accepted
    lengths = torch.randint(k + 1, (b,), generator=g)
    want = greedy_verify(draft, p=logits, draft_lengths=lengths, eos_token_id=eos)
    check_verdict(want, draft, lengths.tolist(), v, None if eos is None else {eos})
    for s in (seed, seed + 1):
        got = sample_verdict(
            greedy_rule(draft, p=logits, draft_lengths=lengths), draft, gen(s), eos_token_id=eos
        )
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
    soft = greedy_verify(draft, p=logits.softmax(-1), draft_lengths=lengths, eos_token_id=eos)
    assert torch.equal(soft.tokens, want.tokens) and torch.equal(soft.num_tokens, want.num_tokens)
    # each row's greedy tokens from its own positions only, garbage past them: the same verdict
    targets = torch.randint(v, (b, k + 1), generator=g)  # [B, K+1]
    for row, n in enumerate(lengths.tolist()):
        targets[row, : n + 1] = greedy_targets(logits[row, : n + 1])
        assert targets[row, : n + 1].tolist() == target[row, : n + 1].tolist()  # torch.argmax's first index
    got = greedy_verify_targets(draft, targets=targets, draft_lengths=lengths, eos_token_id=eos)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_tokens, want.num_tokens)
    assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.recovered, want.recovered)


def test_greedy_targets_validation():
    """greedy_targets names a NaN's position (one anywhere in a row shows in its maximum) and takes [P, V]
    only; greedy_verify_targets takes integer targets of shape [B, K+1] only."""
    scores = torch.zeros(3, 5)  # [P, V]
    scores[2, 4] = NAN
    with pytest.raises(ValueError, match=re.escape("p has NaN at row 0, position 2")):
        greedy_targets(scores)
    scores[2, 4] = float("inf")  # an infinity is a score like any other
    assert greedy_targets(scores).tolist() == [0, 0, 4]
    with pytest.raises(ValueError, match=re.escape("p must have shape [P, V]")):
        greedy_targets(torch.zeros(1, 3, 5))
    draft = ids([[1, 2]])  # [1, 2]
    for bad in (ids([[1, 2]]), torch.zeros(1, 3)):
        with pytest.raises(ValueError, match=re.escape("targets must be an integer tensor of shape [1, 3]")):
            greedy_verify_targets(draft, targets=bad)
    assert greedy_verify_targets(draft, targets=ids([[1, 0, 0]])).row(0) == [1, 0]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    b=st.integers(1, 4),
    k=st.integers(0, 4),
    v=st.integers(2, 6),
    zero_frac=st.sampled_from([0.0, 0.5, 0.9]),
)
def test_rejection_with_one_hot_p_is_greedy(seed, b, k, v, zero_frac):
    """With a temperature-0 (one-hot) p, rejection_sample and single_guess_sample emit exactly the greedy
    tokens, whatever q is and whatever the generator."""
    g = gen(seed)
    target = torch.randint(v, (b, k + 1), generator=g)  # [B, K+1]
    p = torch.nn.functional.one_hot(target, v).float()  # [B, K+1, V]
    q = random_probs(g, (b, k, v), zero_frac, dtype=torch.float32)  # [B, K, V]
    draft = torch.where(torch.rand(b, k, generator=g) < 0.5, target[:, :k], draft_from(q, g))
    lengths = torch.randint(k + 1, (b,), generator=g)
    want = greedy_verify(draft, p=p, draft_lengths=lengths)
    for got in (
        rejection_sample(draft, q=q, p=p, generator=gen(seed), draft_lengths=lengths),
        single_guess_sample(draft, p=p, generator=gen(seed + 1), draft_lengths=lengths),
    ):
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)


# ---------------------------------------------------------------------------------------- dtype, determinism


def test_dtype_float32_default_and_float64_on_request():
    """Rule tensors are float32 by default and float64 when asked; greedy_rule is float64."""
    draft, q, p = _valid()
    assert rejection_rule(draft, q=q, p=p).accept_prob.dtype == torch.float32
    assert rejection_rule(draft, q=q, p=p).fallback.dtype == torch.float32
    q64, p64 = q.double() / q.double().sum(-1, keepdim=True), p.double() / p.double().sum(-1, keepdim=True)
    for rule in (rejection_rule(draft, q=q64, p=p64, dtype=F64), single_guess_rule(draft, p=p64, dtype=F64)):
        assert rule.accept_prob.dtype == F64 and rule.fallback.dtype == F64
    assert single_guess_rule(draft, p=p).accept_prob.dtype == torch.float32
    assert greedy_rule(draft, p=p).accept_prob.dtype == F64
    v = rejection_sample(draft, q=q64, p=p64, generator=gen(), dtype=F64)
    check_verdict(v, draft, [3, 3], 4)


def test_float64_arithmetic_on_float32_inputs():
    """dtype=float64 is the precision of the arithmetic; float32 softmax outputs are valid inputs for it."""
    g = gen(12)
    q = torch.randn(4, 3, 50, generator=g).softmax(-1)  # [4, 3, 50] float32
    p = torch.randn(4, 4, 50, generator=g).softmax(-1)  # [4, 4, 50] float32
    rule = rejection_rule(draft_from(q, g), q=q, p=p, dtype=F64)
    assert rule.accept_prob.dtype == F64


def test_same_seed_same_verdict_different_seeds_differ():
    """The generator is the only randomness: equal seeds give equal verdicts (whatever the global RNG does),
    different seeds differ somewhere over many rows."""
    g = gen(13)
    b, k, v = 64, 4, 6
    q = random_probs(g, (b, k, v), dtype=torch.float32)
    p = random_probs(g, (b, k + 1, v), dtype=torch.float32)
    draft = draft_from(q, g)

    def run(seed: int) -> Verdict:
        torch.manual_seed(seed + 1000)  # perturb the global generator: it must not matter
        torch.rand(7)
        return rejection_sample(draft, q=q, p=p, generator=gen(seed))

    a, a2, c = run(1), run(1), run(2)
    assert torch.equal(a.tokens, a2.tokens) and torch.equal(a.num_accepted, a2.num_accepted)
    assert not torch.equal(a.tokens, c.tokens)
    s1 = single_guess_sample(draft, p=p, generator=gen(1))
    assert torch.equal(s1.tokens, single_guess_sample(draft, p=p, generator=gen(1)).tokens)
    assert not torch.equal(s1.tokens, single_guess_sample(draft, p=p, generator=gen(2)).tokens)


# ---------------------------------------------------------------------------------------------- properties


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    b=st.integers(1, 5),
    k=st.integers(0, 5),
    vp=st.integers(1, 7),
    dv=st.integers(-3, 3),
    zero_frac=st.sampled_from([0.0, 0.4, 0.8]),
    eos=st.none() | st.integers(0, 6),
    dtype=st.sampled_from([torch.float32, F64]),
)
def test_rejection_sample_invariants(seed, b, k, vp, dv, zero_frac, eos, dtype):
    """For random valid inputs (ragged rows, different vocabularies, sparse p and q, EOS or not): the rule's
    invariants hold, every verdict's invariants hold, recovered tokens lie in the residual's support and
    bonus tokens in p's support."""
    g = gen(seed)
    vq = max(1, vp + dv)
    q = random_probs(g, (b, k, vq), zero_frac, dtype=dtype)  # [B, K, Vq]
    p = random_probs(g, (b, k + 1, vp), zero_frac, dtype=dtype)  # [B, K+1, Vp]
    draft = draft_from(q, g)  # [B, K]
    lengths = torch.randint(k + 1, (b,), generator=g)  # [B]
    rule = rejection_rule(draft, q=q, p=p, draft_lengths=lengths, dtype=dtype)
    assert rule.accept_prob.dtype == dtype and rule.fallback.dtype == dtype
    check_rule(rule, lengths.tolist(), vp)
    v = sample_verdict(rule, draft, gen(seed + 1), eos_token_id=eos)
    check_verdict(v, draft, lengths.tolist(), vp, None if eos is None else {eos})
    for r in range(b):
        a, m = int(v.num_accepted[r]), int(v.num_tokens[r])
        if m == a + 1:  # the last token was sampled from the fallback at position a
            assert rule.fallback[r, a, int(v.tokens[r, a])] > 0
        if bool(v.bonus[r]):
            assert p[r, a, int(v.tokens[r, a])] > 0
    again = rejection_sample(
        draft, q=q, p=p, generator=gen(seed + 1), draft_lengths=lengths, eos_token_id=eos, dtype=dtype
    )
    assert torch.equal(again.tokens, v.tokens) and torch.equal(again.num_tokens, v.num_tokens)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    b=st.integers(1, 5),
    k=st.integers(0, 5),
    v=st.integers(1, 7),
    zero_frac=st.sampled_from([0.0, 0.6]),
    eos=st.none() | st.integers(0, 6),
)
def test_single_guess_sample_invariants(seed, b, k, v, zero_frac, eos):
    """For random guesses (also ones the target does not have): verdict invariants hold, a recovered token is
    never the rejected guess (unless p is a point mass on it) and always has p > 0."""
    g = gen(seed)
    p = random_probs(g, (b, k + 1, v), zero_frac, dtype=torch.float32)  # [B, K+1, V]
    draft = torch.randint(v + 2, (b, k), generator=g)  # [B, K], ids up to V+1
    lengths = torch.randint(k + 1, (b,), generator=g)
    rule = single_guess_rule(draft, p=p, draft_lengths=lengths)
    check_rule(rule, lengths.tolist(), v)
    verdict = single_guess_sample(
        draft, p=p, generator=gen(seed + 1), draft_lengths=lengths, eos_token_id=eos
    )
    check_verdict(verdict, draft, lengths.tolist(), v, None if eos is None else {eos})
    for r in range(b):
        a, m = int(verdict.num_accepted[r]), int(verdict.num_tokens[r])
        if m == a + 1:
            tok = int(verdict.tokens[r, a])
            assert p[r, a, tok] > 0
            if a < int(lengths[r]):  # a rejected guess: recovered from p without it
                guess = int(draft[r, a])
                if guess >= v or p[r, a, guess] < 1:
                    assert tok != guess

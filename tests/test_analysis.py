"""Tests of verispec.costs.analytic: worked numbers, closed forms, brute force, properties, validation."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from verispec.costs.analytic import (
    DEFAULT_K_MAX,
    BatchCost,
    CostModel,
    acceptance_rate,
    best_tree_size,
    break_even_alpha,
    expected_speedup,
    expected_tokens_per_call,
    optimal_k,
    speedup_from_tokens,
    tree_tokens_bound,
)
from verispec.errors import UsageError

alphas = st.floats(0.0, 1.0)
ks = st.integers(0, 40)
cost_ratios = st.floats(0.0, 2.0)


def closed_form_tokens(alpha: float, k: int) -> float:
    """(1 − α^{K+1}) / (1 − α), K + 1 at α = 1: the textbook formula, independent of the implementation."""
    return k + 1.0 if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def linear(k: int) -> float:
    """A compute-bound-ish verification curve: each extra token costs 10% of a step."""
    return 1.0 + 0.1 * (k - 1)


MEASURED = [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6]  # v(1..9), shaped like a measured curve
CURVES = [None, linear, MEASURED, lambda k: 1.0 + 0.01 * (k - 1) ** 2]


# ---------------------------------------------------------------------------------------------- acceptance


def test_acceptance_rate_examples():
    assert acceptance_rate(p=[0.5, 0.5, 0.0], q=[0.25, 0.25, 0.5]) == pytest.approx(0.5)
    assert acceptance_rate(p=[0.3, 0.7], q=[0.3, 0.7]) == pytest.approx(1.0)
    assert acceptance_rate(p=[1.0, 0.0], q=[0.0, 1.0]) == 0.0


def test_acceptance_rate_is_batched_over_leading_axes():
    p = np.array([[0.5, 0.5], [1.0, 0.0]])  # [2, V=2]
    q = np.array([[0.5, 0.5], [0.5, 0.5]])
    np.testing.assert_allclose(acceptance_rate(p=p, q=q), [1.0, 0.5])


@pytest.mark.parametrize(
    "p, q",
    [
        ([0.5, 0.5], [0.5, 0.25, 0.25]),  # shapes differ
        ([1.5, -0.5], [0.5, 0.5]),  # negative
        ([0.5, 0.4], [0.5, 0.5]),  # does not sum to 1
        ([np.nan, 1.0], [0.5, 0.5]),
        ([], []),
        (1.0, 1.0),  # 0-d
    ],
)
def test_acceptance_rate_rejects_bad_distributions(p, q):
    with pytest.raises(ValueError, match=r"^[^\n]+$"):
        acceptance_rate(p=p, q=q)


# ------------------------------------------------------------------------------------------ tokens per call


def test_expected_tokens_literature_example():
    # α = 0.8, K = 10: (1 − 0.8^11) / 0.2 ≈ 4.57 tokens per target call.
    assert expected_tokens_per_call(0.8, 10) == pytest.approx(4.5705, abs=1e-4)
    assert expected_tokens_per_call(0.8, 10) > 4


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.999999, 1.0])
@pytest.mark.parametrize("k", [0, 1, 5, 30])
def test_expected_tokens_matches_closed_form(alpha, k):
    assert expected_tokens_per_call(alpha, k) == pytest.approx(closed_form_tokens(alpha, k), rel=1e-9)


def test_per_position_example():
    # 1 + α_1 + α_1·α_2 = 1 + 0.9 + 0.45
    assert expected_tokens_per_call([0.9, 0.5]) == pytest.approx(2.35)
    assert expected_tokens_per_call(np.array([0.9, 0.5]), k=2) == pytest.approx(2.35)
    assert expected_tokens_per_call([]) == 1.0


@given(alphas, ks)
def test_per_position_equals_scalar_for_constant_alpha(alpha, k):
    assert expected_tokens_per_call([alpha] * k) == pytest.approx(
        expected_tokens_per_call(alpha, k), rel=1e-12
    )


@given(alphas, ks)
def test_tokens_bounds(alpha, k):
    tokens = expected_tokens_per_call(alpha, k)
    assert tokens >= 1.0 and tokens <= k + 1 + 1e-12


@given(alphas, alphas, ks, cost_ratios)
def test_tokens_and_speedup_are_monotone_in_alpha(a, b, k, c):
    lo, hi = min(a, b), max(a, b)
    assert expected_tokens_per_call(lo, k) <= expected_tokens_per_call(hi, k)
    assert expected_speedup(lo, k, c, linear) <= expected_speedup(hi, k, c, linear)


@given(st.lists(alphas, min_size=1, max_size=12), st.data())
def test_per_position_is_monotone_in_each_alpha(per_position, data):
    # Raising any one α_i never lowers E[L].
    i = data.draw(st.integers(0, len(per_position) - 1))
    raised = list(per_position)
    raised[i] = data.draw(st.floats(raised[i], 1.0))
    assert expected_tokens_per_call(raised) >= expected_tokens_per_call(per_position) - 1e-12


# ---------------------------------------------------------------------------------------------- speedup


def test_speedup_worked_example():
    # 50 ms target, 5 ms draft (c = 0.1), K = 5, 3 accepted on average → 4 tokens per call:
    # 4 · 50 ms / (50 ms + 5 · 5 ms) = 2.67×.
    assert speedup_from_tokens(4.0, 5, cost_ratio=0.1) == pytest.approx(4 * 50 / (50 + 25))
    assert speedup_from_tokens(4.0, 5, cost_ratio=0.1) == pytest.approx(2.6667, abs=1e-4)


def test_speedup_formula_with_each_kind_of_curve():
    alpha, k, c = 0.7, 4, 0.05
    expected = closed_form_tokens(alpha, k) / (linear(k + 1) + k * c)
    sequence = [linear(j) for j in range(1, 6)]
    for curve in (linear, sequence, np.array(sequence)):
        assert expected_speedup(alpha, k, c, curve) == pytest.approx(expected)
    assert expected_speedup(alpha, k, c) == pytest.approx(closed_form_tokens(alpha, k) / (1 + k * c))


@given(alphas, cost_ratios)
def test_k0_is_plain_decoding(alpha, c):
    for curve in CURVES:
        assert expected_speedup(alpha, 0, c, curve) == pytest.approx(1.0)


def test_per_position_speedup_uses_the_length_of_the_sequence():
    assert expected_speedup([0.9, 0.5], cost_ratio=0.1) == pytest.approx(2.35 / 1.2)


# ---------------------------------------------------------------------------------------------- optimal K


def brute_force_k(alpha: float, c: float, curve, k_max: int) -> int:
    """argmax of the closed-form speedup over 0..k_max, the smallest on ties (written independently)."""

    def v(k: int) -> float:
        """The curve's v(k)."""
        if curve is None:
            return 1.0
        return curve[k - 1] if isinstance(curve, list) else curve(k)

    speedups = [closed_form_tokens(alpha, k) / (v(k + 1) + k * c) for k in range(k_max + 1)]
    best = max(speedups)
    return next(k for k, s in enumerate(speedups) if s >= best * (1 - 1e-12))


@pytest.mark.parametrize("curve", CURVES, ids=["flat", "linear", "measured", "quadratic"])
@pytest.mark.parametrize("c", [0.0, 0.02, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.8, 0.9, 0.97])
def test_optimal_k_matches_brute_force(curve, c, alpha):
    assert optimal_k(alpha, c, curve, k_max=8) == brute_force_k(alpha, c, curve, 8)


@given(
    st.lists(st.floats(0, 1), max_size=12),
    st.sampled_from(CURVES),
    st.sampled_from([0.0, 0.05, 0.3]),
    st.integers(1, 5),
)
def test_best_tree_size_maximizes_tokens_per_cost(scores, curve, c, steps):
    """best_tree_size against a brute force over every size: the expected tokens 1 + the n best path
    probabilities over v(n + 1) + the drafting already spent; the smallest best size (within 1e-12)."""
    scores = sorted(scores, reverse=True)
    cost = CostModel(c, curve)
    n_max = len(scores) if cost.max_k is None else min(len(scores), cost.max_k)
    rates = [(1 + sum(scores[:n])) / (cost.verify(n + 1) + steps * c) for n in range(n_max + 1)]
    best = max(rates)
    assert best_tree_size(scores, cost, steps) == next(
        n for n, r in enumerate(rates) if r >= best * (1 - 1e-12)
    )


def test_best_tree_size_does_not_verify_what_adds_nothing():
    assert best_tree_size([1e-12], CostModel(0.0, None), 1) == 0  # found by hypothesis: a free but empty node
    assert best_tree_size([1e-9], CostModel(0.0, None), 1) == 1


def test_best_tree_size_examples():
    measured = CostModel(0.058, [1.0, 1.25, 1.28, 1.25, 1.32, 1.36, 1.49, 1.53])
    assert best_tree_size([0.1, 0.05], measured, 1) == 0  # not worth verifying: a plain step
    assert best_tree_size([0.9, 0.5, 0.3, 0.2, 0.1], measured, 3) == 5
    assert best_tree_size([0.99] * 20, measured, 4) == 7  # the curve's end bounds the tree
    assert best_tree_size([], measured, 1) == 0
    with pytest.raises(ValueError):
        best_tree_size([0.5], measured, -1)


def test_optimal_k_linear_curve_example():
    # v(k) = 1 + 0.1(k − 1), c = 0.05, α = 0.8: speedups 1, 1.57, 1.88, 2.04, 2.10, 2.11, 2.08, ... peak at
    # K = 5: E[L] = (1 − 0.8⁶) / 0.2 = 3.689 over v(6) + 5c = 1.5 + 0.25.
    assert optimal_k(0.8, 0.05, linear, k_max=20) == 5
    assert expected_speedup(0.8, 5, 0.05, linear) == pytest.approx(3.68928 / 1.75)
    # a proposal's fixed cost c₀ = 0.5 is paid once: K = 6 (3.951 / 2.4 = 1.646) beats K = 5 (3.689 / 2.25 =
    # 1.640)
    assert optimal_k(0.8, 0.05, linear, k_max=20, fixed_cost=0.5) == 6


def test_optimal_k_edges_and_defaults():
    assert optimal_k(0.0, 0.1) == 0  # nothing is ever accepted: do not speculate
    assert optimal_k(1.0, 0.0) == DEFAULT_K_MAX  # free drafting, everything accepted: draft as far as allowed
    assert optimal_k(1.0, 0.0, MEASURED) <= len(MEASURED) - 1  # a sequence bounds K by default
    with pytest.raises(ValueError, match="beyond"):
        optimal_k(0.9, 0.1, MEASURED, k_max=len(MEASURED))


# ---------------------------------------------------------------------------------------------- break-even


@pytest.mark.parametrize("c", [0.0, 0.05, 0.3, 0.9])
def test_break_even_k1_is_the_cost_ratio(c):
    # K = 1, v ≡ 1: 1 + α ≥ 1 + c ⇔ α ≥ c.
    assert break_even_alpha(1, c) == pytest.approx(c, abs=1e-9)


@given(st.integers(1, 16), st.floats(0.001, 1.5))
def test_break_even_is_the_smallest_paying_alpha(k, c):
    alpha = break_even_alpha(k, c, linear)
    if alpha is None:
        assert expected_speedup(1.0, k, c, linear) < 1
        return
    assert expected_speedup(alpha, k, c, linear) >= 1 - 1e-12
    if alpha > 1e-6:
        assert expected_speedup(alpha - 1e-6, k, c, linear) < 1


def test_break_even_edges():
    assert break_even_alpha(0, 0.5) == 0.0  # K = 0 is plain decoding
    assert break_even_alpha(4, 0.0) == 0.0  # free drafting on a flat curve never loses
    assert break_even_alpha(3, 2.0) is None  # 4 tokens at most for 7 steps of cost


# ---------------------------------------------------------------------------------------------- validation


def test_cost_model_normalizes_and_is_frozen():
    cost = CostModel(0.1, np.array(MEASURED))
    assert cost.verify_cost == tuple(MEASURED) and cost.max_k == len(MEASURED) - 1
    assert cost.round_cost(2) == pytest.approx(MEASURED[2] + 0.2)
    with pytest.raises(AttributeError):
        cost.cost_ratio = 0.2  # type: ignore[misc]


@pytest.mark.parametrize("curve", [MEASURED, lambda k: 1.0 + 0.05 * (k - 1)], ids=["sequence", "callable"])
def test_a_proposals_fixed_cost_is_paid_once_by_a_round_that_drafts(curve):
    """c₀ (``fixed_cost``): K·c + c₀ for K > 0, nothing at K = 0; round_costs agrees with round_cost."""
    cost = CostModel(0.1, curve, fixed_cost=0.25)
    v = cost.verify
    assert cost.draft_cost(0) == 0.0 and cost.round_cost(0) == 1.0
    assert cost.draft_cost(3) == pytest.approx(0.55) and cost.round_cost(3) == pytest.approx(v(4) + 0.55)
    np.testing.assert_allclose(cost.round_costs(5), [cost.round_cost(k) for k in range(6)])
    plain = CostModel(0.1, curve)
    np.testing.assert_allclose(cost.round_costs(5)[1:] - plain.round_costs(5)[1:], 0.25)


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_tokens_per_call(1.5, 3),
        lambda: expected_tokens_per_call(-0.1, 3),
        lambda: expected_tokens_per_call(math.nan, 3),
        lambda: expected_tokens_per_call(True, 3),
        lambda: expected_tokens_per_call("0.5", 3),
        lambda: expected_tokens_per_call(0.5),  # k missing
        lambda: expected_tokens_per_call(0.5, -1),
        lambda: expected_tokens_per_call(0.5, 2.5),
        lambda: expected_tokens_per_call([0.5, 1.2]),
        lambda: expected_tokens_per_call([[0.5]]),
        lambda: expected_tokens_per_call([0.5, 0.5], k=3),
        lambda: speedup_from_tokens(0.5, 3),  # fewer than one token per call
        lambda: speedup_from_tokens(5.0, 3),  # more than K + 1
        lambda: speedup_from_tokens(2.0, 3, cost_ratio=-0.1),
        lambda: speedup_from_tokens(2.0, 3, cost_ratio=math.inf),
        lambda: expected_speedup(0.5, 3, 0.1, [1.0, 1.1]),  # curve too short for K + 1 = 4
        lambda: expected_speedup(0.5, 3, 0.1, [2.0, 2.1, 2.2, 2.3]),  # v(1) must be 1
        lambda: expected_speedup(0.5, 3, 0.1, [1.0, 0.0, 1.0, 1.0]),  # v(k) > 0
        lambda: expected_speedup(0.5, 3, 0.1, [1.0, math.nan, 1.0, 1.0]),
        lambda: expected_speedup(0.5, 3, 0.1, lambda k: -1.0),
        lambda: expected_speedup(0.5, 3, 0.1, lambda k: 1.0 if k == 1 else math.inf),
        lambda: expected_speedup(0.5, 3, 0.1, "fast"),
        lambda: expected_speedup(0.5, 3, 0.1, []),
        lambda: optimal_k(1.2, 0.1),
        lambda: optimal_k([0.5, 0.5], 0.1),
        lambda: optimal_k(0.5, 0.1, k_max=-1),
        lambda: break_even_alpha(-1, 0.1),
        lambda: break_even_alpha(2, -0.1),
        lambda: CostModel(0.1, lambda k: 0.5),  # v(1) checked on construction
        lambda: CostModel(0.1, MEASURED, fixed_cost=-0.01),
        lambda: CostModel(0.1, MEASURED, fixed_cost=math.nan),
    ],
)
def test_bad_arguments_raise_one_line_value_error(call):
    with pytest.raises(ValueError, match=r"^[^\n]+$"):
        call()


GRID = BatchCost((1, 2, 4), (1, 2, 4), ((1.0, 1.2, 1.6), (1.5, 1.9, 2.7), (2.4, 3.2, 4.8)))


def test_batch_cost_is_the_grid_at_its_points_and_linear_between():
    for i, b in enumerate(GRID.rows):
        for j, m in enumerate(GRID.tokens):
            assert GRID.forward(b, b * m) == GRID.cost[i][j]
    assert GRID.forward(1, 3) == pytest.approx(1.4)  # one row, 3 tokens: halfway between m = 2 and 4
    assert GRID.forward(3, 3) == pytest.approx((1.5 + 2.4) / 2)  # 3 rows of one token: halfway in b
    assert GRID.forward(3, 6) == pytest.approx((1.9 + 3.2) / 2)  # 2 tokens in each of 3 rows
    assert GRID.forward(2, 3) == pytest.approx((1.5 + 1.9) / 2)  # 1.5 tokens per row
    assert GRID.forward(8, 8) == pytest.approx(2.4 + (2.4 - 1.5) / 2 * 4)  # past the rows: the last segment
    assert GRID.forward(1, 8) == pytest.approx(1.6 + 0.4 / 2 * 4)  # past the tokens likewise
    assert GRID.forward(2, 2) > GRID.forward(1, 2)  # two rows of one token: two caches read, not one


@pytest.mark.parametrize(
    "args, message",
    [
        (((1,), (1, 2), ((1.0, 1.1),)), "rows must be >= 2 increasing integers"),
        (((1, 1), (1, 2), ((1.0, 1.1), (1.0, 1.1))), "rows must be >= 2 increasing integers"),
        (((1, 2), (0, 2), ((1.0, 1.1), (1.0, 1.1))), "tokens must be >= 2 increasing integers"),
        (((1, 2), (1, 2), ((1.0, 1.1),)), "must be 2 x 2 numbers > 0"),
        (((1, 2), (1, 2), ((1.0, 1.1), (1.0, 0.0))), "must be 2 x 2 numbers > 0"),
        (((1, 2), (1, 2), ((1.0, 1.1), (1.0, float("nan")))), "must be 2 x 2 numbers > 0"),
        (((1, 2), (1, 2), "grid"), "must be a grid of numbers|must be 2 x 2"),
    ],
)
def test_batch_cost_refuses_a_bad_grid(args, message):
    with pytest.raises(ValueError, match=message):
        BatchCost(*args)


@pytest.mark.parametrize("rows, tokens", [(0, 1), (2, 1), (1.5, 2), (True, 2), (1, "2")])
def test_batch_cost_refuses_a_bad_forward(rows, tokens):
    with pytest.raises(ValueError, match="a batch forward needs 1 <= rows <= tokens"):
        GRID.forward(rows, tokens)


C4 = ((), (0,), (1,), (2,), (0, 0))  # eagle's default tree: three first tokens, the best after the best


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6))
def test_a_chains_tree_bound_is_its_expected_tokens(alphas):
    paths = [tuple([0] * d) for d in range(len(alphas) + 1)]  # a chain of K = len(alphas) drafts
    expected = 1 + sum(math.prod(alphas[: i + 1]) for i in range(len(alphas)))  # 1 + α1 + α1·α2 + …
    assert tree_tokens_bound(paths, alphas) == pytest.approx(expected)


@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_c4_bound_credits_its_siblings_what_the_first_guess_misses(a1, a2):
    assert tree_tokens_bound(C4, [a1, a2]) == pytest.approx(2 + a1 * a2)


@given(st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3), st.randoms(use_true_random=False))
def test_the_tree_bound_holds_whatever_the_siblings_guess(alphas, rng):
    """A tree whose first-ranked children are accepted at the top-1 rates and whose other children at any
    rates that leave a depth's probabilities summing to at most 1: its exact expected tokens never exceed
    the bound."""
    paths = [(), (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)]
    split: dict[
        tuple[int, ...], float
    ] = {}  # a node's rank > 0 children's acceptance probabilities, given their parent
    for parent in {p[:-1] for p in paths if p}:
        depth = len(parent)
        others = [p for p in paths if p and p[:-1] == parent and p[-1] != 0]
        weights = [rng.random() for _ in others]
        scale = (1 - alphas[depth]) * rng.random() / max(sum(weights), 1e-12)
        split |= {p: w * scale for p, w in zip(others, weights, strict=True)}

    def exact(node):
        kids = [p for p in paths if p and p[:-1] == node]
        return 1 + sum((alphas[len(node)] if c[-1] == 0 else split[c]) * exact(c) for c in kids)

    assert exact(()) <= tree_tokens_bound(paths, alphas) + 1e-12


def test_tree_bound_refuses_no_rates():
    with pytest.raises(UsageError, match="at least one depth"):
        tree_tokens_bound(C4, [])
    with pytest.raises(UsageError):
        tree_tokens_bound(C4, [1.5])

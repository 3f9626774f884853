"""The calibrated costs corrected by measured ratios (verispec.costs.corrected), on hand-made estimates: the
formulas of its docstring, term by term."""

from __future__ import annotations

import pytest

from verispec.costs.analytic import BatchCost, CostModel
from verispec.costs.corrected import DRAFT, OVERHEAD, correct, correct_batch, ratio

PRIOR = CostModel(0.1, (1.0, 1.2, 1.4, 1.6, 1.8, 2.0), catch_up=0.01, fixed_cost=0.02)


def test_nothing_estimated_is_the_prior_itself():
    assert correct(PRIOR, {}) is PRIOR
    batch = BatchCost((1, 2), (1, 2), ((1.0, 1.2), (1.5, 1.9)))
    assert correct_batch(batch, {}) is batch


def test_a_size_not_measured_takes_the_smaller_ratio_of_the_sizes_around_it_the_end_ones_beyond():
    estimates = {("forward", 2): 1.3, ("forward", 5): 1.1}
    v = correct(PRIOR, estimates).verify_cost
    # size 1 is 1 by definition; 3 and 4 lie between 2 (1.3) and 5 (1.1): the smaller; 6 beyond 5: 5's
    assert v == pytest.approx((1.0, 1.2 * 1.3, 1.4 * 1.1, 1.6 * 1.1, 1.8 * 1.1, 2.0 * 1.1))
    assert ratio(estimates, ("forward", 1)) == 1.0 and ratio(estimates, ("forward", 9)) == 1.1
    only_two = {("forward", 2): 1.3}  # between size 1 (1) and 2 (1.3) nothing lies; beyond 2: 2's
    assert ratio(only_two, ("forward", 4)) == 1.3
    rows = {("rows", 4): 1.2, ("rows", 8): 0.9}  # row counts have no size 1 among them
    assert [ratio(rows, ("rows", b)) for b in (2, 4, 6, 16)] == [1.2, 1.2, 0.9, 0.9]
    assert ratio({}, ("rows", 3)) == 1.0  # none seen: the prior's


def test_no_block_is_priced_below_one_token():
    v = correct(PRIOR, {("forward", 2): 0.5, ("forward", 6): 0.6}).verify_cost
    assert v[1] == 1.0 and v[5] == pytest.approx(1.2)  # 1.2 × 0.5 → one token; 2.0 × 0.6 = 1.2


def test_the_rest_of_a_round_and_the_drafter():
    o, r_d = 0.25, 2.0
    corrected = correct(PRIOR, {OVERHEAD: o, DRAFT: r_d, ("forward", 3): 1.5})
    whole = 1 + o  # a plain round: its forward and the rest
    factors = (1, 1, 1.5, 1.5, 1.5, 1.5)  # sizes 1, 2 (between 1 and 3: the smaller), 3, beyond 3
    expect = tuple((max(x * f, 1.0) + o) / whole for x, f in zip(PRIOR.verify_cost, factors, strict=True))
    assert corrected.verify_cost == pytest.approx(expect)
    assert corrected.verify_cost[0] == pytest.approx(1.0)  # a plain round costs one plain round
    assert corrected.cost_ratio == pytest.approx(0.1 * r_d / whole)
    assert corrected.catch_up == pytest.approx(0.01 * r_d / whole)
    assert corrected.fixed_cost == pytest.approx(0.02 * r_d / whole)


def test_a_curve_given_as_a_function_is_corrected_as_its_table():
    table = correct(PRIOR, {OVERHEAD: 0.1, ("forward", 4): 0.8})
    function = correct(
        CostModel(0.1, lambda k: PRIOR.verify_cost[k - 1], 0.01, 0.02), {OVERHEAD: 0.1, ("forward", 4): 0.8}
    )
    assert [function.verify(k) for k in range(1, 7)] == pytest.approx(list(table.verify_cost))


def test_a_batch_grid_by_its_row_counts_one_row_by_its_sizes():
    batch = BatchCost((1, 2, 4), (1, 3), ((1.0, 1.4), (1.5, 2.0), (2.5, 3.5)))
    o = 0.5
    grid = correct_batch(batch, {OVERHEAD: o, ("rows", 2): 1.2, ("forward", 3): 1.1}).cost
    expect = (
        (1.0, (1.4 * 1.1 + o) / (1 + o)),  # one row: its tokens' size ratio
        ((1.5 * 1.2 + o) / (1 + o), (2.0 * 1.2 + o) / (1 + o)),  # two rows: the row count's ratio
        ((2.5 * 1.2 + o) / (1 + o), (3.5 * 1.2 + o) / (1 + o)),  # four: the end one's beyond it
    )
    assert [list(row) for row in grid] == [pytest.approx(list(row)) for row in expect]
    by_size = correct_batch(batch, {("forward", 3): 1.1}).cost  # no row count estimated: sizes for every b
    assert by_size[2] == pytest.approx((2.5, 3.5 * 1.1))

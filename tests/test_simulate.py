"""Tests of verispec.costs.simulate: the family, Monte-Carlo vs the analytic model, seeding, validation.

Tolerance of the Monte-Carlo checks: 5 standard errors, computed from the samples themselves. The estimates
are means of many i.i.d. bounded variables, hence close to normal: a correct simulation lands outside 5 SE
with probability ≈ 6e-7 per check (and the seeds are fixed, so the tests are deterministic anyway), while a
wrong rule (e.g. accepting with p/q uncapped, or counting tokens off by one) is off by hundreds of SE.
"""

import dataclasses
import json
import math
import time

import numpy as np
import pytest

from verispec.costs import simulate as sim
from verispec.costs.analytic import acceptance_rate, expected_speedup, expected_tokens_per_call
from verispec.costs.simulate import (
    SimulationConfig,
    agreement_pairs,
    pair_acceptance,
    simulate,
    simulate_rounds,
)

Z = 5.0  # standard errors allowed between Monte-Carlo and analytic values


def within(mc: float, analytic: float, se: float) -> bool:
    """|mc − analytic| ≤ Z·SE; exact equality when the estimate has no variance (SE = 0)."""
    return abs(mc - analytic) <= Z * se if se > 0 else mc == pytest.approx(analytic, abs=1e-12)


@pytest.fixture(scope="module")
def grid():
    """One simulation over both modes, agreements across the greedy transition, and several K."""
    config = SimulationConfig(ks=(1, 3, 8), agreements=(0.0, 0.3, 0.5, 0.8, 0.95, 1.0), rounds=50_000, seed=7)
    return simulate(config)


# ---------------------------------------------------------------------------------------------- the family


@pytest.mark.parametrize("agreement", [0.0, 0.25, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("vocab_size", [2, 7, 64])
def test_family_has_acceptance_rate_equal_to_agreement(agreement, vocab_size):
    p, q = agreement_pairs(agreement, vocab_size, 50, np.random.default_rng(0))
    assert p.shape == q.shape == (50, vocab_size)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(acceptance_rate(p=p, q=q), agreement, atol=1e-12)
    assert np.all(p[:, vocab_size // 2 :] == 0)


def test_pair_acceptance_modes():
    p, q = agreement_pairs(0.6, 16, 200, np.random.default_rng(1))
    np.testing.assert_allclose(pair_acceptance(p=p, q=q, mode="sampled"), 0.6, atol=1e-12)
    greedy = pair_acceptance(p=p, q=q, mode="greedy")
    assert set(np.unique(greedy)) <= {0.0, 1.0}
    np.testing.assert_array_equal(greedy, np.argmax(q, axis=1) == np.argmax(p, axis=1))
    with pytest.raises(ValueError, match="mode"):
        pair_acceptance(p=p, q=q, mode="beam")


# ---------------------------------------------------------------------------------- Monte-Carlo vs analytic


def test_monte_carlo_agrees_with_analytic_model(grid):
    c = grid.config.cost_ratio
    assert len(grid.cells) == 2 * 6 * 3
    for cell in grid.cells:
        k = cell.k
        assert within(cell.acceptance, cell.acceptance_analytic, cell.acceptance_se), cell
        assert within(cell.tau_mc, cell.tau_analytic, cell.tau_se), cell
        assert cell.tau_analytic == pytest.approx(expected_tokens_per_call(cell.acceptance_analytic, k))
        assert cell.speedup_analytic == pytest.approx(expected_speedup(cell.acceptance_analytic, k, c))
        assert cell.speedup_mc == pytest.approx(cell.tau_mc / (1 + k * c))  # v ≡ 1
        assert cell.tau_mc >= 1 and cell.tau_mc <= k + 1


def test_sampled_acceptance_is_the_agreement(grid):
    for cell in grid.cells:
        if cell.mode == "sampled":
            assert cell.acceptance_analytic == pytest.approx(cell.agreement, abs=1e-12)
            assert within(cell.acceptance, cell.agreement, cell.acceptance_se), cell


def test_greedy_acceptance_differs_from_alpha(grid):
    greedy = {(c.agreement, c.k): c.acceptance for c in grid.cells if c.mode == "greedy"}
    sampled = {(c.agreement, c.k): c.acceptance for c in grid.cells if c.mode == "sampled"}
    assert greedy[0.3, 8] < 0.05 < sampled[0.3, 8]  # argmax q off the target's support: nothing accepted
    assert greedy[0.8, 8] > 0.99 and sampled[0.8, 8] < 0.81  # argmax q = argmax p: everything accepted
    assert greedy[0.0, 1] == sampled[0.0, 1] == 0.0 and greedy[1.0, 1] == sampled[1.0, 1] == 1.0


def test_exact_cells_at_the_ends():
    # a = 1: q = p, every draft accepted; a = 0: q off p's support, none. Also exercises the sampler on
    # distributions with zero-probability tokens (a token of q-probability 0 must never be drafted).
    config = SimulationConfig(ks=(4,), agreements=(0.0, 1.0), rounds=1000, modes=("sampled",))
    by_agreement = {c.agreement: c for c in simulate(config).cells}
    assert by_agreement[1.0].tau_mc == 5 and by_agreement[1.0].acceptance == 1.0
    assert by_agreement[0.0].tau_mc == 1 and by_agreement[0.0].acceptance == 0.0


def test_verification_cost_curve_enters_the_speedup():
    curve = [1.0 + 0.1 * j for j in range(10)]  # v(k) = 1 + 0.1(k − 1), k = 1..10
    config = SimulationConfig(
        ks=(2, 6), agreements=(0.8,), modes=("sampled",), rounds=1000, verify_cost=curve
    )
    for cell in simulate(config).cells:
        assert cell.speedup_analytic == pytest.approx(expected_speedup(0.8, cell.k, 0.1, curve))
        assert cell.speedup_mc == pytest.approx(cell.tau_mc / (curve[cell.k] + 0.1 * cell.k))


def test_simulate_rounds_counts_every_round_in_chunks(monkeypatch):
    monkeypatch.setattr(
        sim, "_CHUNK_POSITIONS", 1000
    )  # 333 rounds of K = 3 per chunk: 31 chunks, last partial
    p, q = agreement_pairs(0.7, 8, 16, np.random.default_rng(2))
    rng = np.random.default_rng(3)
    hist, accepted = simulate_rounds(p=p, q=q, mode="sampled", k=3, rounds=10_001, rng=rng)
    assert hist.shape == (4,) and hist.sum() == 10_001
    assert accepted >= hist @ np.arange(4)  # at least the accepted prefixes
    rate = accepted / (3 * 10_001)
    assert abs(rate - 0.7) <= Z * math.sqrt(0.21 / (3 * 10_001))


def test_a_cell_of_1e5_rounds_is_fast():
    config = SimulationConfig(ks=(8,), agreements=(0.8,), modes=("sampled",), rounds=100_000)
    start = time.perf_counter()
    simulate(config)
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------------------------------------- seeding


def test_same_seed_same_results_different_seed_different():
    config = SimulationConfig(ks=(2, 5), agreements=(0.5, 0.9), rounds=5000, seed=11)
    first, again = simulate(config), simulate(dataclasses.replace(config))
    assert first.cells == again.cells
    other = simulate(dataclasses.replace(config, seed=12))
    assert [c.tau_mc for c in other.cells] != [c.tau_mc for c in first.cells]


def test_a_cell_does_not_depend_on_the_rest_of_the_grid():
    alone = simulate(SimulationConfig(ks=(4,), agreements=(0.8,), modes=("greedy",), rounds=3000)).cells[0]
    in_grid = simulate(SimulationConfig(ks=(1, 4), agreements=(0.5, 0.8), rounds=3000)).cells
    assert alone in in_grid


# ---------------------------------------------------------------------------------------- config and output


def test_config_normalizes_sequences():
    config = SimulationConfig(ks=[np.int64(2), 3], agreements=[np.float32(0.5)], modes=["greedy"])
    assert config.ks == (2, 3) and type(config.ks[0]) is int
    assert config.agreements == (0.5,) and config.modes == ("greedy",)
    with pytest.raises(AttributeError):
        config.seed = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "changes",
    [
        {"ks": ()},
        {"ks": (0,)},
        {"ks": (1.5,)},
        {"ks": (True,)},
        {"ks": "12"},
        {"agreements": (1.5,)},
        {"agreements": (-0.1,)},
        {"agreements": (math.nan,)},
        {"modes": ("beam",)},
        {"modes": ()},
        {"rounds": 1},
        {"rounds": 1e5},
        {"seed": -1},
        {"vocab_size": 1},
        {"pool_size": 0},
        {"concentration": 0.0},
        {"concentration": math.inf},
        {"cost_ratio": -0.1},
        {"verify_cost": [1.0, 1.1]},  # covers K ≤ 1, but ks go up to 8
        {"verify_cost": [1.5] * 10},  # v(1) must be 1
    ],
)
def test_bad_config_raises_one_line_value_error(changes):
    with pytest.raises(ValueError, match=r"^[^\n]+$"):
        SimulationConfig(**changes)


def test_to_dict_is_json_with_every_cell_field():
    config = SimulationConfig(ks=(2,), agreements=(0.5,), rounds=100, verify_cost=[1.0, 1.05, 1.1])
    data = json.loads(json.dumps(simulate(config).to_dict()))
    assert data["config"]["verify_cost"] == [1.0, 1.05, 1.1] and data["config"]["ks"] == [2]
    assert len(data["cells"]) == 2
    assert set(data["cells"][0]) >= {"mode", "agreement", "k", "acceptance", "tau_mc", "tau_analytic"}


@pytest.mark.parametrize(
    "mode, k, rounds, dims",
    [("sampled", 0, 10, 2), ("sampled", 2, 0, 2), ("beam", 2, 10, 2), ("greedy", 2, 10, 1)],
    ids=["k0", "no-rounds", "bad-mode", "not-a-pool"],
)
def test_simulate_rounds_validates(mode, k, rounds, dims):
    p, q = agreement_pairs(0.5, 8, 4, np.random.default_rng(0))
    if dims == 1:
        p, q = p[0], q[0]
    with pytest.raises(ValueError, match=r"^[^\n]+$"):
        simulate_rounds(p=p, q=q, mode=mode, k=k, rounds=rounds, rng=np.random.default_rng(0))

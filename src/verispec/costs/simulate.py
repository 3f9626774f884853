"""Monte-Carlo simulation of speculative rounds on toy draft/target pairs, checked against the analytic model.

The family of pairs (:func:`agreement_pairs`): over a vocabulary of V tokens, the target p is a random
distribution (Dirichlet) on the first half of the vocabulary, u a random distribution on the second half, and
the draft q = a·p + (1 − a)·u. Because u is zero wherever p is not:

    α = Σ_x min(p(x), q(x)) = Σ_{x in supp p} min(p(x), a·p(x)) = a,

so the *agreement* a is exactly the acceptance rate of every pair of the family.

A cell of the simulation, for one (mode, agreement a, K), plays ``rounds`` rounds. Each of the K drafted
positions of a round independently picks a pair (p, q) at random from a pool of ``pool_size`` pairs of the
family, then:

- *sampled* mode: draws x ~ q and accepts it with probability min(1, p(x) / q(x)) (the rejection rule of
  :func:`verispec.verify.chain.rejection_rule`). Every pair accepts with probability α = a.
- *greedy* mode: drafts x = argmax q and accepts it iff x = argmax p (first argmax, as
  :func:`verispec.verify.chain.greedy_rule`). The acceptance rate is the fraction β of pairs of the pool whose
  argmaxes agree, which differs from a: it is P(a·max p > (1 − a)·max u). As max p and max u have the same
  distribution, β rises steeply around a = 1/2 (with the defaults: β ≈ 0.03 at a = 0.35, 0.5 at a = 0.5,
  0.97 at a = 0.65, 1 from a ≈ 0.8): greedy acceptance only needs q's largest entry to be p's, whereas
  sampled acceptance loses all the mass 1 − a that q puts off p's support.

The number of tokens a round emits is the number of accepted positions before the first rejection, plus one
(the recovered or bonus token). Positions are independent with acceptance probability α (sampled) or β
(greedy), known exactly from the pool, so the Monte-Carlo τ and speedup estimate exactly the analytic
E[L](α or β) and :func:`verispec.costs.analytic.expected_speedup` of :mod:`verispec.costs.analytic`.

All randomness comes from ``np.random.Generator`` objects seeded from (seed, agreement) for the pool and from
(seed, mode, agreement, K) for the rounds: the same seed gives the same numbers, and a cell's numbers do not
depend on which other cells are simulated.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from verispec.costs.analytic import (
    CostModel,
    VerifyCost,
    acceptance_rate,
    expected_speedup,
    expected_tokens_per_call,
    speedup_from_tokens,
)
from verispec.errors import UsageError
from verispec.inputs import check_int

__all__ = [
    "MODES",
    "CellResult",
    "SimulationConfig",
    "SimulationResult",
    "agreement_pairs",
    "pair_acceptance",
    "simulate",
    "simulate_rounds",
]

MODES = ("sampled", "greedy")

_CHUNK_POSITIONS = 1 << 20  # drafted positions simulated at once: bounds memory for any number of rounds


def _tuple_of(name: str, values: object, kind: type, check: Callable[[Any], bool], requirement: str) -> tuple:
    """values (one value or an iterable) as a non-empty tuple of ``kind`` (bools refused), each satisfying
    ``check``; else UsageError."""
    items = tuple(values) if isinstance(values, Iterable) and not isinstance(values, str) else (values,)
    ok = bool(items) and all(isinstance(x, kind) and not isinstance(x, bool) and check(x) for x in items)
    if not ok:
        raise UsageError(f"{name} must be a non-empty sequence of {requirement}, got {values!r}")
    return items


@dataclass(frozen=True)
class SimulationConfig:
    """A grid of simulation cells and how to simulate them; validated on construction (one-line UsageError).

    ks: draft lengths K ≥ 1. agreements: agreement levels a ∈ [0, 1] (= α of every pair, see the module).
    modes: a subset of ("sampled", "greedy").
    cost_ratio, verify_cost: the cost of a round, as in :class:`verispec.costs.analytic.CostModel` (v ≡ 1
    if None). rounds: rounds per cell, ≥ 2 (for a standard error). seed: integer ≥ 0.
    vocab_size: V ≥ 2 (the target lives on the first V // 2 tokens).
    pool_size: pairs (p, q) per agreement level, ≥ 1.
    concentration: Dirichlet concentration > 0 of p and u (small: peaked distributions).
    cost: the validated :class:`verispec.costs.analytic.CostModel` of cost_ratio and verify_cost (derived).
    """

    ks: tuple[int, ...] = (1, 2, 4, 8)
    agreements: tuple[float, ...] = (0.5, 0.8, 0.95)
    modes: tuple[str, ...] = MODES
    cost_ratio: float = 0.1
    verify_cost: VerifyCost = None
    rounds: int = 100_000
    seed: int = 0
    vocab_size: int = 64
    pool_size: int = 1024
    concentration: float = 1.0
    cost: CostModel = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Validate; normalize the grids to tuples of int / float / str and build :attr:`cost`."""
        ks = _tuple_of("ks", self.ks, numbers.Integral, lambda k: k >= 1, "integers >= 1")
        agreements = _tuple_of(
            "agreements", self.agreements, numbers.Real, lambda a: 0 <= a <= 1, "numbers in [0, 1]"
        )
        modes = _tuple_of("modes", self.modes, str, lambda m: m in MODES, f"modes from {MODES}")
        object.__setattr__(self, "ks", tuple(int(k) for k in ks))
        object.__setattr__(self, "agreements", tuple(float(a) for a in agreements))
        object.__setattr__(self, "modes", modes)
        for name, low in (("rounds", 2), ("seed", 0), ("vocab_size", 2), ("pool_size", 1)):
            value = getattr(self, name)
            check_int(value, name, low, integral=True)
        c = self.concentration
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not 0 < c < math.inf:
            raise UsageError(f"concentration must be a finite number > 0, got {c!r}")
        cost = CostModel(self.cost_ratio, self.verify_cost)
        if cost.max_k is not None and max(self.ks) > cost.max_k:
            raise UsageError(f"verify_cost covers K <= {cost.max_k}, but ks go up to {max(self.ks)}")
        object.__setattr__(self, "cost", cost)


@dataclass(frozen=True)
class CellResult:
    """The outcome of one simulation cell; *_mc are Monte-Carlo estimates, *_se their standard errors.

    acceptance: the fraction of accepted positions among all rounds × K simulated positions.
    acceptance_analytic: the exact per-position acceptance probability of the pool (α = a for sampled, β for
    greedy). tau_*: tokens per target call. speedup_*: tau / (v(K+1) + K·c).
    """

    mode: str
    agreement: float
    k: int
    acceptance: float
    acceptance_se: float
    acceptance_analytic: float
    tau_mc: float
    tau_se: float
    tau_analytic: float
    speedup_mc: float
    speedup_analytic: float


@dataclass(frozen=True)
class SimulationResult:
    """All cells of a simulation, in (mode, agreement, K) order, with the config that produced them."""

    config: SimulationConfig
    cells: tuple[CellResult, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict: {"config": {...}, "cells": [{field: value}, ...]}. A callable
        verify_cost is given by its repr."""
        c = self.config
        v = c.cost.verify_cost
        config = {
            "ks": list(c.ks),
            "agreements": list(c.agreements),
            "modes": list(c.modes),
            "cost_ratio": c.cost.cost_ratio,
            "verify_cost": list(v) if isinstance(v, tuple) else (None if v is None else repr(v)),
            "rounds": c.rounds,
            "seed": c.seed,
            "vocab_size": c.vocab_size,
            "pool_size": c.pool_size,
            "concentration": c.concentration,
        }
        return {"config": config, "cells": [asdict(cell) for cell in self.cells]}


def agreement_pairs(
    agreement: float, vocab_size: int, pool_size: int, rng: np.random.Generator, concentration: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """``pool_size`` random pairs (p, q) of the family, each with acceptance rate exactly ``agreement``
    (see the module doc): p ~ Dirichlet(concentration) on tokens [0, V // 2),
    u ~ Dirichlet(concentration) on [V // 2, V),
    q = a·p + (1 − a)·u. Returns p, q: [pool_size, vocab_size] float64."""
    half = vocab_size // 2
    p = np.zeros((pool_size, vocab_size))
    u = np.zeros((pool_size, vocab_size))
    p[:, :half] = rng.dirichlet(np.full(half, concentration), size=pool_size)
    u[:, half:] = rng.dirichlet(np.full(vocab_size - half, concentration), size=pool_size)
    return p, agreement * p + (1.0 - agreement) * u


def _accept_sampled(p: np.ndarray, q: np.ndarray, pair: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Draft x ~ q[pair] and accept it with probability min(1, p(x) / q(x)).

    p, q: [M, V] pool of pairs. pair: [N] pair index of each position. Returns [N] bool.
    Inverse-CDF sampling in one searchsorted: row m's CDF is shifted by m so that all rows form one sorted
    array (resolution ~M·2⁻⁵², far below Monte-Carlo noise); an index past a row's last token of positive
    probability (only possible by rounding) is clamped back to it.
    """
    m, v = q.shape
    cdf = np.cumsum(q, axis=1)  # [M, V]
    cdf /= cdf[:, -1:]
    shifted = (cdf + np.arange(m)[:, None]).ravel()  # [M*V], non-decreasing
    last = v - 1 - np.argmax(q[:, ::-1] > 0, axis=1)  # [M] last token with q > 0
    x = np.searchsorted(shifted, rng.random(pair.size) + pair, side="right") - pair * v  # [N]
    x = np.minimum(x, last[pair])
    return rng.random(pair.size) * q[pair, x] < p[pair, x]


def pair_acceptance(*, p: np.ndarray, q: np.ndarray, mode: str) -> np.ndarray:
    """The exact probability that each pair of the pool accepts a drafted token in ``mode``.

    p, q: [M, V] pool of target and draft distributions. Returns [M] float64: Σ_x min(p, q) for "sampled",
    1.0 where argmax q = argmax p (first argmax) and 0.0 elsewhere for "greedy". UsageError unless p and q
    are pools of distributions of the same shape and mode is one of :data:`MODES`.
    """
    if mode not in MODES:
        raise UsageError(f"mode must be one of {MODES}, got {mode!r}")
    if np.ndim(p) != 2:
        raise UsageError(f"p and q must be pools of distributions of shape [M, V], got {np.shape(p)}")
    alpha = acceptance_rate(p=p, q=q)  # [M]; validates p and q
    assert isinstance(alpha, np.ndarray)  # one α per pair of the pool
    return alpha if mode == "sampled" else (np.argmax(q, axis=1) == np.argmax(p, axis=1)).astype(np.float64)


def simulate_rounds(
    *, p: np.ndarray, q: np.ndarray, mode: str, k: int, rounds: int, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """Play ``rounds`` rounds of K ≥ 1 drafted positions, each on a pair drawn uniformly from the pool.

    p, q: [M, V] pool of target and draft distributions. mode: "sampled" or "greedy".
    Returns (hist [K+1] int64: the number of rounds that accepted 0..K tokens, each emitting that + 1;
    accepted: the accepted positions among all rounds × K positions, including those after a round's first
    rejection, which a real round would not verify but which are independent draws here). Simulated in
    chunks, so memory does not grow with ``rounds``.
    """
    for name, value in (("k", k), ("rounds", rounds)):
        check_int(value, name, 1, integral=True)
    per_pair = pair_acceptance(p=p, q=q, mode=mode)  # [M]; validates p, q and mode
    greedy_accept = per_pair > 0.5 if mode == "greedy" else None  # [M] bool
    hist, accepted = np.zeros(k + 1, dtype=np.int64), 0
    chunk = max(1, _CHUNK_POSITIONS // k)
    for start in range(0, rounds, chunk):
        n = min(chunk, rounds - start)
        pair = rng.integers(q.shape[0], size=n * k)  # [n*K]
        accept = greedy_accept[pair] if greedy_accept is not None else _accept_sampled(p, q, pair, rng)
        accept = accept.reshape(n, k)
        hist += np.bincount(np.where(accept.all(axis=1), k, accept.argmin(axis=1)), minlength=k + 1)
        accepted += int(accept.sum())
    return hist, accepted


def _rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator that depends only on the seed and the keys."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=keys))


def _cell(config: SimulationConfig, mode: str, agreement: float, k: int) -> CellResult:
    """Simulate one (mode, agreement, K) cell and its analytic counterpart."""
    agreement_key = int(np.float64(agreement).view(np.uint64))  # the float's bits: an exact integer key
    pool_rng = _rng(config.seed, 0, agreement_key)
    p, q = agreement_pairs(agreement, config.vocab_size, config.pool_size, pool_rng, config.concentration)
    rate = float(np.mean(pair_acceptance(p=p, q=q, mode=mode)))
    rounds_rng = _rng(config.seed, 1, MODES.index(mode), k, agreement_key)
    hist, accepted = simulate_rounds(p=p, q=q, mode=mode, k=k, rounds=config.rounds, rng=rounds_rng)
    n, tokens = config.rounds, np.arange(1, k + 2)  # a round that accepted i tokens emits i + 1
    tau = float(hist @ tokens) / n
    tau_var = float(hist @ (tokens - tau) ** 2) / (n - 1)
    acceptance = accepted / (n * k)
    c, v = config.cost.cost_ratio, config.cost.verify_cost
    return CellResult(
        mode=mode,
        agreement=agreement,
        k=k,
        acceptance=acceptance,
        acceptance_se=math.sqrt(acceptance * (1 - acceptance) / (n * k)),
        acceptance_analytic=rate,
        tau_mc=tau,
        tau_se=math.sqrt(tau_var / n),
        tau_analytic=expected_tokens_per_call(rate, k),
        speedup_mc=speedup_from_tokens(tau, k, c, v),
        speedup_analytic=expected_speedup(rate, k, c, v),
    )


def simulate(config: SimulationConfig) -> SimulationResult:
    """Run every (mode, agreement, K) cell of ``config`` (see the module doc), in that nesting order."""
    cells = [_cell(config, mode, a, k) for mode in config.modes for a in config.agreements for k in config.ks]
    return SimulationResult(config=config, cells=tuple(cells))

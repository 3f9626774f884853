"""The calibrated costs corrected by the ratios :mod:`verispec.costs.online` estimates: what ``--k auto``
prices a round with.

The estimates map a kind of work (a :data:`Key`) to its ratio against a one-token forward timed beside it: a
forward of m new tokens r(m), of b ≥ 2 rows r_b, the drafter's proposal r_d, the rest of a round o. A forward
size not estimated takes the ratio of the sizes estimated nearest to it — the smaller of the two around it
(optimism: a size that then looks best is drafted, and so measured), the end one's beyond them, 1 (the prior's
shape) where none is —, a row count likewise, a drafter not seen 1 (the prior's c). The corrected costs are
in units of a one-token forward, as the prior's are in the calibrated one:

    v̂(m) = v(m) · r(m),   ĉ = c · r_d,   û = u · r_d,   V̂(b, n) = V(b, n) · r_b

A round also costs what is not a forward or a proposal: verifying, committing, streaming, the Python of the
step — about the same whatever K. Its ratio o makes every round dearer by the same amount, which favours
larger blocks: the costs are then counted in units of a whole plain round, 1 + o,

    ṽ(m) = (v̂(m) + o) / (1 + o),   c̃ = ĉ / (1 + o),   ũ = û / (1 + o),   Ṽ(b, n) = (V̂(b, n) + o) / (1 + o)

(a calibration times forwards alone, so its v(k) overstates what a bigger block costs a whole round).
A block never costs less than one token (v̂(m) ≥ 1; a measured curve may dip between sizes): a ratio can
still be off where the machine sped up between a block and the one-token forwards it was compared with, and
a block priced below one token is drafted every round, never timing a one-token forward again.
"""

from __future__ import annotations

import bisect

from verispec.costs.analytic import BatchCost, CostModel

__all__ = ["DRAFT", "ONE", "OVERHEAD", "Estimates", "Key", "correct", "correct_batch", "ratio"]

Key = tuple[str, int]  # ("forward", m), ("rows", b), ("draft", 0), ("overhead", 0)
ONE, DRAFT, OVERHEAD = ("forward", 1), ("draft", 0), ("overhead", 0)
Estimates = dict[Key, float]  # each kind's ratio to a one-token forward (ONE's not among them)
Seen = tuple[list[int], list[float]]  # a kind's sizes estimated, ascending, and their ratios


def correct(cost: CostModel, estimates: Estimates) -> CostModel:
    """``cost`` (the prior's, in calibrated steps) corrected by ``estimates``, in whole plain rounds; the
    prior itself where nothing is estimated."""
    if not estimates:
        return cost
    o, sizes = _units(estimates)
    draft = estimates.get(DRAFT, 1.0) / (1 + o)
    v = cost.verify_cost
    curve = (
        tuple(_round(max(x * _factor(sizes, m), 1.0), o) for m, x in enumerate(v, 1))
        if isinstance(v, tuple)
        else lambda k: _round(max(cost.verify(k) * _factor(sizes, k), 1.0), o)
    )
    return CostModel(
        cost.cost_ratio * draft, curve, cost.catch_up * draft, cost.fixed_cost * draft, cost.catch_up_limit
    )


def correct_batch(batch: BatchCost, estimates: Estimates) -> BatchCost:
    """A batch grid corrected likewise: b ≥ 2 rows by the ratio of the row counts estimated nearest, one row
    (and b rows before any was estimated) by the single-row ratio of its tokens per row."""
    if not estimates:
        return batch
    (o, sizes), rows = _units(estimates), _seen(estimates, "rows")
    grid = tuple(
        tuple(
            _round(cost * (_factor(rows, b) if b > 1 and rows[0] else _factor(sizes, m)), o)
            for m, cost in zip(batch.tokens, line, strict=True)
        )
        for b, line in zip(batch.rows, batch.cost, strict=True)
    )
    return BatchCost(batch.rows, batch.tokens, grid)


def ratio(estimates: Estimates, key: Key) -> float:
    """A forward kind's ratio in ``estimates``: its own, else the nearest sizes' or row counts'
    (:func:`_factor`; a single-row forward's among them size 1's, 1), 1 (the prior's) where none is."""
    seen = _seen(estimates, key[0])
    return _factor(_with_one(seen) if key[0] == "forward" else seen, key[1])


def _units(estimates: Estimates) -> tuple[float, Seen]:
    """o, the rest of a round in one-token forwards (0 before it was measured, as the calibration assumes),
    and the single-row forward sizes estimated (size 1 among them)."""
    return estimates.get(OVERHEAD, 0.0), _with_one(_seen(estimates, "forward"))


def _round(forward: float, o: float) -> float:
    """A round whose forward costs ``forward`` one-token forwards, in whole plain rounds."""
    return (forward + o) / (1 + o)


def _seen(estimates: Estimates, kind: str) -> Seen:
    """The sizes of ``kind`` estimated, ascending, and their ratios (one sort, read per size after)."""
    pairs = sorted((s, value) for (k, s), value in estimates.items() if k == kind)
    return [s for s, _ in pairs], [value for _, value in pairs]


def _with_one(seen: Seen) -> Seen:
    """``seen`` forward sizes with size 1 at ratio 1 (by definition) among them."""
    sizes, values = seen
    return ([1, *sizes], [1.0, *values]) if not sizes or sizes[0] != 1 else seen


def _factor(seen: Seen, size: int) -> float:
    """The ratio at ``size`` of a kind of work whose sizes ``seen`` are (:func:`_seen`): its own, else the
    smaller of the two sizes seen around it, else the end one's beyond them; 1 where none was seen."""
    sizes, values = seen
    if not sizes:
        return 1.0
    i = bisect.bisect_left(sizes, size)
    if i < len(sizes) and sizes[i] == size:
        return values[i]
    return min(values[j] for j in (i - 1, i) if 0 <= j < len(sizes))

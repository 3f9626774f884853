"""Costs measured as it runs: the calibration (:mod:`verispec.costs.calibrate`) is a prior, which the engine's
own timings of each round correct, so that ``--k auto`` follows the machine it runs on (a calibration made on
a busy machine or another CPU, a thermal change).

Each timing is a *slowdown* ρ: the seconds measured over the seconds the prior predicts for the same work at
the same context — a target forward of m new tokens in one row (ρ(m)), a forward over b ≥ 2 rows (ρ_b), a
drafter's proposal of K tokens after g positions it had not read (ρ_d: K·c + g·u, the calibration's split of
them kept). Each kind of work keeps its last :attr:`OnlineConfig.window` slowdowns and estimates its own by
their lower median once it has :attr:`OnlineConfig.min_seen` of them: a slow round (a preempted forward) is
the largest of its window and never the estimate. A slowdown expires after :attr:`OnlineConfig.horizon`
forwards: the policy stops drafting a size that looks dear, so without it a size measured only while the
machine warmed up (the first rounds here ran 2–4× slow) or was busy would keep its price for good. A forward
size not seen yet takes the slowdown of the sizes seen nearest to it — the smaller of the two around it
(optimism: a size that then looks best is drafted, and so measured), the end one's beyond them —, a row count
likewise, a drafter not seen that of a one-token forward: the prior's ratios, scaled by what has been
observed. The corrected costs are in units of the observed one-token forward, as the prior's are in the
calibrated one:

    v̂(m) = v(m) · ρ(m) / ρ(1),   ĉ = c · ρ_d / ρ(1),   û = u · ρ_d / ρ(1),   V̂(b, n) = V(b, n) · ρ_b / ρ(1)

A round also costs what is not a forward or a proposal: verifying, committing, streaming, the Python of the
step — about the same whatever K. The engine times it between one single-row forward and the next (the
proposal taken out); its lower median o (in observed one-token forwards, o = ρ_o / ρ(1)) makes every round
dearer by the same amount, which favours larger blocks: the costs are then counted in units of a whole plain
round, 1 + o,

    ṽ(m) = (v̂(m) + o) / (1 + o),   c̃ = ĉ / (1 + o),   ũ = û / (1 + o),   Ṽ(b, n) = (V̂(b, n) + o) / (1 + o)

(a calibration times forwards alone, so its v(k) overstates what a bigger block costs a whole round).
A calibration uniformly wrong in T(1) is corrected by the first drafting rounds' timings, a wrong shape of v
as the sizes are drafted. The estimates are published (:attr:`OnlineCosts.version` moves) only when one moves
by more than :attr:`OnlineConfig.tolerance` of what it costs a round (:meth:`OnlineCosts._moved`), so that the
K policy re-derives its round costs rarely: each re-derivation costs ~0.1 ms of Python right after a forward.
"""

from __future__ import annotations

import bisect
import statistics
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from verispec.costs.analytic import BatchCost, CostModel
from verispec.errors import UsageError
from verispec.inputs import check_int, is_int

__all__ = ["ForwardTiming", "OnlineConfig", "OnlineCosts", "RoundTiming"]


@dataclass(frozen=True)
class ForwardTiming:
    """One target forward of a step that scored draft rounds only (no prompt chunk, no tree): ``rows``
    sequences, ``tokens`` new tokens in all, ``seconds`` long, after ``context`` positions per row (their
    mean); ``overhead``: the seconds since the step before's forward ended that were neither a forward nor
    a proposal (None: that step was no such step). One object per forward, handed to every row's policy:
    an estimator counts it once."""

    rows: int
    tokens: int
    seconds: float
    context: int
    overhead: float | None = None


@dataclass(frozen=True)
class RoundTiming:
    """What one sequence's round cost: its share of the step's ``forward``, and its drafter's proposal of
    ``drafted`` tokens (the grammar's forced ones not counted) in ``draft_seconds``, after ``context``
    committed positions."""

    forward: ForwardTiming
    drafted: int
    draft_seconds: float
    context: int


@dataclass(frozen=True)
class OnlineConfig:
    """How :class:`OnlineCosts` weighs the timings; validated with UsageError.

    window: the last slowdowns each kind of work keeps. min_seen: how many it needs before its own estimate
    is used (2: a single slow round is never one). horizon: the forwards after which a slowdown no longer
    counts (a kind of work with none left is estimated like one never seen). tolerance: how far an estimate
    moves before it is published (relative to a forward's, in one-token forwards for the rest of a round's and
    the drafter's). notice: a one-token forward this many times slower or faster
    than calibrated is said in one line on stderr (once, after
    ``horizon`` forwards).
    """

    window: int = 8
    min_seen: int = 2
    horizon: int = 128
    tolerance: float = 0.05
    notice: float = 2.0

    def __post_init__(self) -> None:
        if not (is_int(self.window) and is_int(self.min_seen) and 1 <= self.min_seen <= self.window):
            raise UsageError(f"need 1 <= min_seen <= window, got {self.min_seen!r}, {self.window!r}")
        check_int(self.horizon, "horizon", 1)
        for name, low in (("tolerance", 0.0), ("notice", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and low <= value < 1e9):
                raise UsageError(f"{name} must be a number >= {low:g}, got {value!r}")


# (kind, size) → slowdown: ("forward", m), ("rows", b), ("draft", 0), ("overhead", 0)
Estimates = dict[tuple[str, int], float]


class OnlineCosts:
    """The slowdowns of this machine against a calibration, from the rounds' timings (see the module);
    shared by every ``--k auto`` policy made from one calibration, and safe to share between threads.

    step_seconds: the calibrated T(1) at a context, in seconds (:meth:`Calibration.step_seconds`); None: a
    prior in relative units only (every slowdown then in seconds per calibrated step, no notice).
    """

    def __init__(
        self, step_seconds: Callable[[int], float] | None = None, config: OnlineConfig | None = None
    ) -> None:
        self.config = config or OnlineConfig()
        self.step_seconds = step_seconds
        self._windows: dict[tuple[str, int], deque[tuple[int, float]]] = {}  # (forward number, slowdown)
        self._forwards = 0  # the forwards counted so far
        self._own: Estimates = {}  # each kind's lower median, where it has min_seen slowdowns
        self._changed: set[tuple[str, int]] = set()  # the kinds whose slowdowns changed since
        self._draft_steps = 1.0  # the prior's cost of the latest proposal timed, in calibrated steps
        self._published: Estimates = {}
        self._last: ForwardTiming | None = None  # the forward counted last (rows report it each)
        self._lock = threading.Lock()
        self._noticed = False
        self.version = 0  # moves whenever the published estimates do

    def observe(self, timing: RoundTiming, forward_steps: float, draft_steps: float) -> None:
        """A round's timing, and what the prior predicts for it in calibrated steps: its forward's
        ``forward_steps``, its proposal's ``draft_steps`` (0: nothing to learn from it)."""
        forward = timing.forward
        unit = self.step_seconds or (lambda context: 1.0)
        with self._lock:
            if forward is not self._last:
                self._last = forward
                self._forwards += 1
                self._expire()
                key = ("forward", forward.tokens) if forward.rows == 1 else ("rows", forward.rows)
                step = unit(forward.context)
                self._add(key, forward.seconds / (forward_steps * step))
                if forward.overhead is not None and forward.rows == 1:
                    self._add(("overhead", 0), max(forward.overhead, 0.0) / step)
            if timing.drafted and draft_steps > 0:
                self._add(("draft", 0), timing.draft_seconds / (draft_steps * unit(timing.context)))
                self._draft_steps = draft_steps
            self._publish()
            self._notice()

    def _add(self, key: tuple[str, int], slowdown: float) -> None:
        self._windows.setdefault(key, deque(maxlen=self.config.window)).append((self._forwards, slowdown))
        self._changed.add(key)

    def _expire(self) -> None:
        """Drops the slowdowns older than the horizon."""
        oldest = self._forwards - self.config.horizon
        for key, window in self._windows.items():
            while window and window[0][0] <= oldest:
                window.popleft()
                self._changed.add(key)

    def _publish(self) -> None:
        """Publish the estimates when one is new or moved by more than the tolerance: the lower median of a
        kind of work's unexpired slowdowns when it has min_seen of them, else of them and what the others give
        it (:func:`_fallback`; none before some kind has min_seen). Only the kinds whose slowdowns changed are
        estimated again."""
        if not self._changed:
            return
        seen = self.config.min_seen
        for key in self._changed:
            window = self._windows[key]
            if len(window) >= seen:
                self._own[key] = statistics.median_low([x for _, x in window])
            else:
                self._own.pop(key, None)
        self._changed.clear()
        estimates = dict(self._own)
        for key, window in self._windows.items():
            if window and key not in self._own:
                fallback = _fallback(self._own, key)
                if fallback is not None:
                    estimates[key] = statistics.median_low([*(x for _, x in window), fallback])
        old = self._published
        if estimates.keys() == old.keys():
            one = _step(old)  # ρ(1) as published: what the rest of a round and the drafter move against
            if not any(self._moved(key, old[key], x, one) for key, x in estimates.items()):
                return
        self._published = estimates
        self.version += 1

    def _moved(self, key: tuple[str, int], old: float, new: float, one: float | None) -> bool:
        """Whether a kind's estimate moved by more than the tolerance of what it costs a round: a forward
        size's relative to itself, the rest of a round's and the drafter's in one-token forwards (ρ(1) as
        published: ``one``; the drafter's over its latest proposal, K·c + g·u): a lookup that costs a few
        microseconds moves by half between rounds and changes no K."""
        tolerance, change = self.config.tolerance, abs(new - old)
        if key[0] in ("forward", "rows"):
            return change > tolerance * old
        weight = self._draft_steps if key[0] == "draft" else 1.0
        return change * weight > tolerance * (one or old)

    def _notice(self) -> None:
        """Say once, on stderr, that ρ(1) is off by more than the notice factor — not before a horizon of
        forwards was timed: a process's first rounds run slow while it warms up."""
        one = self.step
        if self._noticed or one is None or self.step_seconds is None:
            return
        if self._forwards < self.config.horizon:
            return
        if max(one, 1 / one) > self.config.notice:
            self._noticed = True
            print(
                f"verispec: forwards here take {one:.2g}× the calibrated time; --k auto corrects its "
                "costs as it runs (`verispec calibrate` measures them again)",
                file=sys.stderr,
            )

    @property
    def drafter_seen(self) -> bool:
        """Whether the drafter's slowdown is estimated (else its calibrated cost is taken as it is)."""
        return ("draft", 0) in self._published

    @property
    def step(self) -> float | None:
        """ρ(1), the published slowdown of a one-token forward (read off the sizes seen, else off the row
        counts seen); None before anything was seen."""
        return _step(self._published)

    def correct(self, cost: CostModel) -> CostModel:
        """``cost`` (the prior's, in calibrated steps) corrected by the published slowdowns, in observed
        steps; the prior itself before anything was seen."""
        estimates, one = self._published, self.step
        if one is None:
            return cost
        draft = estimates.get(("draft", 0), one) / one
        o = self.overhead  # in observed one-token forwards
        whole = 1 + o  # a plain round: its forward and the rest
        v, sizes = cost.verify_cost, _seen(estimates, "forward")
        curve = (
            tuple((x * _factor(sizes, m, one) + o) / whole for m, x in enumerate(v, 1))
            if isinstance(v, tuple)
            else lambda k: (cost.verify(k) * _factor(sizes, k, one) + o) / whole
        )
        return CostModel(
            cost.cost_ratio * draft / whole,
            curve,
            cost.catch_up * draft / whole,
            cost.fixed_cost * draft / whole,
        )

    @property
    def overhead(self) -> float:
        """o: what a round costs besides its forward and proposal, in observed one-token forwards (0 before
        it was measured, as the calibration assumes)."""
        estimates, one = self._published, self.step
        seen = estimates.get(("overhead", 0))
        return 0.0 if seen is None or one is None else seen / one

    def correct_batch(self, batch: BatchCost) -> BatchCost:
        """A batch grid corrected likewise: b ≥ 2 rows by the slowdown of the row counts seen nearest, one row
        (and b rows before any was seen) by the single-row slowdown of its tokens per row."""
        estimates, one = self._published, self.step
        if one is None:
            return batch
        rows, sizes, o = _seen(estimates, "rows"), _seen(estimates, "forward"), self.overhead
        whole = 1 + o  # a plain round: its forward and the rest
        grid = tuple(
            tuple(
                (cost * (_factor(rows, b, one) if b > 1 and rows[0] else _factor(sizes, m, one)) + o) / whole
                for m, cost in zip(batch.tokens, line, strict=True)
            )
            for b, line in zip(batch.rows, batch.cost, strict=True)
        )
        return BatchCost(batch.rows, batch.tokens, grid)


def _step(estimates: Estimates) -> float | None:
    """ρ(1) of ``estimates``: read off the forward sizes, else off the row counts; None: neither."""
    one = _nearest(estimates, "forward", 1)
    return _nearest(estimates, "rows", 1) if one is None else one


def _fallback(estimates: Estimates, key: tuple[str, int]) -> float | None:
    """What ``estimates`` say of a kind of work not estimated on its own: a forward size or row count the
    nearest ones of its kind (:func:`_nearest`), else, like the drafter, ρ(1)."""
    kind, size = key
    if kind == "overhead":  # its own or nothing: no forward says what the rest of a round costs
        return None
    nearest = None if kind == "draft" else _nearest(estimates, kind, size)
    return _step(estimates) if nearest is None else nearest


def _factor(seen: Seen, size: int, one: float) -> float:
    """The slowdown at ``size`` of a kind of work whose sizes ``seen`` are (:func:`_seen`), over ρ(1); 1
    where none was seen."""
    slowdown = _nearest_in(seen, size)
    return 1.0 if slowdown is None else slowdown / one


Seen = tuple[list[int], list[float]]  # a kind's sizes seen, ascending, and their estimates


def _seen(estimates: Estimates, kind: str) -> Seen:
    """The sizes of ``kind`` estimated, ascending, and their estimates (one sort, read per size after)."""
    pairs = sorted((s, value) for (k, s), value in estimates.items() if k == kind)
    return [s for s, _ in pairs], [value for _, value in pairs]


def _nearest(estimates: Estimates, kind: str, size: int) -> float | None:
    """The estimate of ``kind`` at ``size``: its own, else the smaller of the two sizes seen around it, else
    the end one's beyond them; None where no size of ``kind`` was seen."""
    return _nearest_in(_seen(estimates, kind), size)


def _nearest_in(seen: Seen, size: int) -> float | None:
    """:func:`_nearest` among ``seen`` (:func:`_seen`)."""
    sizes, values = seen
    if not sizes:
        return None
    i = bisect.bisect_left(sizes, size)
    if i < len(sizes) and sizes[i] == size:
        return values[i]
    return min(values[j] for j in (i - 1, i) if 0 <= j < len(sizes))

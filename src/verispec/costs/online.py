"""Costs measured as it runs: the calibration (:mod:`verispec.costs.calibrate`) is a prior, which the engine's
own timings of each round correct, so that ``--k auto`` follows the machine it runs on (a calibration made on
a busy machine or another CPU, a thermal change).

Each timing is a *slowdown* ρ: the seconds measured over the seconds the prior predicts for the same work at
the same context — a target forward of m new tokens in one row (ρ(m)), a forward over b ≥ 2 rows (ρ_b), a
drafter's proposal of K tokens after g positions it had not read (ρ_d: K·c + g·u, the calibration's split of
them kept), and the rest of a round — verifying, committing, streaming, the Python of the step, timed
between one single-row forward and the next, the proposal taken out (ρ_o).

What a policy needs is how dear each kind of work is *against a one-token forward*, and a machine's speed
moves while it runs: a process's first forwards here ran 1.5–2× slow and sped up over a few dozen more, a
neighbour's load comes and goes. A slowdown is therefore compared only with forwards timed beside it:

- a forward of m ≥ 2 tokens (or b ≥ 2 rows) with the one-token forwards within :attr:`OnlineConfig.pair`
  forwards of it, before or after (their lower median, where there are min_seen: one alone may have been
  preempted); one with fewer there, or that took less time than they did (the machine sped up between
  them), is not counted. (Compared with one-token forwards timed long before, as it was, a process drafting
  from its fourth round on priced every block against its warm-up forwards, 1.5× slow: a two-token forward
  looked cheaper than one token, so it kept drafting, and never timed a one-token forward again.)
- a proposal, and the rest of a round, with the forward of their own round: ρ_d / (ρ(m) / r(m)), m its size
  and r(m) its ratio as estimated — a preempted round slows both and leaves their ratio.

Each kind keeps its last :attr:`OnlineConfig.window` ratios and is estimated by their lower median once it
has :attr:`OnlineConfig.min_seen` of them: a slow round is the largest of its window and never the estimate.
A ratio expires after :attr:`OnlineConfig.horizon` forwards: the policy stops drafting a size that looks
dear, so without it a size measured only in a bad stretch would keep its price for good.

The policies price a round with the calibration's costs corrected by these ratios
(:mod:`verispec.costs.corrected`). A calibration uniformly wrong in T(1) changes no ratio; a wrong shape of v
is corrected as the sizes are drafted next to plain rounds. The estimates are published
(:attr:`OnlineCosts.version` moves) only when one moves by more than :attr:`OnlineConfig.tolerance` of what it
costs a round (:meth:`OnlineCosts._moved`), so that the K policy re-derives its round costs rarely: each
re-derivation costs ~0.1 ms of Python right after a forward. ρ(1) itself (:attr:`OnlineCosts.step`, the lower
median of the one-token forwards) only says whether the calibration's T(1) is off
(:meth:`OnlineCosts._notice`).
"""

from __future__ import annotations

import statistics
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from verispec.costs.analytic import BatchCost, CostModel
from verispec.costs.corrected import DRAFT, ONE, OVERHEAD, Estimates, Key, correct, correct_batch, ratio
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

    window: the last ratios each kind of work keeps. min_seen: how many it needs before its own estimate is
    used (2: a single slow round is never one). horizon: the forwards after which a ratio no longer counts (a
    kind of work with none left is estimated like one never seen). pair: how many forwards before or after a
    forward of another size the one-token forwards it is compared with may be timed. tolerance: how far an
    estimate moves before it is published (relative to a forward's, in one-token forwards for the rest of a
    round's and the drafter's). notice: a one-token forward this many times slower or faster than calibrated
    is said in one line on stderr (once, after ``horizon`` forwards).
    """

    window: int = 8
    min_seen: int = 2
    horizon: int = 128
    pair: int = 4
    tolerance: float = 0.05
    notice: float = 2.0

    def __post_init__(self) -> None:
        if not (is_int(self.window) and is_int(self.min_seen) and 1 <= self.min_seen <= self.window):
            raise UsageError(f"need 1 <= min_seen <= window, got {self.min_seen!r}, {self.window!r}")
        check_int(self.horizon, "horizon", 1)
        check_int(self.pair, "pair", 1)
        for name, low in (("tolerance", 0.0), ("notice", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and low <= value < 1e9):
                raise UsageError(f"{name} must be a number >= {low:g}, got {value!r}")


class OnlineCosts:
    """The costs of this machine's work against a one-token forward timed beside it, from the rounds'
    timings (see the module); shared by every ``--k auto`` policy made from one calibration, and safe to share
    between threads.

    step_seconds: the calibrated T(1) at a context, in seconds (:meth:`Calibration.step_seconds`); None: a
    prior in relative units only (every slowdown then in seconds per calibrated step, no notice).
    """

    def __init__(
        self, step_seconds: Callable[[int], float] | None = None, config: OnlineConfig | None = None
    ) -> None:
        self.config = config or OnlineConfig()
        self.step_seconds = step_seconds
        # (forward number, value): ONE's slowdowns, every other kind's ratios to a one-token forward
        self._windows: dict[Key, deque[tuple[int, float]]] = {}
        self._forwards = 0  # the forwards counted so far
        self._own: Estimates = {}  # each kind's lower median, where it has min_seen values (not ONE)
        self._step: float | None = None  # ONE's: the lower median of its slowdowns, ρ(1)
        self._changed: set[Key] = set()  # the kinds whose values changed since
        self._draft_steps = 1.0  # the prior's cost of the latest proposal timed, in calibrated steps
        self._published: Estimates = {}  # every kind's ratio to a one-token forward (not ONE)
        self._speed: float | None = None  # the latest forward's slowdown over its ratio: ρ(1) then
        self._last: ForwardTiming | None = None  # the forward counted last (rows report it each)
        # (forward number, key, slowdown, prior's steps): forwards waiting for one-token ones to compare with
        self._waiting: deque[tuple[int, Key, float, float]] = deque()
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
                slowdown = forward.seconds / (forward_steps * step)
                self._speed = self._forward(key, slowdown, forward_steps)  # ρ(1) now
                if forward.overhead is not None and forward.rows == 1 and self._speed:
                    self._add(OVERHEAD, max(forward.overhead, 0.0) / step / self._speed)
            if timing.drafted and draft_steps > 0 and self._speed:
                slowdown = timing.draft_seconds / (draft_steps * unit(timing.context))
                self._add(DRAFT, slowdown / self._speed)
                self._draft_steps = draft_steps
            self._publish()
            self._notice()

    def _forward(self, key: Key, slowdown: float, steps: float) -> float | None:
        """Counts a forward's slowdown (``steps``: what the prior predicts for it): ONE's as it is, then the
        forwards waiting for one-token ones (:meth:`_compare`); another kind's compared with the one-token
        forwards before it, else kept waiting for those after it. Returns ρ(1) now: the one-token forwards',
        else as this forward and its kind's ratio say (None: not known yet)."""
        latest = self._forwards - self.config.pair
        while self._waiting and self._waiting[0][0] < latest:
            self._waiting.popleft()  # none came within `pair` forwards: not compared
        if key == ONE:
            self._add(ONE, slowdown)
            self._waiting = deque(w for w in self._waiting if self._compare(*w) is None)
            return slowdown
        one = self._compare(self._forwards, key, slowdown, steps)
        if one is not None:
            return one
        self._waiting.append((self._forwards, key, slowdown, steps))
        factor = ratio(self._published, key)
        return slowdown / factor if factor > 0 else None

    def _compare(self, at: int, key: Key, slowdown: float, steps: float) -> float | None:
        """Compares the forward timed at forward number ``at`` (``steps``: the prior's cost of it) with the
        one-token forwards within :attr:`OnlineConfig.pair` forwards of it (their lower median ρ₁, where there
        are min_seen: one alone may be a preempted one): its ratio to them is counted unless it took less
        time than they did (the machine sped up between them). Returns ρ₁ (None: too few to compare with)."""
        near = [x for n, x in self._windows.get(ONE, ()) if abs(n - at) <= self.config.pair]
        if len(near) < self.config.min_seen:
            return None
        one = statistics.median_low(near)
        if slowdown * steps >= one:
            self._add(key, slowdown / one, at)
        return one

    def _add(self, key: Key, value: float, at: int | None = None) -> None:
        """Counts ``value`` for ``key``, timed at forward number ``at`` (None: the latest)."""
        at = self._forwards if at is None else at
        self._windows.setdefault(key, deque(maxlen=self.config.window)).append((at, value))
        self._changed.add(key)

    def _expire(self) -> None:
        """Drops the values older than the horizon. A window stays in forward order, so they lie at its left:
        a forward compared with one-token forwards after it joins its window late, at its own number, but
        before any later one of its kind (those waiting are compared in their order, and a later one compared
        at once had its one-token forwards within reach of the waiting one's too)."""
        oldest = self._forwards - self.config.horizon
        for key, window in self._windows.items():
            while window and window[0][0] <= oldest:
                window.popleft()
                self._changed.add(key)

    def _publish(self) -> None:
        """Publish the estimates when one is new, gone or moved by more than the tolerance: the lower median
        of a kind of work's unexpired values when it has min_seen of them. Only the kinds whose values changed
        are estimated again."""
        if not self._changed:
            return
        for key in self._changed:
            window = self._windows[key]
            value = (
                statistics.median_low([x for _, x in window]) if len(window) >= self.config.min_seen else None
            )
            if key == ONE:  # ρ(1): what the others were compared with, not a cost of its own
                self._step = value
            elif value is None:
                self._own.pop(key, None)
            else:
                self._own[key] = value
        self._changed.clear()
        estimates = dict(self._own)
        for key, window in self._windows.items():  # seen, not min_seen times: with what the others say
            if window and key not in self._own and key not in (ONE, OVERHEAD):
                other = 1.0 if key == DRAFT else ratio(self._own, key)
                estimates[key] = statistics.median_low([*(x for _, x in window), other])
        old = self._published
        if estimates.keys() == old.keys() and not any(
            self._moved(k, old[k], x) for k, x in estimates.items()
        ):
            return
        self._published = estimates
        self.version += 1

    def _moved(self, key: Key, old: float, new: float) -> bool:
        """Whether a kind's estimate moved by more than the tolerance of what it costs a round: a forward
        size's relative to itself, the rest of a round's and the drafter's in one-token forwards (the
        drafter's over its latest proposal, K·c + g·u): a lookup that costs a few microseconds moves by half
        between rounds and changes no K."""
        tolerance, change = self.config.tolerance, abs(new - old)
        if key[0] in ("forward", "rows"):
            return change > tolerance * old
        return change * (self._draft_steps if key == DRAFT else 1.0) > tolerance

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
        """Whether the drafter's ratio is estimated (else its calibrated cost is taken as it is)."""
        return DRAFT in self._published

    @property
    def step(self) -> float | None:
        """ρ(1): the lower median of the one-token forwards' slowdowns; None before min_seen were timed."""
        return self._step

    @property
    def overhead(self) -> float:
        """o: what a round costs besides its forward and proposal, in one-token forwards (0 before it was
        measured, as the calibration assumes)."""
        return self._published.get(OVERHEAD, 0.0)

    def correct(self, cost: CostModel) -> CostModel:
        """``cost`` (the prior's, in calibrated steps) corrected by the published ratios
        (:func:`verispec.costs.corrected.correct`): the prior itself before anything was estimated."""
        return correct(cost, self._published)

    def correct_batch(self, batch: BatchCost) -> BatchCost:
        """A batch grid corrected likewise (:func:`verispec.costs.corrected.correct_batch`)."""
        return correct_batch(batch, self._published)

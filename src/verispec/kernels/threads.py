"""How many threads the native kernels use: torch's count, or one where sharing the cores makes more slower.

Every parallel loop of the kernels splits its work between its threads and waits for the last of them. On a
machine where another process keeps a core busy, the thread sharing that core runs only in the scheduler's
time slices, and every one of a forward's ~200 loops waits for it: measured here on 2 cores with one busy
loop beside it, SmolLM2 decoded 40 tokens/s on 2 threads and 134 on 1 (153 on 2 when idle). So the kernels
measure themselves as they run: now and then the other thread count runs ``PROBE`` forwards, and whichever
took less time for forwards of the same token count is kept (by a margin: a switch must pay). Probes that
change nothing come less and less often (every 64 forwards, then 128, ... up to every 1024), and a probe
forward far slower than the current count's ends its probe at once, so that a steady machine, idle or busy,
pays almost nothing for them: an idle one keeps torch's count, a busy one moves to one thread after its first
probe and back once the cores free up (within the probe period then reached). Outputs never depend on the
choice: every kernel computes each output the same way on any number of threads (tested).

The choice is torch's too: while one thread is kept, torch's own operations in the thread that runs the
forwards (sampling and verification over the vocabulary, a head's layers) run on one thread as well, since
they wait on a descheduled thread just as the kernels' loops do: beside the test suite's two workers, a
softmax over 4 × 49,152 logits took 1.16 ms on torch's two threads and 0.12 ms on one (2026-12-07, AMD
EPYC). Torch's count is given back when two threads are chosen again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["ProbeSchedule", "ThreadChoice", "THREADS"]


class ProbeSchedule:
    """When something that runs one of two ways tries the other: a probe of ``length`` events (forwards,
    rounds) starts at event ``first``, the next one ``period`` events after a probe's start; each probe that
    changes nothing doubles that distance, up to ``max_period`` (a steady machine pays for probes less and
    less), and a switch sets it back to ``period``. The caller times both ways and decides; this only says
    when. Shared by the kernels' thread count (:class:`ThreadChoice`) and the token-tree gate
    (:class:`verispec.costs.policies.TreeGate`)."""

    def __init__(self, first: int, period: int, max_period: int, length: int) -> None:
        self.period, self.max_period, self.length = period, max_period, length
        self.gap = period  # from this probe's start to the next one's
        self.events = 0  # events recorded
        self.next_start = first  # the event the next probe starts at
        self.left = 0  # events left in the running probe (0: none runs)
        self.start = 0  # the event the latest probe started at

    def starting(self) -> bool:
        """Whether the next event starts a probe."""
        return self.left == 0 and self.events == self.next_start

    def probing(self) -> bool:
        """Whether the next event is a probe's."""
        return self.left > 0 or self.events == self.next_start

    def advance(self, cut: bool = False) -> bool:
        """One event recorded (``cut``: a probe's, which ends its probe at once); True when it ended a probe,
        to be followed by :meth:`settle`."""
        probing = self.probing()
        if self.starting():
            self.left, self.start = self.length, self.events
        self.events += 1
        if not probing:
            return False
        self.left = 0 if cut else self.left - 1
        return self.left == 0

    def settle(self, switched: bool) -> None:
        """A probe ended, and the caller switched to the other way or did not: the next probe's start."""
        if switched:
            self.gap = self.period
        self.next_start = self.start + self.gap
        if not switched:  # the one after it further away
            self.gap = min(2 * self.gap, self.max_period)


class ThreadChoice:
    """The thread count of the next native call (:meth:`count`) and what forwards took (:meth:`record`).

    A probe runs PROBE forwards on the other count, then keeps whichever count took less time (by MARGIN)
    for every token count both have run. Probes are scheduled by a :class:`ProbeSchedule`: the first starts
    after FIRST − PROBE forwards, the next PERIOD forwards after it, then up to MAX_PERIOD apart. A probe
    forward that takes ABORT times the current count's mean for its token count ends the probe at once: on a
    busy machine a probe on the contended count costs one slow forward, not PROBE."""

    FIRST = 8
    PERIOD = 64  # forwards from one probe's start to the next one's, after a switch
    MAX_PERIOD = 1024  # the longest, after probes that changed nothing
    PROBE = 4  # forwards a probe runs on the other count
    KEPT = 16  # the latest forwards of one count and token count whose mean time is compared
    MARGIN = 0.85  # the other count is kept when it takes at most this share of the current one's time
    ABORT = 2.0  # a probe forward this many times the current count's mean time ends the probe

    def __init__(self) -> None:
        self.single = False  # whether one thread is the current choice
        self.most = 1  # while single: torch's thread count before it was set to one
        self.seconds: dict[tuple[bool, int], list[float]] = {}  # (one thread, tokens) → the latest times
        self.holds = 0  # held(): no probe, nothing recorded
        self.schedule = ProbeSchedule(self.FIRST - self.PROBE, self.PERIOD, self.MAX_PERIOD, self.PROBE)

    @contextmanager
    def held(self) -> Iterator[None]:
        """The current choice throughout, no probe and nothing recorded: for timings that compare forwards
        (calibration, benchmarks), which a probe's forward would skew."""
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1

    def _most(self) -> int:
        """The most threads: torch's count (while one thread is the choice, the count it had before)."""
        return self.most if self.single else torch.get_num_threads()

    def count(self) -> int:
        """Threads for the next call: torch's count (the most), or 1."""
        most = self._most()
        probing = not self.holds and self.schedule.probing()
        return 1 if most <= 1 or self.single != probing else most

    def record(self, tokens: int, seconds: float) -> None:
        """A native forward of ``tokens`` tokens took ``seconds`` on :meth:`count` threads."""
        if self._most() <= 1 or self.holds:
            return
        if self.schedule.starting():  # the other count's times afresh
            self.seconds = {key: times for key, times in self.seconds.items() if key[0] == self.single}
        probing = self.schedule.probing()
        key = (self.single != probing, tokens)
        self.seconds[key] = [*self.seconds.get(key, [])[1 - self.KEPT :], seconds]
        current = self.seconds.get((self.single, tokens))
        slow = probing and current is not None and seconds > self.ABORT * sum(current) / len(current)
        if self.schedule.advance(cut=slow):  # a far slower probe forward ends the probe, changing nothing
            self._decide()

    def _decide(self) -> None:
        """A probe ended: keep the count that took less time, and schedule the next probe."""
        other = not self.single
        mean = {key: sum(times) / len(times) for key, times in self.seconds.items()}
        compared = [
            (s, mean[(self.single, n)]) for (o, n), s in mean.items() if o == other and (not o, n) in mean
        ]
        switch = bool(compared) and all(probe < self.MARGIN * current for probe, current in compared)
        if switch:  # torch's own operations follow (module docstring)
            if other:
                self.most = torch.get_num_threads()
            torch.set_num_threads(1 if other else self.most)
            self.single = other
        self.schedule.settle(switch)


THREADS = ThreadChoice()
"""The process's choice, shared by every native model and product."""

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

__all__ = ["ThreadChoice", "THREADS"]


class ThreadChoice:
    """The thread count of the next native call (:meth:`count`) and what forwards took (:meth:`record`).

    A probe runs PROBE forwards on the other count, then keeps whichever count took less time (by MARGIN)
    for every token count both have run. The first probe starts after FIRST − PROBE forwards, the next one
    PERIOD forwards after it; each probe that changes nothing doubles the distance to the one after it, up
    to MAX_PERIOD (a steady machine pays for probes less and less), and a switch sets it back to PERIOD. A
    probe forward that takes ABORT times the current count's mean for its token count ends the probe at
    once: on a busy machine a probe on the contended count costs one slow forward, not PROBE."""

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
        self.calls = 0  # forwards recorded
        self.seconds: dict[tuple[bool, int], list[float]] = {}  # (one thread, tokens) → the latest times
        self.holds = 0  # held(): no probe, nothing recorded
        self.period = self.PERIOD
        self.next_probe = self.FIRST - self.PROBE  # the call a probe starts at
        self.probe_left = 0  # forwards left in the running probe (0: none runs)
        self.probe_start = 0  # the call the latest probe started at

    @contextmanager
    def held(self) -> Iterator[None]:
        """The current choice throughout, no probe and nothing recorded: for timings that compare forwards
        (calibration, benchmarks), which a probe's forward would skew."""
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1

    def _probing(self) -> bool:
        return not self.holds and (self.probe_left > 0 or self.calls == self.next_probe)

    def _most(self) -> int:
        """The most threads: torch's count (while one thread is the choice, the count it had before)."""
        return self.most if self.single else torch.get_num_threads()

    def count(self) -> int:
        """Threads for the next call: torch's count (the most), or 1."""
        most = self._most()
        return 1 if most <= 1 or self.single != self._probing() else most

    def record(self, tokens: int, seconds: float) -> None:
        """A native forward of ``tokens`` tokens took ``seconds`` on :meth:`count` threads."""
        if self._most() <= 1 or self.holds:
            return
        if self.calls == self.next_probe:  # a probe starts: the other count's times afresh
            self.seconds = {key: times for key, times in self.seconds.items() if key[0] == self.single}
            self.probe_left, self.probe_start = self.PROBE, self.calls
        probing = self.probe_left > 0
        key = (self.single != probing, tokens)
        self.seconds[key] = [*self.seconds.get(key, [])[1 - self.KEPT :], seconds]
        self.calls += 1
        if not probing:
            return
        current = self.seconds.get((self.single, tokens))
        self.probe_left -= 1
        if current and seconds > self.ABORT * sum(current) / len(current):
            self.probe_left = 0  # far slower: the probe ends here, changing nothing
        if self.probe_left == 0:
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
        self.period = self.PERIOD if switch else self.period
        self.next_probe = self.probe_start + self.period
        self.period = self.period if switch else min(2 * self.period, self.MAX_PERIOD)


THREADS = ThreadChoice()
"""The process's choice, shared by every native model and product."""

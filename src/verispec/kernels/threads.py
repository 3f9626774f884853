"""How many threads the native kernels use: torch's count, or one where sharing the cores makes more slower.

Every parallel loop of the kernels splits its work between its threads and waits for the last of them. On a
machine where another process keeps a core busy, the thread sharing that core runs only in the scheduler's
time slices, and every one of a forward's ~200 loops waits for it: measured here on 2 cores with one busy
loop beside it, SmolLM2 decoded 40 tokens/s on 2 threads and 134 on 1 (153 on 2 when idle). So the kernels
measure themselves as they run: every ``PERIOD`` native forwards, the other thread count runs ``PROBE``
forwards, and whichever took less time for forwards of the same token count is kept (by a margin: a switch
must pay). An idle machine keeps torch's count, paying PROBE / PERIOD forwards at one thread; a busy one
moves to one thread within PERIOD forwards and back once the cores free up. Outputs never depend on the
choice: every kernel computes each output the same way on any number of threads (tested).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["ThreadChoice", "THREADS"]


class ThreadChoice:
    """The thread count of the next native call (:meth:`count`) and what forwards took (:meth:`record`)."""

    PERIOD = 64  # forwards between the starts of two probes (the first one after FIRST)
    FIRST = 16
    PROBE = 4  # forwards a probe runs on the other count
    KEPT = 16  # the latest forwards of one count and token count whose mean time is compared
    MARGIN = 0.85  # the other count is kept when it takes at most this share of the current one's time

    def __init__(self) -> None:
        self.single = False  # whether one thread is the current choice
        self.calls = 0
        self.seconds: dict[tuple[bool, int], list[float]] = {}  # (one thread, tokens) → the latest times
        self.holds = 0  # held(): no probe, nothing recorded

    @contextmanager
    def held(self) -> Iterator[None]:
        """The current choice throughout, no probe and nothing recorded: for timings that compare forwards
        (calibration, benchmarks), which a probe's forward would skew."""
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1

    def _phase(self) -> int:
        """Where the next forward falls in its period: probes take the last PROBE places."""
        return self.calls + self.PERIOD - self.FIRST if self.calls < self.FIRST else self.calls - self.FIRST

    def _probing(self) -> bool:
        return not self.holds and self._phase() % self.PERIOD >= self.PERIOD - self.PROBE

    def count(self) -> int:
        """Threads for the next call: torch's count (the most), or 1."""
        most = torch.get_num_threads()
        return 1 if most <= 1 or self.single != self._probing() else most

    def record(self, tokens: int, seconds: float) -> None:
        """A native forward of ``tokens`` tokens took ``seconds`` on :meth:`count` threads."""
        if torch.get_num_threads() <= 1 or self.holds:
            return
        single = self.single != self._probing()
        if self._phase() % self.PERIOD == self.PERIOD - self.PROBE:  # a probe starts: its own times afresh
            self.seconds = {key: times for key, times in self.seconds.items() if key[0] == self.single}
        self.seconds[(single, tokens)] = [*self.seconds.get((single, tokens), [])[1 - self.KEPT :], seconds]
        self.calls += 1
        if self._phase() % self.PERIOD == 0:  # a probe ended: keep the count that took less time
            other = not self.single
            mean = {key: sum(times) / len(times) for key, times in self.seconds.items()}
            compared = [
                (s, mean[(self.single, n)]) for (o, n), s in mean.items() if o == other and (not o, n) in mean
            ]
            if compared and all(probe < self.MARGIN * current for probe, current in compared):
                self.single = other


THREADS = ThreadChoice()
"""The process's choice, shared by every native model and product."""

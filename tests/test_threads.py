"""The kernels' thread count (:mod:`verispec.kernels.threads`) on made-up timings: torch's count while it is
the faster, one thread once a probe finds one faster by the margin (a busy machine; torch's own count then one
too), back when the cores free up; probes where they belong; nothing to choose on one thread. (Outputs never
depend on the count: the kernels' tests check every product and forward on other thread counts.)"""

from __future__ import annotations

import pytest
import torch

from verispec.kernels.threads import ProbeSchedule, ThreadChoice


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def run(choice: ThreadChoice, calls: int, seconds: dict[int, float], tokens: int = 1) -> list[int]:
    """``calls`` forwards of ``tokens`` tokens taking seconds[threads]; the thread counts they ran on."""
    counts = []
    for _ in range(calls):
        count = choice.count()
        counts.append(count)
        choice.record(tokens, seconds[count])
    return counts


def probes(counts: list[int], other: int) -> list[int]:
    """The calls that ran on ``other`` threads."""
    return [i for i, count in enumerate(counts) if count == other]


def test_an_idle_machine_keeps_torchs_count_probing_ever_less_often(two_threads):
    """Probes that change nothing: the first after 4 forwards, then 64, 128, 256, ... forwards apart, at
    most 1024."""
    choice = ThreadChoice()
    counts = run(choice, 4 + 64 + 128 + 256 + 512 + 1024 + 1024 + 8, {2: 0.003, 1: 0.004})
    starts = [4, 68, 196, 452, 964, 1988, 3012]
    assert probes(counts, 1) == [s + i for s in starts for i in range(4)]
    assert not choice.single and choice.count() == 2


def test_a_busy_machine_moves_to_one_thread_after_the_first_probe_and_back_when_it_pays(two_threads):
    choice = ThreadChoice()
    counts = run(choice, 16, {2: 0.010, 1: 0.004})
    assert counts[-4:] == [1, 1, 1, 1] and choice.single and choice.count() == 1  # calls 4-7: switched
    assert torch.get_num_threads() == 1  # torch's own operations on one thread too
    counts = run(choice, 192, {2: 0.010, 1: 0.004})  # calls 16-207
    # probes at calls 68 (64 after the switching one) and 132: each ended by its first forward (2.5× slower)
    assert probes(counts, 2) == [68 - 16, 132 - 16] and choice.single
    counts = run(choice, 256, {2: 0.0035, 1: 0.004})  # calls 208-463: two threads faster, not by the margin
    assert probes(counts, 2) == [260 - 208 + i for i in range(4)] and choice.single  # 128 after call 132
    counts = run(choice, 128, {2: 0.002, 1: 0.004})  # calls 464-591
    assert counts[:52] == [1] * 52 and counts[52:56] == [2] * 4  # a probe 256 after call 260: switched back
    assert not choice.single and choice.count() == 2 and torch.get_num_threads() == 2  # torch's count back


def test_a_slow_probe_forward_ends_its_probe(two_threads):
    """A probe forward taking more than ABORT times the current count's mean ends the probe: one forward,
    not PROBE, on the contended count."""
    choice = ThreadChoice()
    counts = run(choice, 5, {2: 0.003, 1: 0.0061})
    assert counts[4] == 1 and choice.schedule.left == 0 and not choice.single
    choice = ThreadChoice()
    counts = run(choice, 5, {2: 0.003, 1: 0.0059})  # below ABORT times: the probe goes on
    assert counts[4] == 1 and choice.schedule.left == 3


def test_every_token_count_compared_must_favour_the_switch(two_threads):
    """Forwards of different token counts are compared each with its own kind (decode with decode)."""
    choice = ThreadChoice()
    for _ in range(16):
        count = choice.count()
        tokens = 1 if choice.schedule.events % 2 else 5
        choice.record(tokens, {(2, 1): 0.010, (1, 1): 0.004, (2, 5): 0.010, (1, 5): 0.012}[(count, tokens)])
    assert not choice.single  # one thread faster for 1 token, slower for 5: no switch


def test_one_thread_has_nothing_to_choose():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        choice = ThreadChoice()
        assert run(choice, 100, {1: 0.01}) == [1] * 100 and choice.schedule.events == 0
    finally:
        torch.set_num_threads(before)


def test_held_keeps_the_choice_without_probes_or_records(two_threads):
    """Timings that compare forwards (calibration, benchmarks) run on the current choice throughout."""
    choice = ThreadChoice()
    with choice.held():
        assert run(choice, 100, {2: 0.010, 1: 0.001}) == [2] * 100
    assert choice.schedule.events == 0 and not choice.seconds and not choice.single


def probe_events(
    schedule: ProbeSchedule, events: int, switch_at: tuple = (), cut_at: tuple = ()
) -> list[int]:
    """``events`` events through ``schedule``; the ones that were a probe's. A probe ending at an event of
    ``switch_at`` switches; an event of ``cut_at`` that is a probe's ends its probe."""
    seen = []
    for e in range(events):
        if schedule.probing():
            seen.append(e)
        if schedule.advance(cut=e in cut_at):
            schedule.settle(e in switch_at)
    return seen


def test_the_probe_schedule_doubles_its_distance_until_a_switch_and_a_cut_ends_a_probe():
    seen = probe_events(ProbeSchedule(first=2, period=8, max_period=32, length=2), 120, switch_at=(59,))
    # probes at 2, 10 (8 after 2), 26 (16), 58 (32 at most; a switch: back to 8), 66, 74 (8), 90 (16)
    assert seen == [e + i for e in (2, 10, 26, 58, 66, 74, 90) for i in range(2)]
    seen = probe_events(ProbeSchedule(first=2, period=8, max_period=32, length=3), 12, cut_at=(2,))
    assert seen == [2, 10, 11]  # the first probe cut by its first event; the next one 8 after its start

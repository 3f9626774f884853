"""Calibration: what is measured, how it is keyed and cached, reuse, recovery from a corrupt cache, and
``--k auto`` built on it (stories260K: a calibration takes milliseconds)."""

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch

from verispec.api import Speculator
from verispec.cli import main
from verispec.costs import calibrate as calibration_module
from verispec.costs.calibrate import (
    BATCH_ROWS,
    DRAFT_K,
    K_MAX,
    ROW_TOKENS,
    Calibration,
    DraftCosts,
    TargetCosts,
    calibrate,
    calibration_dir,
)
from verispec.costs.policies import ConstantK, CostModelK
from verispec.drafting.base import Allowed, Proposal
from verispec.drafting.ngram import NGramDrafter
from verispec.engine.sequence import GenerationStats
from verispec.grammar.constraint import Constraint
from verispec.models.identity import model_identity
from verispec.models.llama import Llama
from verispec.models.llama_config import LlamaConfig
from verispec.models.registry import load_model
from verispec.options import GenerationOptions, SamplingParams


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Each test gets its own cache, and one torch thread (tiny tensors; steadier timings), a process that
    has not yet said that it probes, and a machine never quiet enough to time a drifted measurement again
    but where a test says so (this one's load would decide it)."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration_module._Announced, "said", False)
    monkeypatch.setattr(calibration_module, "quiet", lambda: False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


@pytest.fixture
def measured(monkeypatch):
    """Counts the target and drafter measurements: {"target": n, "draft": n}."""
    counts = {"target": 0, "draft": 0}
    for kind, name in (("target", "_measure_target"), ("draft", "_measure_drafter")):
        original = getattr(calibration_module, name)

        def counted(*args, _original=original, _kind=kind):
            counts[_kind] += 1
            return _original(*args)

        monkeypatch.setattr(calibration_module, name, counted)
    return counts


def test_measures_a_curve_and_a_cost_ratio(stories):
    model, tokenizer = stories
    calibration = calibrate(model, NGramDrafter(), target_label="stories", repetitions=3)
    v = calibration.target.verify_cost
    assert len(v) == K_MAX and v[0] == 1.0 and all(x > 0 for x in v)
    assert calibration.cost_ratio > 0 and calibration.draft.label == "ngram"
    cost = calibration.cost_model
    assert cost.max_k == K_MAX - 1 and cost.cost_ratio == calibration.cost_ratio
    assert calibration.path.parent == calibration_dir() and calibration.path.is_file()


def grid(scale: float) -> tuple[tuple[float, ...], ...]:
    """A batch grid: b rows of m tokens cost scale · (1 + 0.1·(b·m − 1) + 0.5·(b − 1)) seconds."""
    return tuple(
        tuple(scale * (1 + 0.1 * (b * m - 1) + 0.5 * (b - 1)) for m in ROW_TOKENS) for b in BATCH_ROWS
    )


def test_costs_at_a_context_interpolate_the_two_measured_contexts():
    short = (0.010, 0.012, 0.015)  # T(k) for k = 1..3 after 256 positions
    long = (0.014, 0.018, 0.025)  # after 1024
    costs = TargetCosts(
        "t", short, 3, "now", 256, long, 1024, batch_seconds=grid(0.010), long_batch_seconds=grid(0.014)
    )
    assert costs.seconds_at(256) == short and costs.seconds_at(1024) == pytest.approx(long)
    assert costs.seconds_at(640) == pytest.approx((0.012, 0.015, 0.020))  # halfway
    assert costs.seconds_at(1792) == pytest.approx((0.018, 0.024, 0.035))  # linear beyond the long one
    assert costs.seconds_at(0)[0] == pytest.approx(0.010 - 256 / 768 * 0.004)
    calibration = Calibration(costs, DraftCosts("d", 0.2, 0.002, 3, "now", 0.0005), Path("x"))
    at = calibration.cost_model_at(1024)  # the draft's seconds as measured, over a dearer target step
    assert at.cost_ratio == pytest.approx(0.002 / 0.014) and at.verify(3) == pytest.approx(0.025 / 0.014)
    assert at.catch_up == pytest.approx(0.0005 / 0.014) and calibration.cost_model.catch_up == 0.05
    fixed = Calibration(costs, DraftCosts("d", 0.2, 0.002, 3, "now", 0.0005, 0.003), Path("x"))
    assert fixed.cost_model_at(1024).fixed_cost == pytest.approx(0.003 / 0.014)
    assert calibration.cost_model.cost_ratio == 0.2  # the short context's, as measured in pairs
    # the drafter timed while the machine ran at half the speed of the target's timings (T(1) beside its
    # proposals 0.02 s, not 0.01): c, c₀ and u all keep the ratios measured beside that T(1)
    slow = Calibration(costs, DraftCosts("d", 0.2, 0.004, 3, "now", 0.001, 0.006), Path("x"))
    assert slow.cost_model.cost_ratio == pytest.approx(0.2)
    assert slow.cost_model.fixed_cost == pytest.approx(0.3) and slow.cost_model.catch_up == pytest.approx(
        0.05
    )
    assert slow.cost_model_at(256) == slow.cost_model
    with pytest.raises(ValueError, match="a drafter's catch-up must be a number >= 0"):
        DraftCosts("d", 0.2, 0.002, 3, "now", -1e-6)
    # the batch grid in units of one row's T(1) at that context, interpolated like the rest
    assert costs.batch_cost_at(256).forward(1, 1) == pytest.approx(1.0)
    assert costs.batch_cost_at(640).forward(4, 8) == pytest.approx(1 + 0.7 + 1.5)
    assert costs.batch_cost_at(1024) == calibration.batch_cost_at(1024)
    unmeasured = TargetCosts("t", short, 3, "now", batch_seconds=grid(0.01))  # no room for the long context
    assert unmeasured.seconds_at(4000) == short and unmeasured.batch_cost_at(4000).forward(2, 2) == 1.6
    with pytest.raises(ValueError, match="long-context timings need as many values, at a longer context"):
        TargetCosts("t", short, 3, "now", 256, long[:2], 1024, grid(0.01), grid(0.014))
    with pytest.raises(ValueError, match="batch timings must be 5 x 3 numbers > 0"):
        TargetCosts("t", short, 3, "now", batch_seconds=grid(0.01)[:2])
    with pytest.raises(ValueError, match="batch timings at the long context go with single-row ones"):
        TargetCosts("t", short, 3, "now", batch_seconds=grid(0.01), long_batch_seconds=grid(0.01))


class _Lagging:
    """A drafter that keeps state of the context: reading a position it has not read costs ``per`` seconds
    (slept), a proposal nothing more. Proposes nothing."""

    name = "lagging"

    def __init__(self, per: float) -> None:
        self.per, self.read = per, 0

    def begin(self, prompt: list[int]) -> None:
        self.read = 0

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        time.sleep(self.per * (len(context) - 1 - self.read))
        self.read = len(context) - 1
        return Proposal.empty()

    def observe(self, num_accepted: int) -> None:
        pass


class _Windowed(_Lagging):
    """A lagging drafter that reads at most the last ``catch_up_limit`` of the positions it has not read."""

    def __init__(self, per: float, limit: int) -> None:
        super().__init__(per)
        self.catch_up_limit = limit

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        time.sleep(self.per * min(len(context) - 1 - self.read, self.catch_up_limit))
        self.read = len(context) - 1
        return Proposal.empty()

    def cost_identity(self) -> dict:
        return {"drafter": self.name, "per": self.per, "limit": self.catch_up_limit}


class _Stepping(_Lagging):
    """A drafter whose proposal of k tokens costs ``fixed`` + k · ``per`` seconds (slept), reading nothing."""

    name = "stepping"

    def __init__(self, fixed: float, per: float) -> None:
        super().__init__(0.0)
        self.fixed, self.per_token = fixed, per

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        time.sleep(self.fixed + k * self.per_token)
        return Proposal.empty()


def test_a_proposals_cost_is_split_into_a_fixed_part_and_one_per_token(stories):
    """c₀ + K·c: proposals of 1 and DRAFT_K tokens timed apart give both (sleeps overshoot, never undershoot,
    by about the same in both); a drafter whose cost does not grow with K is nearly all fixed cost."""
    model, _ = stories
    costs = calibration_module._measure_drafter(_Stepping(0.02, 0.005), model, "stepping", 3, False)
    assert 0.012 <= costs.fixed_seconds <= 0.035 and 0.003 <= costs.seconds_per_token <= 0.009
    flat = calibration_module._measure_drafter(_Stepping(0.01, 0.0), model, "flat", 3, False)
    assert 0.007 <= flat.fixed_seconds <= 0.03 and flat.seconds_per_token <= 0.002
    target = TargetCosts("t", (0.01, 0.012), 3, "now", batch_seconds=grid(0.01))
    cost = Calibration(target, costs, Path("x")).cost_model
    # over the T(1) timed beside the proposals, as c is: the target's own T(1) here is made up
    assert cost.fixed_cost == pytest.approx(costs.fixed_seconds * costs.cost_ratio / costs.seconds_per_token)
    assert cost.round_cost(1) == pytest.approx(1.2 + costs.cost_ratio + cost.fixed_cost)


def test_a_drafters_catch_up_is_what_reading_an_unread_position_costs(stories):
    """The catch-up: a first proposal's time (the whole context unread) less a steady proposal's, per
    position; about nothing for a drafter that keeps no state of the context."""
    model, _ = stories
    lagging = calibration_module._measure_drafter(_Lagging(40e-6), model, "lagging", 3, False)
    assert 30e-6 <= lagging.catch_up_seconds <= 120e-6  # sleep overshoots, never undershoots
    steady = lagging.fixed_seconds + DRAFT_K * lagging.seconds_per_token  # a steady proposal's cost
    assert steady >= 40e-6  # it reads one position, whatever K: mostly fixed cost
    lookup = calibration_module._measure_drafter(NGramDrafter(), model, "ngram", 3, False)
    assert 0 <= lookup.catch_up_seconds < 20e-6  # its index of the context: microseconds a position


def test_a_drafter_reading_the_last_positions_only_is_timed_per_position_read(stories):
    """A drafter whose catch-up reads at most its last ``catch_up_limit`` unread positions: the fill is
    divided by the positions it read, and the cost model says how many it reads at most."""
    model, _ = stories
    windowed = calibration_module._measure_drafter(_Windowed(400e-6, 8), model, "windowed", 3, False)
    assert 300e-6 <= windowed.catch_up_seconds <= 1200e-6 and windowed.catch_up_limit == 8
    calibration = calibrate(model, _Windowed(400e-6, 8))
    assert calibration.cost_model.catch_up_limit == 8 and calibration.cost_model_at(600).catch_up_limit == 8
    assert calibrate(model, NGramDrafter()).cost_model.catch_up_limit is None


def test_the_batch_grid_is_timed_where_rows_share_a_forward(stories):
    """The native kernels score a batch's rows in one forward: their grid is timed in a full calibration,
    and a probe predicts it as one row of b·m tokens. A target off them is scored one row after another by
    the engine: its grid is b · T(m), computed, not timed."""
    model, _ = stories
    plain = calibrate(model, repetitions=2).target
    assert plain.batch_seconds == tuple(
        tuple(b * plain.seconds[m - 1] for m in ROW_TOKENS) for b in BATCH_ROWS
    )
    native = Llama(LlamaConfig(64, 64, 96, 2, 4, 2, max_position_embeddings=1024))
    with torch.no_grad():
        for weight in native.parameters():  # timing does not care what they hold, quantization does
            weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    assert native.optimize_for_cpu(precision="q8_0")
    probed = calibrate(native, repetitions=2).target
    assert probed.probe and not probed.long_seconds and probed.context == calibration_module.PROBE_CONTEXT
    assert [line[0] for line in probed.batch_seconds] == [probed.seconds[b - 1] for b in BATCH_ROWS]
    assert probed.batch_seconds[-1][-1] >= probed.seconds[-1]  # 64 tokens: the curve extended
    timed = calibrate(native, repetitions=2, force=True).target
    assert not timed.probe
    assert (timed.context, timed.long_context) == (256, 512) and len(timed.long_batch_seconds) == len(
        BATCH_ROWS
    )
    assert timed.batch_seconds != tuple(
        tuple(b * timed.seconds[m - 1] for m in ROW_TOKENS) for b in BATCH_ROWS
    )
    one = timed.batch_cost_at(256).forward(1, 1)  # T(1 row × 1 token) over T(1), timed apart
    assert math.isfinite(one) and one > 0  # its size is two timings' ratio: the machine's load, no behaviour


def test_cached_per_identity_and_reused(stories, measured):
    model, _ = stories
    first = calibrate(model, NGramDrafter(), repetitions=2)
    again = calibrate(model, NGramDrafter(), repetitions=2)
    assert measured == {"target": 1, "draft": 1} and again == first  # read back, not measured again
    early_exit = calibrate(model, _model_drafter(model, 2), repetitions=2)
    assert measured == {"target": 1, "draft": 2} and early_exit.path == first.path  # one file per target
    assert early_exit.cost_ratio != first.cost_ratio
    entry = json.loads(first.path.read_text())
    assert len(entry["drafts"]) == 2 and entry["identity"]["model"] == json.loads(
        json.dumps(model_identity(model))
    )
    torch.set_num_threads(2)  # the thread count is part of the machine's identity: another file
    other = calibrate(model, NGramDrafter(), repetitions=2)
    assert other.path != first.path and measured["target"] == 2
    assert NGramDrafter(2).cost_identity() != NGramDrafter(3).cost_identity()


def test_force_measures_again_and_keeps_other_drafters(stories, measured):
    """--recalibrate with one drafter measures the target and that drafter again; another drafter's entry
    stays (its costs are ratios to the T(1) timed beside it), and its cost model is what it was."""
    model, _ = stories
    calibrate(model, NGramDrafter(), repetitions=2)
    early = calibrate(model, _model_drafter(model, 2), repetitions=2)
    calibrate(model, NGramDrafter(), repetitions=2, force=True)
    assert measured == {"target": 2, "draft": 3}
    path = next(calibration_dir().glob("*.json"))
    assert len(json.loads(path.read_text())["drafts"]) == 2
    again = calibrate(model, _model_drafter(model, 2), repetitions=2)
    assert measured == {"target": 2, "draft": 3}  # read from the cache
    assert again.cost_model.cost_ratio == early.cost_model.cost_ratio
    assert again.cost_model.fixed_cost == pytest.approx(early.cost_model.fixed_cost)


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: "{ not json",
        lambda text: text.replace('"seconds"', '"secs"'),
        lambda text: json.dumps({**json.loads(text), "version": 99}),
        lambda text: json.dumps(
            {**json.loads(text), "target": {**json.loads(text)["target"], "seconds": [1.0]}}
        ),
    ],
    ids=["not-json", "missing-field", "other-version", "too-short"],
)
def test_a_corrupt_cache_is_measured_again(stories, measured, capsys, damage):
    model, _ = stories
    path = calibrate(model, NGramDrafter(), repetitions=2).path
    path.write_text(damage(path.read_text()))
    capsys.readouterr()
    calibration = calibrate(model, NGramDrafter(), repetitions=2)
    assert measured["target"] == 2 and "unusable calibration file" in capsys.readouterr().err
    assert json.loads(path.read_text())["target"]["seconds"] == list(calibration.target.seconds)


def test_auto_is_the_default_and_builds_the_cost_model_policy(stories):
    model, tokenizer = stories
    greedy = SamplingParams(temperature=0)
    ngram = Speculator((model, tokenizer), drafter="ngram")
    assert isinstance(ngram.k_policy("auto"), CostModelK)
    assert isinstance(Speculator((model, tokenizer), drafter="none").k_policy("auto"), ConstantK)
    result = ngram.generate("Once upon a time", max_new_tokens=40, sampling=greedy)
    plain = Speculator((model, tokenizer), drafter="none").generate(
        "Once upon a time", max_new_tokens=40, sampling=greedy
    )
    assert result.stats["k"] == "auto" and result.token_ids == plain.token_ids
    assert plain.stats["k"] == "0"  # drafter "none" drafts nothing, whatever K asks
    assert calibration_dir().is_dir()


def test_auto_k_requests_share_acceptance_evidence_by_sampling_settings(stories):
    """A speculator's `--k auto` requests start from the verdicts of its earlier requests with the same
    sampling settings (the seed aside) and constraint or none; other settings, a standalone policy and fixed
    K keep their own."""
    model, tokenizer = stories
    ngram = Speculator((model, tokenizer), drafter="ngram")
    greedy = GenerationOptions(k="auto", sampling=SamplingParams(temperature=0))
    first = ngram.k_policy("auto", greedy)
    assert isinstance(first, CostModelK) and first.shared is not None
    assert ngram.k_policy("auto").shared is None  # no request: its own evidence
    sampled = [GenerationOptions(k="auto", sampling=SamplingParams(temperature=0.8, seed=s)) for s in (1, 2)]
    one, two = (cast(CostModelK, ngram.k_policy("auto", o)) for o in sampled)
    assert one.shared is two.shared and one.shared is not first.shared  # the seed aside
    constrained = dataclasses.replace(greedy, constraint=Constraint("regex", "ab"))
    assert cast(CostModelK, ngram.k_policy("auto", constrained)).shared is not first.shared
    prior = first.alphas.copy()
    stats = GenerationStats("ngram", "auto")
    ngram.generate("Once upon a time", greedy, max_new_tokens=60, stats=stats)
    assert stats.drafted > 0
    later = cast(CostModelK, ngram.k_policy("auto", greedy))
    assert not np.allclose(later.alphas, prior)  # starts from the first request's verdicts
    assert np.allclose(cast(CostModelK, ngram.k_policy("auto", sampled[0])).alphas, prior)


def test_cli_calibrate(shared_model, capsys):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model_args = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin")]
    assert (
        main(["calibrate", *model_args, "--repetitions", "2", "--threads", "1", "--draft", "layers:2"]) == 0
    )
    out, err = capsys.readouterr()
    assert "model drafter: c = " in out and "v(k)" in out and "best K" in out and "cached in" in err
    assert main(["calibrate", *model_args, "--repetitions", "2", "--threads", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["draft"]["label"] == "ngram" and len(data["verify_cost"]) == K_MAX
    assert main(["calibrate", *model_args, "--repetitions", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["calibrate", *model_args, "--drafter", "eagle"]) == 2  # no learned drafter for stories
    assert "needs a drafter file" in capsys.readouterr().err


def _model_drafter(model, layers: int):
    from verispec.drafting.draft_model import ModelDrafter

    return ModelDrafter(model.first_layers(layers), SamplingParams(temperature=0), model.vocab_size)


def test_the_drift_of_t1_within_a_measurement():
    assert calibration_module._drift([1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == 1.0  # one slow forward
    assert calibration_module._drift([1.0] * 8 + [3.0] * 8) == 3.0  # a busy spell began halfway
    assert calibration_module._drift([1.0, 5.0, 5.0]) == 1.0  # too few to compare


def test_a_probed_curve_that_falls_counts_as_drift(stories, measured, monkeypatch):
    """A probe of one pass per size on a busy machine timed T(1) at 2.06 s and T(2) at 0.9 ms, and its T(1)s
    alone showed no drift (too few): cached as clean, it stayed, and --k auto planned with it. A curve that
    falls (a forward of more tokens never costs less) is a drift of its fall: probed again once quiet."""
    assert calibration_module._fall([1.0, 1.1, 1.05, 2.0]) == pytest.approx(1.1 / 1.05)  # noise: no drift
    assert calibration_module._fall([2.0, 0.001, 0.03]) == pytest.approx(2000.0)
    model, _ = stories

    def seconds(self, k):  # every one-token forward timed while something else held the core
        return 1.0 if k == 1 else 1e-3 * (1 + 0.1 * (k - 1))

    monkeypatch.setattr(calibration_module._TargetTimer, "seconds", seconds)
    probed = calibrate(model, repetitions=1).target
    assert probed.probe and probed.drift == pytest.approx(1.0 / 1.1e-3)


def test_a_probe_with_a_stalled_forward_is_timed_again_at_once(stories, measured, monkeypatch):
    """On an idle Intel Xeon a first use's probe at 3 B cost (one pass per size) timed one T(2) stalled by
    ~100 ms: v(2) = 2.43, then v(4) = 1.03, cached and planned with. A probe whose curve falls past FALL is
    timed once more at once, and the steadier of the two is kept."""
    model, _ = stories
    calls = []

    def seconds(self, k):  # forwards of 1 ms (+10 % a token); the first timed T(2) stalls
        calls.append(k)
        sizes = len(calibration_module.PROBE_KS) + 1  # and the PROBE_WIDE block
        stalled = len(calls) == 2 * sizes + 4  # the first try: its untimed pass, then (T(1), T(2)) timed
        return 1e-3 * (1 + 0.1 * (k - 1)) + (0.1 if stalled else 0.0)

    monkeypatch.setattr(calibration_module._TargetTimer, "seconds", seconds)
    probed = calibrate(model, repetitions=1).target
    assert probed.probe and probed.drift == pytest.approx(1.0)
    assert probed.verify_cost == pytest.approx([1 + 0.1 * k for k in range(K_MAX)])
    assert len(calls) == 2 * 2 * 2 * (
        len(calibration_module.PROBE_KS) + 1
    )  # two tries of two passes of pairs
    calls.clear()
    calibrate(model, repetitions=1, force=False)  # cached: nothing timed
    assert calls == [] and measured["target"] == 1


def test_a_probes_batch_grid_reaches_its_widest_forward(stories, monkeypatch):
    """A probe times one block of PROBE_WIDE tokens beside its PROBE_KS: the batch grid's widest forwards
    (16 rows of 4 tokens) are priced from it, not from the slope between 8 and 16 tokens. Fake forwards:
    +5 % a token up to 16 tokens (memory-bound), +40 % a token beyond (compute-bound)."""
    model, _ = stories

    def ratio(k: int) -> float:
        return 1 + 0.05 * (min(k, K_MAX) - 1) + 0.4 * max(0, k - K_MAX)

    monkeypatch.setattr(calibration_module._TargetTimer, "seconds", lambda self, k: 1e-3 * ratio(k))
    monkeypatch.setattr(calibration_module._RowsTimer, "of", classmethod(lambda cls, model, rows=16: True))
    target = calibrate(model, repetitions=1).target
    assert target.probe and target.verify_cost == pytest.approx([ratio(k) for k in range(1, K_MAX + 1)])
    grid = target.batch_cost_at(target.context)
    wide = calibration_module.PROBE_WIDE
    assert grid.forward(16, wide) == pytest.approx(ratio(wide))  # 16 rows of 4 tokens: the timed block
    assert grid.forward(8, 32) == pytest.approx(ratio(32))  # linear between the timed 16 and 64 tokens
    assert grid.forward(4, 4) == pytest.approx(ratio(4))


class _FakeClock:
    """The calibration's clock, advanced by the target's forwards as timed (none takes real time): a forward
    of k tokens takes ``step`` · (1 + 0.1 (k − 1)) seconds, 3× that in the second half of every ``period``
    forwards while ``busy`` says so (a busy spell that begins halfway through a measurement)."""

    def __init__(self, step: float, period: int = 0, busy=lambda n: False) -> None:
        self.now, self.step, self.period, self.busy, self.calls = 0.0, step, period, busy, 0

    def perf_counter(self) -> float:
        return self.now

    def seconds(self, k: int) -> float:  # as the _TargetTimer of every measurement
        n, self.calls = self.calls, self.calls + 1
        late = self.period and n % self.period >= self.period // 2 and self.busy(n)
        elapsed = self.step * (1 + 0.1 * (k - 1)) * (3.0 if late else 1.0)
        self.now += elapsed
        return elapsed


def test_a_calibration_whose_t1_drifts_is_cached_all_the_same(stories, measured, monkeypatch, capsys):
    """A fake clock: the target's forwards take 3× as long in the second half of a full measurement (a busy
    spell). It is not measured again on a busy machine: cached with its drift, one line saying so, and read
    back (the rounds' own timings correct it as it runs); the first use that finds the machine quiet probes
    it again, once: the probe held still."""
    model, _ = stories
    monkeypatch.setattr(calibration_module._RowsTimer, "of", classmethod(lambda cls, model, rows=16: None))
    clock = _FakeClock(1e-3, period=2 * K_MAX * (2 + 1), busy=lambda n: True)
    monkeypatch.setattr(calibration_module, "time", clock)
    monkeypatch.setattr(calibration_module._TargetTimer, "seconds", clock.seconds)
    capsys.readouterr()
    calibration = calibrate(model, repetitions=2, force=True)
    err = capsys.readouterr().err
    assert calibration.target.verify_cost == pytest.approx([1 + 0.1 * k for k in range(K_MAX)])
    assert calibration.target.drift == pytest.approx(3.0) and not calibration.target.probe
    (line,) = [line for line in err.splitlines() if "moved" in line]
    assert "moved 3.0x while timing" in line and "kept all the same" in line and "verispec calibrate" in line
    assert measured["target"] == 1 and calibration.path.is_file()
    assert calibrate(model, repetitions=2) == calibration and measured["target"] == 1  # never again
    clock.busy = lambda n: False  # the busy spell is over, and the machine looks quiet
    monkeypatch.setattr(calibration_module, "quiet", lambda: True)
    capsys.readouterr()
    again = calibrate(model, repetitions=2)
    (line,) = capsys.readouterr().err.splitlines()
    assert "timed while T(1) moved 3.0x: timing again, the machine is quiet" in line
    assert measured["target"] == 2 and again.target.probe and again.target.drift == pytest.approx(1.0)
    assert calibrate(model, repetitions=2) == again and measured["target"] == 2  # steady now: kept


@pytest.mark.parametrize("step", [1e-3, 0.5], ids=["idle", "busy"])
def test_a_first_use_probes_within_its_seconds_once(stories, measured, monkeypatch, capsys, step):
    """A fake clock: on an idle machine (1 ms forwards) a probe makes its most timed passes; on a busy one
    (0.5 s forwards: 13x slower) the one timed pass that begins within PROBE_SECONDS, however long the full
    measurement would take. Either way it says once, on stderr, that it times and how to skip it, and is
    cached and read back: the next run measures nothing."""
    model, _ = stories
    clock = _FakeClock(step)
    monkeypatch.setattr(calibration_module, "time", clock)
    monkeypatch.setattr(calibration_module._TargetTimer, "seconds", clock.seconds)
    capsys.readouterr()
    calibration = calibrate(model, NGramDrafter(), repetitions=5)
    err = capsys.readouterr().err
    target = calibration.target
    assert target.probe and calibration.draft is not None and calibration.draft.probe
    assert target.repetitions == (5 if step < 0.1 else 1)
    # an n-gram lookup costs nothing next to the target: its probe ends after its least passes
    assert calibration.draft.repetitions == (calibration_module.PROBE_LEAST if step < 0.1 else 1)
    # no pass begun after its seconds: the target's pairs (one untimed pass, then the timed ones), the T(1)
    # beside each of the drafter's proposals
    sizes = len(calibration_module.PROBE_KS) + 1  # and the PROBE_WIDE block
    assert clock.calls == 2 * sizes * (1 + target.repetitions) + 2 * calibration.draft.repetitions
    assert target.verify_cost == pytest.approx([1 + 0.1 * k for k in range(K_MAX)])  # linear between sizes
    (line,) = err.splitlines()
    assert "--k N skips it" in line and "once" in line
    calibrate(model, _model_drafter(model, 2), repetitions=5)  # another drafter: probed, said no more
    assert measured == {"target": 1, "draft": 2} and capsys.readouterr().err == ""
    assert calibrate(model, NGramDrafter()) == calibration and measured == {"target": 1, "draft": 2}


class _TimedDrafter(NGramDrafter):
    """An n-gram lookup whose every proposal advances the fake clock by ``cost`` seconds a token."""

    def __init__(self, clock: _FakeClock, cost: float) -> None:
        super().__init__()
        self.clock, self.cost = clock, cost

    def propose(self, context, k, generator, allowed=None):
        self.clock.now += self.cost * k
        return super().propose(context, k, generator, allowed)

    def cost_identity(self) -> dict:
        return {**super().cost_identity(), "cost": self.cost}


@pytest.mark.parametrize("cost, passes", [(1e-6, 4), (1e-4, 12)])
def test_a_probe_of_a_drafter_that_costs_nothing_ends_early(stories, monkeypatch, cost, passes):
    """A fake clock, 1 ms target forwards: a drafter whose proposals take 1 µs a token (0.1 % of T(1), a
    lookup's) is probed in PROBE_LEAST passes, not for the whole of PROBE_DRAFT_SECONDS beside the target's
    forwards; one of 0.1 ms a token (10 %) for every pass its repetitions allow. Either way its cost is
    measured."""
    model, _ = stories
    clock = _FakeClock(1e-3)
    monkeypatch.setattr(calibration_module, "time", clock)
    monkeypatch.setattr(calibration_module._TargetTimer, "seconds", clock.seconds)
    assert calibration_module.PROBE_LEAST == 4 and calibration_module.NEGLIGIBLE == 0.01
    draft = calibrate(model, _TimedDrafter(clock, cost), repetitions=12).draft
    assert draft is not None and draft.probe and draft.repetitions == passes
    assert draft.cost_ratio == pytest.approx(cost / 1e-3, rel=1e-6, abs=1e-6)

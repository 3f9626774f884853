"""Costs measured as it runs: ``--k auto`` takes the calibration as a prior and corrects it by the rounds' own
timings — made-up timings here (:func:`~verispec.costs.recovery.simulate_recovery`), nothing timed — and
the engine hands a real run's timings to the policy without changing its output."""

import time

import numpy as np
import pytest

from toy import single_threaded
from verispec.costs.analytic import BatchCost, CostModel, speedup_by_k
from verispec.costs.online import ForwardTiming, OnlineConfig, OnlineCosts, RoundTiming
from verispec.costs.policies import AutoKConfig, ConstantK, CostModelK, KPolicy
from verispec.costs.recovery import simulate_recovery
from verispec.drafting.ngram import NGramDrafter
from verispec.engine.engine import SpeculativeEngine
from verispec.engine.sequence import EngineConfig, GenerationStats, Request
from verispec.models.registry import load_model
from verispec.options import SamplingParams

MEASURED = [1.0, 1.13, 1.2, 1.13, 1.11, 1.15, 1.23, 1.25, 1.26, 1.29, 1.31, 1.32, 1.39, 1.42, 1.45, 1.5]
CASES = [(0.02, 0.8), (0.02, 0.5), (0.2, 0.8), (0.05, 0.3)]  # (c, α): lookups and model drafts, good and poor


def poisoned(truth: CostModel, factor: float = 50.0) -> CostModel:
    """A calibration whose every drafting cost is ``factor`` times the truth: v(k ≥ 2), c and u."""
    curve = truth.verify_cost
    assert isinstance(curve, tuple)
    v = (1.0, *(factor * x for x in curve[1:]))
    return CostModel(factor * truth.cost_ratio, v, factor * truth.catch_up)


@pytest.mark.parametrize(("c", "alpha"), CASES)
def test_a_poisoned_calibration_recovers_within_64_rounds(c, alpha):
    """Every drafting cost ×50 (and T(1) ×50): the prior says K = 0 and would probe after thousands of plain
    rounds; the costs seen in the first probes correct it, and from then on the K drafted is worth what the
    K that the true costs choose is, within 5 %, and mostly is that K."""
    truth = CostModel(c, MEASURED)
    assert CostModelK(poisoned(truth)).next_k() == 0
    for seed in range(3):
        run = simulate_recovery(poisoned(truth), truth, alpha, 64, prior_step=50.0, seed=seed)
        start = run.recovered()
        assert start is not None and start <= 32, (seed, run.ks)
        same = sum(k == best for k, best in zip(run.ks[32:], run.clean[32:], strict=True))
        assert same >= 0.9 * 32, (seed, run.ks, run.clean)
        assert run.corrected.cost_ratio == pytest.approx(c)


@pytest.mark.parametrize(("c", "alpha"), CASES)
def test_a_uniformly_wrong_step_changes_no_decision_once_corrected(c, alpha):
    """A calibration made while every target forward took 3× as long (T(1) ×3, so c, c₀ and u a third):
    once the rounds have been timed, the corrected costs are the true ones and the K chosen is the true
    costs'."""
    truth = CostModel(c, MEASURED, catch_up=0.003, fixed_cost=0.06)
    slow = CostModel(c / 3, MEASURED, catch_up=0.001, fixed_cost=0.02)
    run = simulate_recovery(slow, truth, alpha, 64, prior_step=3.0)
    assert run.ks[8:] == run.clean[8:]
    assert run.corrected.cost_ratio == pytest.approx(c) and run.corrected.catch_up == pytest.approx(0.003)
    assert run.corrected.fixed_cost == pytest.approx(0.06)
    assert run.corrected.verify_cost == pytest.approx(tuple(MEASURED))


@pytest.mark.parametrize(("c", "alpha"), CASES)
def test_one_slow_round_flips_no_k(c, alpha):
    """A preempted round (its forward and draft 30× as long) changes no later choice."""
    truth = CostModel(c, MEASURED)
    for seed in range(3):
        steady = simulate_recovery(truth, truth, alpha, 48, seed=seed)
        for at in (0, 1, 20, 40):
            assert simulate_recovery(truth, truth, alpha, 48, slow={at: 30.0}, seed=seed).ks == steady.ks


def timing(tokens: int, seconds: float, drafted: int = 0, draft: float = 0.0, rows: int = 1) -> RoundTiming:
    return RoundTiming(ForwardTiming(rows, tokens, seconds, 100), drafted, draft, 100)


def test_estimates_are_lower_medians_corrections_relative_to_one_step():
    """A kind of work seen twice is estimated on its own (the lower median: the slow one of two is not it),
    once with what the others give it; a forward of another size or row count is counted over the one-token
    forwards timed just before it, a proposal over its round's speed; the corrected costs are the prior's
    times these ratios; one forward reported by every row of a batch counts once."""
    online = OnlineCosts()
    prior = CostModel(0.1, [1.0, 1.2, 1.4, 1.6])
    assert online.correct(prior) is prior and online.step is None
    online.observe(timing(1, 2.0), 1.0, 0.0)
    assert online.step is None  # one timing of one kind: nothing estimated yet
    online.observe(timing(1, 9.0), 1.0, 0.0)  # a slow one
    assert online.step == 2.0
    online.observe(timing(3, 4.2), 1.4, 0.0)  # one size-3 forward, 1.5 ρ(1): the smaller of it and 1
    assert online.correct(prior).verify_cost == pytest.approx((1.0, 1.2, 1.4, 1.6))
    online.observe(timing(3, 3.5, drafted=2, draft=0.2), 1.4, 0.2)  # size 3 twice: 1.25 ρ(1); the drafter
    corrected = online.correct(prior)
    assert corrected.verify_cost == pytest.approx((1.0, 1.2, 1.75, 2.0))  # size 2 takes size 1's, 4 size 3's
    assert corrected.cost_ratio == pytest.approx(0.05)  # ρ_d = 1 = 0.5 ρ(1) then: the smaller of it and 1
    batch = BatchCost((1, 2), (1, 2), ((1.0, 1.2), (1.5, 1.9)))
    assert sum(online.correct_batch(batch).cost, ()) == pytest.approx((1.0, 1.2, 1.5, 1.9))  # as one row
    for tokens, seconds, rows in ((1, 2.0, 1), (1, 2.0, 1), (4, 4.5, 2), (4, 4.5, 2)):
        online.observe(timing(tokens, seconds, rows=rows), 1.5 if rows == 2 else 1.0, 0.0)
    assert sum(online.correct_batch(batch).cost, ()) == pytest.approx((1.0, 1.2, 2.25, 2.85))  # 1.5 ρ(1)
    fresh, forward = OnlineCosts(), ForwardTiming(1, 1, 2.0, 100)
    for _ in range(2):  # two reports of one forward (every row of a batch's): one timing, no estimate yet
        fresh.observe(RoundTiming(forward, 0, 0.0, 100), 1.0, 0.0)
    assert fresh.step is None
    fresh.observe(timing(1, 3.0), 1.0, 0.0)  # another forward
    assert fresh.step == 2.0
    lone = OnlineCosts()
    for _ in range(3):  # forwards of two rows only: no one-token forward to compare them with
        lone.observe(timing(4, 6.0, rows=2), 1.5, 0.0)
    assert lone.step is None and lone.correct_batch(batch) == batch
    with pytest.raises(ValueError, match="min_seen <= window"):
        OnlineConfig(window=2, min_seen=3)
    with pytest.raises(ValueError, match="explore must be an integer >= 1"):
        AutoKConfig(explore=0)


def test_a_machine_warming_up_changes_no_ratio_and_a_ratio_expires():
    """Sizes 1 and 3 timed while every forward ran 3× slow (size 3 costing 1.5× the prior's shape), then only
    size 1 at its true cost: size 3 is compared with the one-token forwards timed beside it, so it costs what
    it costs (it looked 3× dearer still against the later ones: a policy stopped drafting it until those
    timings expired); a ratio expires after `horizon` forwards (a size with one left takes the smaller of it
    and its neighbours', like a size seen once; with none, theirs)."""
    prior = CostModel(0.1, [1.0, 1.2, 1.4, 1.6])
    online = OnlineCosts(config=OnlineConfig(horizon=16))
    for tokens, seconds in ((1, 3.0), (1, 3.0), (3, 3.0 * 1.4 * 1.5), (3, 3.0 * 1.4 * 1.5)):  # forwards 1-4
        online.observe(timing(tokens, seconds), prior.verify(tokens), 0.0)
    for forward in range(5, 21):
        online.observe(timing(1, 1.0), 1.0, 0.0)
        ratio = 1.5 if forward < 19 else 1.0  # from forward 19 on, size 3's first timing (forward 3) expired
        assert online.correct(prior).verify(3) == pytest.approx(1.4 * ratio), forward
    assert online.step == 1.0
    with pytest.raises(ValueError, match="horizon must be an integer >= 1"):
        OnlineConfig(horizon=0)
    with pytest.raises(ValueError, match="pair must be an integer >= 1"):
        OnlineConfig(pair=0)


def test_a_block_timed_after_a_speed_up_never_costs_less_than_one_token():
    """One-token forwards timed while the machine ran 3× slow, then blocks of 2 and 3 tokens at their true
    cost right after: compared with those forwards, the blocks cost a third of what they do. A policy that
    priced them so drafted every round and never timed a one-token forward again (the first rounds of a
    process here, the EAGLE head on RAG prompts: 0.90× `none`). A block timed faster than the one-token
    forwards before it is not compared with them, and no block is priced below one token (here sizes 2 and 3,
    never timed, would take size 4's ratio, 0.4)."""
    prior = CostModel(0.1, [1.0, 1.3, 1.5, 1.7])
    online = OnlineCosts()
    for tokens in (1, 1, 1, 2, 3, 2, 3, 3, 2, 3, 2):
        seconds = 3.0 if tokens == 1 else prior.verify(tokens)
        online.observe(timing(tokens, seconds), prior.verify(tokens), 0.0)
    assert online.correct(prior).verify_cost == pytest.approx(prior.verify_cost)  # nothing compared
    fresh = OnlineCosts()  # without the slow start: the true shape
    for tokens in (1, 1, 2, 3, 1, 1, 2, 3):
        fresh.observe(timing(tokens, 0.9 * prior.verify(tokens)), prior.verify(tokens), 0.0)
    assert fresh.correct(prior).verify_cost == pytest.approx(prior.verify_cost)
    dear = CostModel(0.1, [1.0, 1.3, 1.5, 3.0])  # size 4 calibrated 2.5× too dear
    bound = OnlineCosts()
    for tokens in (1, 1, 4, 1, 1, 4):
        bound.observe(timing(tokens, 1.2 if tokens == 4 else 1.0), dear.verify(tokens), 0.0)
    assert bound.correct(dear).verify_cost == pytest.approx((1.0, 1.0, 1.0, 1.2))


def test_a_move_is_published_by_what_it_costs_a_round():
    """A forward size's estimate is published when it moves by the tolerance relative to itself; the rest of
    a round's and the drafter's when the move costs a round that share of a one-token forward: a lookup
    costing a hundredth of a step that takes twice as long changes nothing, a drafter costing a step does."""
    for steps, published in ((0.01, False), (1.0, True)):  # a drafter costing a hundredth of a step, one
        online = OnlineCosts()
        for _ in range(2):
            online.observe(timing(1, 1.0, drafted=1, draft=steps), 1.0, steps)  # ρ(1) = ρ_d = 1
        version = online.version
        for _ in range(6):
            online.observe(timing(1, 1.0, drafted=1, draft=2 * steps), 1.0, steps)  # ρ_d → 2
        assert (online.version > version) == published, steps

    def two_tokens(ratio: float) -> None:  # a two-token forward after two one-token ones
        for _ in range(2):
            online.observe(timing(1, 1.0), 1.0, 0.0)
        online.observe(timing(2, ratio), 1.0, 0.0)

    for ratio in (1.0, 1.0, 1.06, 1.06):
        two_tokens(ratio)
    version = online.version
    assert online.correct(CostModel(0.0, [1.0, 1.5])).verify(2) == 1.5  # 1 until half its window is 1.06 ...
    two_tokens(1.06)
    assert online.version == version + 1  # ... then 6 % more: moved
    assert online.correct(CostModel(0.0, [1.0, 1.5])).verify(2) == pytest.approx(1.5 * 1.06)
    online.observe(timing(1, 1.5), 1.0, 0.0)
    assert online.version == version + 1  # a one-token forward's slowdown moves no ratio


def test_a_warm_up_of_slow_rounds_changes_few_choices():
    """A machine warming up (as measured here: a process's first forwards ran 1.5–3× slow and sped up over a
    few dozen more): the first 12 rounds 3× slow, or rounds 2× slow easing off over 40. Every kind of work is
    compared with one-token forwards timed beside it, so from round 12 (the first) and round 64 (the ramp)
    on, every round's K is worth the clean twin's within 5 %. (Compared with ρ(1) over its whole window, as
    it was, these runs recovered only as the slow timings expired: up to round 126 and 143.)"""
    ramp = {r: 2.0 - r / 40 for r in range(40)}
    for slow, by in ((dict.fromkeys(range(12), 3.0), 12), (ramp, 64)):
        for c, alpha in CASES:
            truth = CostModel(c, MEASURED)
            for seed in range(3):
                run = simulate_recovery(truth, truth, alpha, 200, slow=slow, seed=seed)
                start = run.recovered()
                assert start is not None and start <= by, (c, alpha, seed, run.ks)


def test_the_rest_of_a_round_counts_the_costs_in_whole_plain_rounds():
    """What a round costs besides its forward and proposal (o, timed by the engine between forwards) is
    estimated like the rest (its own lower median, nothing before it was seen twice, never a fallback) from
    single-row steps only; the corrected costs are then in whole plain rounds: v(m) → (v(m) + o) / (1 + o), c,
    c₀ and u → c / (1 + o), c₀ / (1 + o), u / (1 + o), the batch grid likewise; and with it the best K is
    never smaller."""
    prior = CostModel(0.1, MEASURED, catch_up=0.01, fixed_cost=0.03)
    online = OnlineCosts()

    def step(overhead: float | None, rows: int = 1) -> None:
        forward = ForwardTiming(rows, rows, 1.0 * rows, 100, overhead)  # ρ = 1 (no step_seconds: seconds)
        online.observe(RoundTiming(forward, 0, 0.0, 100), float(rows), 0.0)

    step(None)
    step(0.5)
    assert online.overhead == 0.0 and online.correct(prior).verify_cost == pytest.approx(MEASURED)
    step(0.6)
    step(5.0, rows=2)  # a batch's step: not timed for o
    step(5.0, rows=2)
    assert online.overhead == pytest.approx(0.5)  # the lower median of 0.5 and 0.6
    corrected = online.correct(prior)
    assert corrected.verify_cost == pytest.approx(tuple((v + 0.5) / 1.5 for v in MEASURED))
    assert corrected.cost_ratio == pytest.approx(0.1 / 1.5)
    assert corrected.catch_up == pytest.approx(0.01 / 1.5)
    assert corrected.fixed_cost == pytest.approx(0.03 / 1.5)
    grid = online.correct_batch(BatchCost((1, 2), (1, 2), ((1.0, 1.2), (1.5, 1.8))))
    assert grid.cost[0] == pytest.approx(((1.0 + 0.5) / 1.5, (1.2 + 0.5) / 1.5))
    alphas = np.array([0.7, 0.6, 0.5, 0.5])
    best = [int(np.argmax(speedup_by_k(alphas, cost.round_costs(4)))) for cost in (prior, corrected)]
    assert best[1] >= best[0]


def test_a_step_off_by_more_than_twice_is_said_once(capsys):
    online = OnlineCosts(lambda context: 0.5, OnlineConfig(horizon=8))  # a calibrated T(1) of half a second
    for seconds in (1.5, 1.5, 1.5, 1.5):  # a process warming up: not said before a horizon of forwards
        online.observe(timing(1, seconds), 1.0, 0.0)
    assert capsys.readouterr().err == ""
    for seconds in (0.01, 0.01, 0.011, 0.012, 0.01, 0.01, 0.011, 0.012):
        online.observe(timing(1, seconds), 1.0, 0.0)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "forwards here take 0.02" in err  # 0.02-0.024


class Recording(CostModelK):
    """``--k auto`` that keeps every timing the engine hands it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timings: list[RoundTiming] = []

    def observe_costs(self, timing: RoundTiming) -> None:
        self.timings.append(timing)
        super().observe_costs(timing)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():  # tiny forwards: competing threads only slow them
        yield


@pytest.fixture(scope="module")
def stories(shared_model):
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    return load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")


def decode(stories, policies: list[KPolicy]) -> list[list[int]]:
    """Greedy tokens of one prompt per policy, decoded together with the n-gram drafter."""
    model, tokenizer = stories
    engine = SpeculativeEngine(model, slots=len(policies))
    prompt = tokenizer.encode("Once upon a time, there was a little dog. The little dog")
    config = EngineConfig(max_new_tokens=48, sampling=SamplingParams(temperature=0))
    runs = [
        engine.submit(Request(prompt, config, NGramDrafter(), policy, GenerationStats("ngram", "auto")))
        for policy in policies
    ]
    while engine.running:
        engine.step()
    return [run.ids[len(prompt) :] for run in runs]


def test_a_request_joining_after_a_wait_times_no_wait_as_a_rounds_rest(stories):
    """The rest of a round is timed between two forwards of draft rounds: a request admitted after an idle
    wait (here its whole prompt in the cache already, so that its first step is a draft round) times none."""
    model, tokenizer = stories
    engine = SpeculativeEngine(model)
    config = EngineConfig(max_new_tokens=12, sampling=SamplingParams(temperature=0))
    prompt = tokenizer.encode("Once upon a time, there was a little dog. The little dog")
    first = engine.submit(
        Request(prompt, config, NGramDrafter(), ConstantK(2), GenerationStats("ngram", "2"))
    )
    while engine.running:
        engine.step()
    time.sleep(0.3)  # idle: no round's
    policy = Recording(CostModel(0.01, MEASURED), online=OnlineCosts())
    again = first.ids[:-1]  # all but the last in the cache: the first step scores a draft round at once
    engine.submit(Request(again, config, NGramDrafter(), policy, GenerationStats("ngram", "auto")))
    while engine.running:
        engine.step()
    assert policy.timings and policy.timings[0].forward.overhead is None
    assert all(t.forward.overhead is not None and t.forward.overhead < 0.3 for t in policy.timings[1:])


def test_the_engine_hands_each_rounds_timings_and_the_output_is_unchanged(stories):
    prior = CostModel(0.01, MEASURED)
    online = OnlineCosts()
    alone = Recording(prior, online=online)
    (tokens,) = decode(stories, [alone])
    assert tokens == decode(stories, [CostModelK(prior)])[0] == decode(stories, [ConstantK(0)])[0]
    assert alone.timings and online.step is not None  # every round after the prompt's, timed
    for each in alone.timings:
        assert each.forward.rows == 1 and each.forward.seconds > 0 and each.forward.tokens == each.drafted + 1
        assert each.draft_seconds >= 0 and each.context == each.forward.context
    # the rest of each round, timed from the second round on (the first follows the prompt's chunk)
    assert alone.timings[0].forward.overhead is None
    assert all(each.forward.overhead is not None for each in alone.timings[1:])
    assert online.overhead > 0
    assert any(each.drafted for each in alone.timings)
    pair = [Recording(prior, online=OnlineCosts()) for _ in range(2)]
    assert decode(stories, pair) == [tokens, tokens]  # rows of one batch: their own output
    first, second = ([t.forward for t in each.timings if t.forward.rows == 2] for each in pair)
    assert first and all(a is b for a, b in zip(first, second, strict=True))  # one object per forward


def test_a_prior_whose_curve_falls_at_its_end_never_predicts_a_negative_forward():
    """A probe timed on a busy machine can end lower than it was (here v(16) < v(15): it was cached with its
    drift). A forward of more tokens than the curve holds (a grammar's forced run) was predicted by extending
    its last segment, falling below zero: a negative slowdown, then a corrected v(16) < 0 refused as a
    UsageError in the middle of a request. Extended by a falling segment no more, the forward costs at least
    v(16) and every corrected cost stays positive."""
    falling = CostModel(0.01, [1.0, *(1.0 + 0.2 * k for k in range(1, 15)), 0.5])  # v(15) = 3.8, v(16) = 0.5
    online = OnlineCosts()
    policy = CostModelK(falling, online=online)
    for _ in range(3):
        for tokens in (1, 25):
            policy.observe_costs(timing(tokens, 0.01 * tokens))
    corrected = online.correct(falling)
    assert all(corrected.verify(k) > 0 for k in range(1, 17))
    assert 0 <= policy.next_k(100) <= 15

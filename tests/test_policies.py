"""K policies: the cost-model policy (``--k auto``) picks the analytically optimal K on synthetic cost curves,
K = 0 where speculation does not pay, probes while at K = 0, and follows a changing acceptance rate."""

import math

import numpy as np
import pytest

from verispec.api import k_policy
from verispec.costs.analytic import BatchCost, CostModel, tokens_by_k
from verispec.costs.online import ForwardTiming, OnlineCosts, RoundTiming
from verispec.costs.policies import (
    CONTEXT_STEP,
    AdditiveK,
    AutoKConfig,
    ConstantK,
    CostModelK,
    Evidence,
    PartsK,
    TreeGate,
    _forward_cost,
    plan_batch,
)
from verispec.options import DraftLength

K_MAX = 12
FLAT = [1.0] * (K_MAX + 1)  # memory-bound: verifying K+1 tokens costs one step
LINEAR = [1.0 + 0.08 * k for k in range(K_MAX + 1)]  # v(k) = 1 + 0.08 (k − 1)
MEASURED = [1.0, 1.13, 1.2, 1.13, 1.11, 1.15, 1.23, 1.25, 1.26, 1.29, 1.31, 1.32, 1.39]  # a CPU's, k = 1..13
STEEP = [1.0 + 0.5 * k for k in range(K_MAX + 1)]  # compute-bound: every extra token costs half a step


def speeds(alpha: float, c: float, v: list[float], fixed: float = 0.0) -> list[float]:
    """(1 − α^{K+1}) / (1 − α) / (v(K+1) + K·c + c₀ [K > 0]) for every K: the textbook formula, computed
    independently of verispec.costs.analytic."""
    return [
        (1 - alpha ** (k + 1)) / (1 - alpha) / (v[k] + k * c + (fixed if k else 0.0)) for k in range(len(v))
    ]


def brute_force_k(alpha: float, c: float, v: list[float], fixed: float = 0.0) -> int:
    """argmax_K of :func:`speeds`."""
    speed = speeds(alpha, c, v, fixed)
    return speed.index(max(speed))


def policy_at(alpha: float, c: float, v: list[float], fixed: float = 0.0, **config) -> CostModelK:
    """A policy whose estimate is exactly α: a Beta(α, 1 − α) prior and no evidence yet."""
    return CostModelK(CostModel(c, v, fixed_cost=fixed), AutoKConfig(prior=(alpha, 1 - alpha), **config))


@pytest.mark.parametrize("v", [FLAT, LINEAR, MEASURED, STEEP], ids=["flat", "linear", "measured", "steep"])
@pytest.mark.parametrize("c", [0.0, 0.01, 0.1, 0.3, 0.9])
@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.6, 0.8, 0.9, 0.97])
@pytest.mark.parametrize("fixed", [0.0, 0.15])
def test_picks_the_analytically_optimal_k(v, c, alpha, fixed):
    policy = policy_at(alpha, c, v, fixed)
    np.testing.assert_allclose(policy.alphas, alpha)
    chosen, best = policy.next_k(), brute_force_k(alpha, c, v, fixed)
    speed = speeds(alpha, c, v, fixed)
    assert chosen == best or speed[chosen] == pytest.approx(speed[best], rel=1e-12)  # or a tie to rounding


def test_worked_examples():
    # α = 0.8, c = 0.05, v(k) = 1 + 0.08 (k − 1): E[L] / (1 + 0.13 K) is 2.212, 2.236, 2.220 at K = 4, 5, 6.
    assert policy_at(0.8, 0.05, LINEAR).next_k() == 5
    # The measured CPU curve with an n-gram lookup (c ≈ 0) at α = 0.9: K = 11 (7.18 / 1.32 = 5.44) beats
    # K = 12 (7.46 / 1.39 = 5.37), where the curve steps up.
    assert policy_at(0.9, 0.0, MEASURED).next_k() == 11
    # A draft costing 0.9 of a target step never pays at α = 0.3: plain decoding.
    assert policy_at(0.3, 0.9, MEASURED).next_k() == 0
    # A proposal's fixed part c₀ is paid once whatever K, so it lengthens the best draft: α = 0.7, c = 0.15
    # and v(k) = 1 + 0.08 (k − 1): K = 2 without it (2.19 / 1.46 = 1.500 against K = 3's 2.533 / 1.69 =
    # 1.499), K = 3 with c₀ = 0.3 (2.533 / 1.99 = 1.273 against K = 2's 2.19 / 1.76 = 1.244).
    assert policy_at(0.7, 0.15, LINEAR).next_k() == 2
    assert policy_at(0.7, 0.15, LINEAR, fixed=0.3).next_k() == 3
    # ... and makes plain decoding pay sooner: α = 0.6, c = 0.2, c₀ = 0.6 (K = 2: 1.96 / 2.16 = 0.907).
    assert policy_at(0.6, 0.2, LINEAR).next_k() == 2 and policy_at(0.6, 0.2, LINEAR, fixed=0.6).next_k() == 0


def test_parts_k_gives_each_part_its_own_k_and_its_own_rounds():
    """A drafter of parts (a lookup first, a head elsewhere): the engine's question gets the cap; the part
    that drafts gets its own policy's K (here a free lookup right at 0.9 drafts long, a head costing half a
    step right at 0.3 does not draft), and each round's verdict reaches only the policy of the part that
    drafted it; a round no part was asked for (no room) reaches none."""
    lookup, head = policy_at(0.9, 0.0, MEASURED), policy_at(0.3, 0.5, MEASURED)
    parts = PartsK({"lookup": lookup, "head": head})  # the cap: the parts' largest k_max
    assert parts.next_k(10) == K_MAX
    assert parts.part_k("lookup", 10) == policy_at(0.9, 0.0, MEASURED).next_k(10) == 11
    parts.observe(11, 2)
    assert lookup.alphas[0] > 0.9 and lookup.alphas[2] < 0.9 and head.alphas[0] == pytest.approx(0.3)
    assert parts.next_k(13) == K_MAX and parts.part_k("head", 13) == 0
    parts.observe(0, 0)
    before = (lookup.alphas.copy(), head.alphas.copy())
    parts.next_k(14)
    parts.observe(3, 0)  # no part asked this round: its verdict is nobody's
    assert np.array_equal(lookup.alphas, before[0]) and np.array_equal(head.alphas, before[1])


def test_plain_decoding_when_speculation_does_not_pay_then_probes_within_the_budget():
    cost = CostModel(0.5, MEASURED)
    policy = policy_at(0.2, 0.5, MEASURED, probe_budget=0.05)
    ks = [policy.next_k() for _ in range(100)]  # no verdicts come back: the estimates stay at 0.2
    probes = [i for i, k in enumerate(ks) if k]
    # the best K > 0 is 1: a loss of v(2) + c − E[L] = 1.13 + 0.5 − 1.2 = 0.43 step, so ⌈0.43 / 0.05⌉ = 9
    # plain rounds come between probes
    assert set(ks) == {0, 1} and probes == list(range(9, 100, 10))
    loss = cost.round_cost(1) - 1.2
    assert len(probes) * loss <= 0.05 * ks.count(0)  # the probes' expected loss is within the budget
    cheap = policy_at(0.02, 0.0, MEASURED, probe_budget=0.05)  # an n-gram lookup probes every few rounds
    ks = [cheap.next_k() for _ in range(30)]
    assert 5 <= sum(k > 0 for k in ks) <= 10 and max(ks) > 1  # its best K > 0 is longer than one token


def test_a_drafters_catch_up_is_paid_by_the_round_that_drafts():
    """A drafter that keeps state of the context (u per position it has not read) reads the positions
    committed since it last drafted before it drafts again: probes wait until the plain rounds' budget covers
    that too, a catch-up that outgrows the budget stops probing, and every choice prices it for K > 0."""

    def probes(u: float, rounds: int = 100) -> list[int]:
        policy = CostModelK(
            CostModel(0.5, MEASURED, catch_up=u), AutoKConfig(prior=(0.2, 0.8), probe_budget=0.05)
        )
        return [i for i in range(rounds) if policy.next_k(100 + i)]  # a plain round commits one token

    assert probes(0.0) == list(range(9, 100, 10))  # no catch-up: as in the test above, whatever the context
    lagging = probes(0.01)
    # the first probe also reads the 100-token prompt: 0.43 + (100 + i)·0.01 steps within 0.05 per plain round
    assert lagging[0] == next(i for i in range(100) if i + 1 > math.ceil((0.43 + (100 + i) * 0.01) / 0.05))
    gaps = np.diff(lagging)  # then only the positions committed since the last probe
    assert len(gaps) >= 3 and all(g == gaps[0] for g in gaps) and gaps[0] > 10
    spent = 0.43 * len(lagging) + 0.01 * (lagging[0] + 100 + sum(gaps))
    assert spent <= 0.05 * (100 - len(lagging))  # the probes' expected loss, catch-up included, in budget
    assert probes(0.05, rounds=1000) == []  # u at the budget: probing could never pay for itself

    policy = CostModelK(CostModel(0.05, MEASURED, catch_up=0.1), AutoKConfig(prior=(0.8, 0.2)))
    assert policy.backlog(1000) == 1000 and policy.next_k(1000) == 0  # a long prompt to read first: not yet
    policy.drafts_at(1000)  # a round drafted there
    assert policy.backlog(1000) == 0 and policy.backlog(1003) == 3 and policy.next_k(1001) > 0


def test_a_drafter_reading_its_last_positions_only_pays_for_those():
    """A drafter whose catch-up reads at most ``catch_up_limit`` unread positions (a learned head's window):
    a long prompt costs it that many, so it drafts where one reading them all waits, and its rounds' timings
    are set against the positions it read."""
    config = AutoKConfig(prior=(0.8, 0.2))
    reading_all = CostModelK(CostModel(0.05, MEASURED, catch_up=0.1), config)
    windowed = CostModelK(CostModel(0.05, MEASURED, catch_up=0.1, catch_up_limit=8), config)
    assert reading_all.backlog(1000) == 1000 and reading_all.next_k(1000) == 0  # 100 steps to read first
    assert windowed.backlog(1000) == 8 and windowed.next_k(1000) > 0  # 0.8 of a step
    assert windowed.backlog(1003) == 3 and windowed.backlog(1100) == 8  # after it drafted at 1000
    online = OnlineCosts()
    policy = CostModelK(CostModel(0.05, MEASURED, catch_up=0.1, catch_up_limit=8), config, online=online)
    spent: list[float] = []
    online.observe = lambda timing, forward, draft: spent.append(draft)  # type: ignore[method-assign]
    assert policy.next_k(1000) > 0
    forward = ForwardTiming(1, 2, 0.01, 1000)
    policy.observe_costs(RoundTiming(forward, 1, 0.001, 1000))
    assert spent == [pytest.approx(policy.cost.draft_cost(1) + 8 * 0.1)]  # not 1000 positions' worth
    with pytest.raises(ValueError, match="catch_up_limit must be an integer >= 1"):
        CostModel(0.05, MEASURED, catch_up_limit=0)


def test_a_catch_up_that_the_next_rounds_repay_is_paid_at_once():
    """Where drafting pays once caught up, a backlog that the gain of the next `amortize` rounds covers is
    read at once: waiting would only lengthen it (the trap a round-by-round price falls into: the shipped
    EAGLE head spent up to 16 plain rounds at the start of each math request here, its prompt's catch-up
    priced against one round). One the gain does not cover still waits, as before."""
    for amortize, drafts in ((16, True), (1, False)):
        policy = CostModelK(
            CostModel(0.05, MEASURED, catch_up=0.01), AutoKConfig(prior=(0.8, 0.2), amortize=amortize)
        )
        tokens, costs = tokens_by_k(policy.alphas), policy.cost.round_costs(policy.k_max)  # [k_max + 1]
        steady = int(np.argmax(tokens / costs))
        gain = float(tokens[steady] - costs[steady])  # what a round at the best K saves, caught up
        assert steady > 0 and 1 * gain < 0.01 * 300 <= 16 * gain  # a 300-token prompt: 3 steps to read
        assert (policy.next_k(300) > 0) == drafts, amortize
    with pytest.raises(ValueError, match="amortize must be an integer >= 1"):
        AutoKConfig(amortize=0)


def test_follows_a_changing_acceptance_rate():
    policy = CostModelK(CostModel(0.05, MEASURED), AutoKConfig(memory=0.9, probe_budget=0.1))
    assert policy.next_k() > 0  # the prior, 0.5 at every position, pays with a cheap draft
    for _ in range(20):  # a stretch where every draft token is accepted
        k = policy.next_k()
        policy.observe(k, k)
    assert policy.alphas[0] > 0.9 and policy.next_k() >= 10
    shrinking = []
    while policy.next_k() > 0:  # then every first draft token is rejected: K shrinks to 0
        shrinking.append(policy.next_k())
        policy.observe(shrinking[-1], 0)
    assert shrinking[-1] < shrinking[0] and len(shrinking) <= 30 and policy.alphas[0] < 0.2
    ks = []
    for _ in range(30):  # the acceptance recovers: the probes see it and K grows again
        k = policy.next_k()
        policy.observe(k, k)
        ks.append(k)
    assert min(i for i, k in enumerate(ks) if k) <= 3  # cheap probes come soon
    assert ks[-1] >= 10


def test_acceptance_that_rises_along_the_draft_favours_longer_drafts():
    """A first guess right 30% of the time, the next ones 90% when it is: copying. The per-position estimate
    drafts long; a single rate (0.3 everywhere) would draft less."""
    policy = CostModelK(CostModel(0.0, MEASURED), AutoKConfig(memory=1.0))
    for _ in range(100):  # 3 rounds in 10 copy 8 tokens; the others fail at once
        for accepted in (8, 0, 0, 8, 0, 0, 8, 0, 0, 0):
            policy.observe(8, accepted)
    np.testing.assert_allclose(policy.alphas[:2], [0.3, 1.0], atol=0.01)
    assert policy.next_k() >= 8 > brute_force_k(0.3, 0.0, MEASURED)


def test_the_estimates_are_beta_posteriors_of_the_tested_positions():
    policy = CostModelK(CostModel(0.0, FLAT), AutoKConfig(prior=(1.0, 1.0), memory=1.0))
    for drafted, accepted in [(4, 4), (4, 1), (3, 0), (0, 0), (2, 2)]:  # (0, 0) carries no evidence
        policy.observe(drafted, accepted)
    # position 1: accepted in 3 rounds, rejected in 1; position 2: 2 and 1; positions 3 and 4: 1 and 0. The
    # prior of a position is centred on the estimate before it when that is above 0.5 (a strength of 2).
    a1 = (3 + 1) / (4 + 2)
    a2 = (2 + 2 * a1) / (3 + 2)
    a3 = (1 + 2 * a2) / (1 + 2)
    a4 = (1 + 2 * a3) / (1 + 2)
    np.testing.assert_allclose(policy.alphas[:5], [a1, a2, a3, a4, a4])
    decaying = CostModelK(CostModel(0.0, FLAT), AutoKConfig(prior=(1.0, 1.0), memory=0.5))
    decaying.observe(4, 0)  # position 1 rejected: then halved by its next verdict
    decaying.observe(4, 4)
    assert decaying.alphas[0] == pytest.approx((1 + 1) / (0.5 + 1 + 2))
    assert decaying.alphas[1] == pytest.approx((1 + 2 * 4 / 7) / (1 + 2))  # tested once, prior at α̂_1


def test_a_request_starts_from_the_evidence_shared_by_earlier_ones():
    """Shared evidence: a new policy's estimates start where the shared verdicts left them (the prior only
    where none was shared); each verdict goes to the policy's own and to the shared evidence, and a policy's
    own evidence is not changed by another's verdicts (all of it carried over here: below, a few verdicts)."""
    config = AutoKConfig(memory=0.9, carried=math.inf)
    shared = Evidence(K_MAX)
    first = CostModelK(CostModel(0.0, MEASURED), config, shared=shared)
    alone = CostModelK(CostModel(0.0, MEASURED), config)
    np.testing.assert_allclose(first.alphas, alone.alphas)  # nothing shared yet: the prior
    for drafted, accepted in [(4, 4), (4, 1), (3, 0), (0, 0), (6, 6), (2, 0)]:
        first.observe(drafted, accepted)
        alone.observe(drafted, accepted)
    np.testing.assert_allclose(first.alphas, alone.alphas)  # sharing changes nothing of its own estimates
    second = CostModelK(CostModel(0.0, MEASURED), config, shared=shared)
    np.testing.assert_allclose(second.alphas, first.alphas)  # starts where the first one's verdicts left it
    before = first.alphas.copy()
    for _ in range(5):
        second.observe(4, 0)
    np.testing.assert_allclose(first.alphas, before)  # its own evidence: not the other request's verdicts
    third = CostModelK(CostModel(0.0, MEASURED), config, shared=shared)
    np.testing.assert_allclose(third.alphas, second.alphas)  # both requests' verdicts, in their order
    assert third.alphas[0] < before[0]


def test_a_workloads_evidence_starts_a_request_as_a_few_verdicts():
    """A head that agreed 5 % of the time on a workload's earlier requests (code) and agrees 70 % on this one
    (arithmetic): the request starts from the workload's rate, weighed as `carried` verdicts per position, so
    its own first probes soon say it pays and it drafts; carried whole (~10 decayed verdicts), it was still
    at K = 0 after as many probes, as measured (the EAGLE head on math after summarization and code editing:
    1.01–1.05× `none`, against 1.4–1.6× on math alone)."""

    def workload() -> Evidence:  # 40 rounds, two first tokens accepted
        shared = Evidence(K_MAX)
        for i in range(40):
            shared.add(1, int(i % 20 == 0), 0.9)
        return shared

    cost = CostModel(0.2, MEASURED)  # a learned head's cost
    for carried, drafts in ((4.0, True), (math.inf, False)):
        policy = CostModelK(cost, AutoKConfig(carried=carried), shared=workload())
        assert policy.alphas[0] < 0.15 and policy.next_k() == 0
        for _ in range(3):  # three probes, each first token accepted
            policy.observe(1, 1)
        assert (policy.next_k() > 0) == drafts, carried
    shared = workload()
    copy = shared.copy(K_MAX, 4.0)
    total = copy.accepted + copy.rejected
    assert total[0] == pytest.approx(4.0) and copy.accepted[0] / total[0] == pytest.approx(
        shared.accepted[0] / (shared.accepted[0] + shared.rejected[0])
    )
    assert total[1:].sum() == 0.0  # nothing at positions never tested


def test_evidence_copies_fit_the_size_asked():
    evidence = Evidence(3)
    evidence.add(3, 2, 0.5)
    evidence.add(3, 3, 0.5)
    np.testing.assert_allclose(evidence.accepted, [1.5, 1.5, 1.0])
    np.testing.assert_allclose(evidence.rejected, [0.0, 0.0, 0.5])
    longer, shorter = evidence.copy(5), evidence.copy(2)
    np.testing.assert_allclose(longer.accepted, [1.5, 1.5, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(shorter.rejected, [0.0, 0.0])
    longer.add(5, 5, 1.0)
    np.testing.assert_allclose(evidence.accepted, [1.5, 1.5, 1.0])  # a copy: the original is untouched


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(prior=(0.0, 1.0)), "prior"),
        (dict(prior=(1.0, math.inf)), "prior"),
        (dict(memory=0.0), "memory"),
        (dict(carried=0.0), "carried"),
        (dict(memory=1.5), "memory"),
        (dict(probe_budget=0), "probe_budget"),
        (dict(probe_budget=True), "probe_budget"),
        (dict(k_max=-1), "k_max"),
        (dict(k_max=True), "k_max"),
    ],
)
def test_config_validation(config, message):
    with pytest.raises(ValueError, match=message):
        AutoKConfig(**config)


def test_k_max_bounds_and_unbounded_curves():
    assert policy_at(0.99, 0.0, MEASURED, k_max=5).next_k() == 5
    with pytest.raises(ValueError, match="k_max"):
        CostModelK(CostModel(0.0, None))  # v ≡ 1 has no end: a k_max is needed
    assert CostModelK(CostModel(0.0, None), AutoKConfig(prior=(99, 1), k_max=7)).next_k() == 7


def test_parse_k_and_k_policy():
    assert (
        DraftLength.parse("4") == DraftLength(fixed=4)
        and DraftLength.parse(3) == DraftLength(fixed=3)
        and DraftLength.parse("auto").auto
        and DraftLength.parse("additive") == DraftLength(named="additive")
    )
    assert [str(DraftLength.parse(k)) for k in ("04", 0, "auto")] == ["4", "0", "auto"]  # as stats read
    for bad in ("x", "-1", "4.5", -2, True, "65", 65, 10**4000):
        with pytest.raises(ValueError, match="k must be"):
            DraftLength.parse(bad)
    assert DraftLength.parse("64") == DraftLength(fixed=64)  # a round's most, as every door takes it
    assert DraftLength.parse(None) == DraftLength(named="auto")  # k=None: the default
    assert isinstance(k_policy("5"), ConstantK) and isinstance(k_policy("additive"), AdditiveK)
    assert isinstance(k_policy("auto", CostModel(0.1, MEASURED)), CostModelK)
    with pytest.raises(ValueError, match="cost model"):
        k_policy("auto")


def test_the_round_costs_follow_the_context():
    """With costs that depend on the context (attention grows with it, verification blocks faster), the
    policy re-plans when the context moves to another step, and drafts what the costs there favour."""
    asked: list[int] = []

    def costs_at(context: int) -> CostModel:
        asked.append(context)
        return CostModel(0.0, FLAT if context < 1000 else STEEP)

    policy = CostModelK(CostModel(0.0, FLAT), AutoKConfig(prior=(0.6, 0.4)), costs_at=costs_at)
    short = policy.next_k(100)
    assert short == brute_force_k(0.6, 0.0, FLAT) and asked == [64]  # the middle of the step [0, 128)
    assert policy.next_k(120) == short and asked == [64]  # the same step: nothing re-derived
    assert policy.next_k(2000) == brute_force_k(0.6, 0.0, STEEP) < short
    assert asked == [64, 2000 // CONTEXT_STEP * CONTEXT_STEP + CONTEXT_STEP // 2]
    fixed = CostModelK(CostModel(0.0, FLAT), AutoKConfig(prior=(0.6, 0.4)))  # no costs_at: FLAT holds
    assert fixed.next_k(2000) == short


# a forward's cost over n new tokens on a 4-bit CPU target (measured, n = 1..16): cheap extra tokens at first,
# then nearly what a token step costs
BATCH_CURVE = [1.0, 1.18, 1.40, 1.58, 1.80, 1.94, 2.14, 2.27, 2.60, 2.88, 3.06, 3.03, 3.35, 3.47, 3.64, 3.95]


def test_batch_plan_is_the_single_policy_alone_and_turns_speculation_off_under_load():
    def plan(rows: int, alpha: float = 0.8) -> list[int]:
        policies = [policy_at(alpha, 0.01, BATCH_CURVE) for _ in range(rows)]
        return plan_batch(policies, [100] * rows, [15] * rows)

    assert plan(1) == [policy_at(0.8, 0.01, BATCH_CURVE).next_k(100)]  # batch 1: today's rule
    assert sum(plan(2)) > 0  # two rows: extra tokens are still cheap
    assert plan(8) == [0] * 8  # eight rows already fill the forward: no drafts
    assert sum(plan(2)) > 0  # the load drops: drafts again, no threshold involved
    assert sum(plan(4, alpha=0.99)) > 0  # near-certain drafts pay at four rows
    mixed = plan_batch(
        [policy_at(0.95, 0.01, BATCH_CURVE), policy_at(0.1, 0.01, BATCH_CURVE)], [50, 50], [15, 15]
    )
    assert mixed[0] > 0 and mixed[1] == 0  # the tokens go to the row that accepts them
    assert plan_batch([policy_at(0.95, 0.01, BATCH_CURVE)] * 2, [50, 50], [1, 0]) == [1, 0]  # rooms cap


def test_the_batch_plan_prices_each_rows_catch_up():
    """Of two rows alike but for what their drafters have read, the one that would first read a long context
    does not draft; the plan's drafting rows have then read theirs."""
    config = AutoKConfig(prior=(0.95, 0.05))
    fresh, current = (CostModelK(CostModel(0.01, BATCH_CURVE, catch_up=0.01), config) for _ in range(2))
    current.drafts_at(499)
    ks = plan_batch([fresh, current], [500, 500], [7, 7])
    assert ks[0] == 0 and ks[1] > 0
    assert fresh.backlog(500) == 500 and current.backlog(500) == 0 and current.backlog(501) == 1
    alike = [CostModelK(CostModel(0.01, BATCH_CURVE), config) for _ in range(2)]  # no catch-up: both draft
    assert all(k > 0 for k in plan_batch(alike, [500, 500], [7, 7]))


def _batch_grid(cost) -> BatchCost:
    """A batch grid over rows 1..16 and tokens per row 1..8 from ``cost(b, m)``."""
    rows, tokens = (1, 2, 4, 8, 16), (1, 2, 4, 8)
    return BatchCost(rows, tokens, tuple(tuple(cost(b, m) for m in tokens) for b in rows))


def _curve(n: int) -> float:
    """BATCH_CURVE, extended past 16 tokens by its last slope."""
    last = len(BATCH_CURVE)
    return (
        BATCH_CURVE[n - 1]
        if n <= last
        else BATCH_CURVE[-1] + (n - last) * (BATCH_CURVE[-1] - BATCH_CURVE[-2])
    )


def test_the_batch_plan_prices_rows_by_the_calibrated_grid():
    """Rows that share one forward share the weights' reads: their new tokens fill it, and speculation stops;
    rows scored one after another (a target whose rows cannot be scored together) each pay their own
    forward, so each keeps drafting as it would alone; rows whose caches are dear to read (a long context)
    make a forward dearer whatever is drafted, so drafts are relatively cheaper there."""
    shared = _batch_grid(lambda b, m: _curve(b * m))  # one forward of b·m tokens, whatever the rows
    one_by_one = _batch_grid(lambda b, m: b * _curve(m))
    long_context = _batch_grid(lambda b, m: _curve(b * m) + 0.6 * (b - 1))  # each extra row: its own cache

    def plan(rows: int, grid: BatchCost) -> list[int]:
        config = AutoKConfig(prior=(0.8, 0.2))
        policies = [
            CostModelK(CostModel(0.01, BATCH_CURVE), config, batch_costs_at=lambda context: grid)
            for _ in range(rows)
        ]
        return plan_batch(policies, [100] * rows, [7] * rows)

    alone = policy_at(0.8, 0.01, [one_by_one.forward(1, n) for n in range(1, 9)]).next_k(100)  # its own line
    assert plan(16, shared) == [0] * 16  # sixteen rows fill the shared forward
    assert plan(16, one_by_one) == [alone] * 16  # separate forwards: every row drafts as it would alone
    assert sum(plan(4, long_context)) > sum(plan(4, shared))  # the rows' cache reads make tokens worth more
    assert plan(1, shared) == [policy_at(0.8, 0.01, BATCH_CURVE).next_k(100)]  # batch 1: today's rule


def test_a_batch_forward_is_never_priced_below_one_row_of_its_tokens():
    """A grid whose extension past its widest rows falls (a busy machine's timing: 4 tokens a row cheaper
    than 2) is held up by what one row of the same tokens costs (the single-row curve): rows share the
    weights' reads, each reads its own cache, so b rows cost more than one row of their tokens. The plan
    then drafts no more than with a grid that does not fall."""
    falling = BatchCost((1, 2), (1, 2, 4), ((1.0, 1.3, 1.2), (1.2, 1.4, 1.6)))
    assert falling.forward(1, 16) == pytest.approx(1.0)  # extended by its falling segment, to its floor
    cost = CostModel(0.01, BATCH_CURVE)
    assert _forward_cost(cost, falling, 1, 16) == pytest.approx(BATCH_CURVE[15])
    assert _forward_cost(cost, falling, 2, 2) == pytest.approx(falling.forward(2, 2))  # dearer than one row
    assert _forward_cost(cost, None, 1, 20) == pytest.approx(_curve(20))  # no grid: the curve, extended
    config = AutoKConfig(prior=(0.95, 0.05))

    def plan(grid: BatchCost) -> list[int]:
        policies = [CostModelK(cost, config, batch_costs_at=lambda context: grid) for _ in range(2)]
        return plan_batch(policies, [100, 100], [15, 15])

    steady = BatchCost((1, 2), (1, 2, 4), ((1.0, 1.3, 1.6), (1.2, 1.4, 1.6)))
    assert sum(plan(falling)) <= sum(plan(steady))


def test_the_batch_plan_maximises_the_rate_on_small_batches():
    """On two rows and K ≤ 4 the greedy plan reaches the best rate of every allocation (brute force)."""
    for a, b in [(0.9, 0.2), (0.6, 0.6), (0.3, 0.95)]:
        policies = [policy_at(a, 0.05, BATCH_CURVE), policy_at(b, 0.05, BATCH_CURVE)]
        ks = plan_batch(policies, [10, 10], [4, 4])

        def rate(k1: int, k2: int, a: float = a, b: float = b) -> float:
            tokens = sum((1 - x ** (k + 1)) / (1 - x) for x, k in ((a, k1), (b, k2)))
            return tokens / (BATCH_CURVE[k1 + k2 + 1] + 0.05 * (k1 + k2))

        best = max(rate(i, j) for i in range(5) for j in range(5))
        assert rate(*ks) == pytest.approx(best, rel=1e-9)


def gate_run(gate: TreeGate, rounds: int, tree: tuple[int, float], plain: tuple[int, float]) -> list[bool]:
    """``rounds`` rounds of ``gate``, a tree round committing tree[0] tokens in tree[1] seconds and a plain
    one plain[0] in plain[1]; whether each drafted its tree."""
    ways = []
    for _ in range(rounds):
        drafted = gate.tree_round()
        assert gate.next_k() == int(drafted)
        tokens, seconds = tree if drafted else plain
        gate.observe_tree(drafted, tokens, seconds)
        ways.append(drafted)
    return ways


def plain_rounds(ways: list[bool]) -> list[int]:
    return [i for i, drafted in enumerate(ways) if not drafted]


def test_tree_gate_keeps_trees_that_pay_probing_plain_rounds_ever_less_often():
    """Trees at 300 tokens/s against plain rounds' 200: tree rounds, with probes of 4 plain rounds after 8
    rounds, then 32, 64, 128 ... rounds apart."""
    ways = gate_run(TreeGate(), 8 + 32 + 64 + 128 + 20, tree=(3, 0.01), plain=(1, 0.005))
    starts = [8, 40, 104, 232]
    assert plain_rounds(ways) == [s + i for s in starts for i in range(4)]


def test_tree_gate_turns_to_plain_rounds_where_trees_lose_and_back_when_they_pay():
    """Trees at 100 tokens/s (a head whose guesses fail) against 200: plain rounds from the first probe
    on, trees probed 32 rounds later, then ever less often; trees that pay again are taken back."""
    gate = TreeGate()
    ways = gate_run(gate, 12, tree=(1, 0.01), plain=(1, 0.005))
    assert ways == [True] * 8 + [False] * 4 and not gate.drafting
    ways = gate_run(gate, 140 - 12, tree=(1, 0.01), plain=(1, 0.005))  # rounds 12-139
    trees = [12 + i for i, drafted in enumerate(ways) if drafted]
    assert trees == [*range(40, 44), *range(72, 76), *range(136, 140)] and not gate.drafting
    ways = gate_run(gate, 400, tree=(4, 0.01), plain=(1, 0.005))  # rounds 140-539: trees at 400 tokens/s
    assert gate.drafting and ways[-1]


@pytest.mark.parametrize(("tokens", "kept"), [(19, True), (17, False)])
def test_tree_gate_needs_the_margin_to_switch(tokens, kept):
    """Plain rounds at 200 tokens/s: trees at 190 are kept (within the 0.9 margin), at 170 they are not."""
    gate = TreeGate()
    gate_run(gate, 12, tree=(tokens, 0.1), plain=(1, 0.005))
    assert gate.drafting == kept


def test_tree_gate_is_not_swayed_by_one_slow_round():
    """One tree round slowed tenfold (a busy spell, the head reading a backlog) among trees at 300
    tokens/s against plain rounds' 200: the trees are kept (the rounds' median seconds)."""
    gate = TreeGate()
    gate.observe_tree(True, 3, 0.1)  # the first round: ten times the others
    gate_run(gate, 11, tree=(3, 0.01), plain=(1, 0.005))
    assert gate.drafting

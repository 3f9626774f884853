"""K policies: the cost-model policy (``--k auto``) picks the analytically optimal K on synthetic cost curves,
K = 0 where speculation does not pay, probes while at K = 0, and follows a changing acceptance rate."""

import math

import pytest

from verispec.analysis import CostModel
from verispec.api import k_policy, parse_k
from verispec.policies import AdditiveK, AutoKConfig, ConstantK, CostModelK

K_MAX = 12
FLAT = [1.0] * (K_MAX + 1)  # memory-bound: verifying K+1 tokens costs one step
LINEAR = [1.0 + 0.08 * k for k in range(K_MAX + 1)]  # v(k) = 1 + 0.08 (k − 1)
MEASURED = [1.0, 1.13, 1.2, 1.13, 1.11, 1.15, 1.23, 1.25, 1.26, 1.29, 1.31, 1.32, 1.39]  # a CPU's, k = 1..13
STEEP = [1.0 + 0.5 * k for k in range(K_MAX + 1)]  # compute-bound: every extra token costs half a step


def brute_force_k(alpha: float, c: float, v: list[float]) -> int:
    """argmax_K (1 − α^{K+1}) / (1 − α) / (v(K+1) + K·c): the textbook formula, computed independently of
    verispec.analysis."""
    speed = [(1 - alpha ** (k + 1)) / (1 - alpha) / (v[k] + k * c) for k in range(len(v))]
    return speed.index(max(speed))


def policy_at(alpha: float, c: float, v: list[float], **config) -> CostModelK:
    """A policy whose estimate is exactly α: a Beta(α, 1 − α) prior and no evidence yet."""
    return CostModelK(CostModel(c, v), AutoKConfig(prior=(alpha, 1 - alpha), **config))


@pytest.mark.parametrize("v", [FLAT, LINEAR, MEASURED, STEEP], ids=["flat", "linear", "measured", "steep"])
@pytest.mark.parametrize("c", [0.0, 0.01, 0.1, 0.3, 0.9])
@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.6, 0.8, 0.9, 0.97])
def test_picks_the_analytically_optimal_k(v, c, alpha):
    policy = policy_at(alpha, c, v)
    assert policy.alpha == pytest.approx(alpha)
    chosen, best = policy.next_k(), brute_force_k(alpha, c, v)
    speed = [(1 - alpha ** (k + 1)) / (1 - alpha) / (v[k] + k * c) for k in range(len(v))]
    assert chosen == best or speed[chosen] == pytest.approx(speed[best], rel=1e-12)  # or a tie to rounding


def test_worked_examples():
    # α = 0.8, c = 0.05, v(k) = 1 + 0.08 (k − 1): E[L] / (1 + 0.13 K) is 2.212, 2.236, 2.220 at K = 4, 5, 6.
    assert policy_at(0.8, 0.05, LINEAR).next_k() == 5
    # The measured CPU curve with an n-gram lookup (c ≈ 0) at α = 0.9: K = 11 (7.18 / 1.32 = 5.44) beats
    # K = 12 (7.46 / 1.39 = 5.37), where the curve steps up.
    assert policy_at(0.9, 0.0, MEASURED).next_k() == 11
    # A draft costing 0.9 of a target step never pays at α = 0.3: plain decoding.
    assert policy_at(0.3, 0.9, MEASURED).next_k() == 0


def test_plain_decoding_when_speculation_does_not_pay_then_probes_with_growing_gaps():
    policy = policy_at(0.2, 0.5, MEASURED, first_probe=3, max_probe_gap=8)
    ks = [policy.next_k() for _ in range(40)]  # no verdicts come back: α̂ stays at 0.2
    probes = [i for i, k in enumerate(ks) if k]
    assert set(ks) == {0, 1}
    assert probes == [3, 10, 19, 28, 37]  # after 3, then 6, then 8 (the cap) plain rounds
    assert sum(ks) / len(ks) < 0.15  # probing is a small share of the rounds


def test_follows_a_changing_acceptance_rate():
    policy = CostModelK(CostModel(0.05, MEASURED), AutoKConfig(memory=0.9, first_probe=4, max_probe_gap=4))
    assert policy.next_k() > 0  # the prior, α̂ = 0.5, pays with a cheap draft
    for _ in range(20):  # a stretch where every draft token is accepted
        k = policy.next_k()
        policy.observe(k, k)
    assert policy.alpha > 0.9 and policy.next_k() >= 10
    shrinking = []
    while policy.next_k() > 0:  # then every first draft token is rejected: K shrinks round by round
        shrinking.append(policy.next_k())
        policy.observe(shrinking[-1], 0)
    assert shrinking == sorted(shrinking, reverse=True) and len(shrinking) <= 20 and policy.alpha < 0.2
    ks = []
    for _ in range(30):  # the acceptance recovers: the probes see it and K grows again
        k = policy.next_k()
        policy.observe(k, k)
        ks.append(k)
    assert ks[:4] == [0, 0, 0, 1]  # the probe after 4 plain rounds (the while loop's last check was one)
    assert ks[-1] >= 10


def test_alpha_is_the_beta_posterior_of_accepted_tokens_and_rejections():
    policy = CostModelK(CostModel(0.0, FLAT), AutoKConfig(prior=(1.0, 1.0), memory=1.0))
    for drafted, accepted in [(4, 4), (4, 1), (3, 0), (0, 0), (2, 2)]:  # (0, 0) carries no evidence
        policy.observe(drafted, accepted)
    # accepted tokens 4 + 1 + 0 + 2 = 7; rejections 2 (the rounds that stopped short)
    assert policy.alpha == pytest.approx((1 + 7) / (2 + 7 + 2))
    decaying = CostModelK(CostModel(0.0, FLAT), AutoKConfig(prior=(1.0, 1.0), memory=0.5))
    decaying.observe(4, 0)  # one rejection: evidence (accepted 0, rejected 1)
    decaying.observe(4, 4)  # four acceptances, each halving what came before: 1.875 and 1/16
    assert decaying.alpha == pytest.approx((1 + 1.875) / (2 + 1.875 + 0.0625))


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(prior=(0.0, 1.0)), "prior"),
        (dict(prior=(1.0, math.inf)), "prior"),
        (dict(memory=0.0), "memory"),
        (dict(memory=1.5), "memory"),
        (dict(first_probe=0), "first_probe"),
        (dict(first_probe=8, max_probe_gap=4), "first_probe"),
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
        parse_k("4") == 4
        and parse_k(3) == 3
        and parse_k("auto") == "auto"
        and parse_k("additive") == "additive"
    )
    for bad in ("x", "-1", "4.5", -2):
        with pytest.raises(ValueError, match="k must be"):
            parse_k(bad)
    assert isinstance(k_policy("5"), ConstantK) and isinstance(k_policy("additive"), AdditiveK)
    assert isinstance(k_policy("auto", CostModel(0.1, MEASURED)), CostModelK)
    with pytest.raises(ValueError, match="cost model"):
        k_policy("auto")

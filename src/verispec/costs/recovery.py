"""How ``--k auto`` recovers from a wrong calibration: rounds of one sequence played against made-up true
costs, nothing timed (:func:`simulate_recovery`).

The policy (:class:`~verispec.costs.policies.CostModelK`) starts from a *prior* cost model, the calibration,
and learns the true costs from the timings of its rounds (:class:`~verispec.costs.online.OnlineCosts`), which
are made up from the *truth* cost model: a forward of m new tokens takes v(m) seconds (T(1) = 1 s), a proposal
of K tokens after g unread positions K·c + g·u seconds. Each draft position is accepted with probability α,
until the first rejection. A twin policy that knows the truth (no online costs) observes the same verdicts, so
that both hold the same acceptance estimates: its choice is the one the policy should reach.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from verispec.costs.analytic import CostModel, speedup_by_k
from verispec.costs.online import ForwardTiming, OnlineCosts, RoundTiming
from verispec.costs.policies import AutoKConfig, CostModelK
from verispec.errors import UsageError

__all__ = ["Recovery", "simulate_recovery"]


@dataclass(frozen=True)
class Recovery:
    """The rounds of a simulation: ks, the K each drafted; clean, the K the twin on the true costs chose
    there; rates, the expected tokens per unit of time of each round's K over the twin's, both under the true
    costs and the round's acceptance estimates; corrected, the policy's cost model after the last round."""

    ks: tuple[int, ...]
    clean: tuple[int, ...]
    rates: tuple[float, ...]
    corrected: CostModel

    def recovered(self, within: float = 0.05) -> int | None:
        """The first round from which every round's rate is within ``within`` of the twin's (None: not by
        the end)."""
        bad = [i for i, rate in enumerate(self.rates) if rate < 1 - within]
        first = bad[-1] + 1 if bad else 0
        return first if first < len(self.rates) else None


def simulate_recovery(
    prior: CostModel,
    truth: CostModel,
    alpha: float,
    rounds: int = 64,
    *,
    prior_step: float = 1.0,
    slow: Mapping[int, float] | None = None,
    config: AutoKConfig | None = None,
    prompt: int = 16,
    seed: int = 0,
) -> Recovery:
    """Play ``rounds`` rounds of a ``--k auto`` policy calibrated with ``prior`` (its T(1): ``prior_step``
    seconds) against the ``truth`` (see the module), after a ``prompt`` of that many positions; ``slow``:
    round → the factor its times are multiplied by (a preempted round). ``prior`` and ``truth`` must cost the
    same draft lengths."""
    if prior.max_k != truth.max_k or prior.max_k is None:
        raise UsageError("prior and truth must have verification curves of one finite length")
    online = OnlineCosts(lambda context: prior_step)
    policy = CostModelK(prior, config, online=online)
    twin = CostModelK(truth, config)
    true_costs = truth.round_costs(policy.k_max)  # [k_max + 1]
    rng = np.random.default_rng(seed)
    context, ks, clean, rates = prompt, [], [], []
    for r in range(rounds):
        backlog = policy.backlog(context)
        k, best = policy.next_k(context), twin.next_k(context)
        speedups = speedup_by_k(twin.alphas, true_costs)  # [k_max + 1]
        ks.append(k)
        clean.append(best)
        rates.append(float(speedups[k] / speedups[best]))
        accepted = int(np.argmin(np.append(rng.random(k) < alpha, False)))  # the leading accepted positions
        factor = (slow or {}).get(r, 1.0)
        forward = ForwardTiming(1, k + 1, factor * truth.verify(k + 1), context)
        drafting = factor * (truth.draft_cost(k) + backlog * truth.catch_up) if k else 0.0
        for each in (policy, twin):
            each.observe(k, accepted)
        policy.observe_costs(RoundTiming(forward, k, drafting, context))
        context += accepted + 1
    return Recovery(tuple(ks), tuple(clean), tuple(rates), policy.cost_here(context))

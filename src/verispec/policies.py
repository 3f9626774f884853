"""K policies: how many tokens to draft in each round, learned from the verdicts of earlier rounds.

The engine asks ``next_k()`` before each round and calls ``observe(drafted, accepted)`` after it; it caps the
answer by the tokens still allowed and the context left, so a policy never has to know about either.

:class:`CostModelK` (``--k auto``) chooses each round's K from a cost model of this machine (see
:mod:`verispec.calibrate`) and an online estimate of the acceptance rate, K = 0 included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from verispec.analysis import CostModel, speedup_by_k

__all__ = ["AdditiveK", "AutoKConfig", "ConstantK", "CostModelK", "KPolicy"]


class KPolicy:
    """Chooses the draft length of each round and learns from the verdicts."""

    name = "policy"

    def next_k(self) -> int:
        """The number of tokens to draft in the next round (0: plain decoding)."""
        raise NotImplementedError

    def observe(self, drafted: int, accepted: int) -> None:
        """The last round drafted ``drafted`` tokens, of which ``accepted`` were accepted."""


class ConstantK(KPolicy):
    """Always the same draft length."""

    def __init__(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        self.k = k
        self.name = str(k)

    def next_k(self) -> int:
        return self.k


class AdditiveK(KPolicy):
    """k grows by 2 after a fully accepted draft and shrinks by 1 otherwise, within [k_min, k_max]."""

    name = "additive"

    def __init__(self, k_start: int = 4, k_min: int = 1, k_max: int = 16) -> None:
        if not (isinstance(k_min, int) and isinstance(k_max, int) and 1 <= k_min <= k_start <= k_max):
            raise ValueError(f"need 1 <= k_min <= k_start <= k_max, got {k_min}, {k_start}, {k_max}")
        self.k, self.k_min, self.k_max = k_start, k_min, k_max

    def next_k(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        step = 2 if accepted == drafted else -1
        self.k = max(self.k_min, min(self.k_max, self.k + step))


@dataclass(frozen=True)
class AutoKConfig:
    """How :class:`CostModelK` estimates the acceptance rate and probes; validated with ValueError.

    prior: (accepted, rejected) pseudo-counts of the Beta prior on α (default Beta(0.5, 0.5): α̂ = 0.5 at
    first).
    memory: each verdict (an accepted position, or a rejection) multiplies the evidence before it by this
    (0 < memory ≤ 1; 1 keeps everything, 0.9 weighs roughly the last 10 verdicts), so that α̂ follows a
    changing α.
    first_probe, max_probe_gap: while K = 0 pays best, a one-token draft is still made after ``first_probe``
    plain rounds, then after twice as many, up to ``max_probe_gap`` (the gap resets when K > 0 pays again).
    k_max: the largest K to choose (None: as far as the cost model's verification curve goes).
    """

    prior: tuple[float, float] = (0.5, 0.5)
    memory: float = 0.9
    first_probe: int = 16
    max_probe_gap: int = 64
    k_max: int | None = None

    def __post_init__(self) -> None:
        if len(self.prior) != 2 or not all(
            isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in self.prior
        ):
            raise ValueError(f"prior must be two finite pseudo-counts > 0, got {self.prior!r}")
        if not (isinstance(self.memory, (int, float)) and 0 < self.memory <= 1):
            raise ValueError(f"memory must be a number in (0, 1], got {self.memory!r}")
        first, gap = self.first_probe, self.max_probe_gap
        if not (_is_int(first) and _is_int(gap) and 1 <= first <= gap):
            raise ValueError(f"need 1 <= first_probe <= max_probe_gap, got {first!r}, {gap!r}")
        if self.k_max is not None and not (_is_int(self.k_max) and self.k_max >= 0):
            raise ValueError(f"k_max must be an integer >= 0 or None, got {self.k_max!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class CostModelK(KPolicy):
    """``--k auto``: each round drafts the K that maximizes the expected tokens per unit of time,

        K* = argmax_{K = 0..k_max} E[L](α̂, K) / (v(K+1) + K·c)

    (:func:`verispec.analysis.speedup_by_k`; the smallest K on ties), where v and c are the calibrated costs
    of this target and drafter on this machine and α̂ is the posterior mean of a Beta prior updated with every
    verdict. A round that drafted d tokens of which a were accepted adds a accepted positions, and one
    rejection when a < d: under the model's independent acceptances that is the exact likelihood (positions
    after the first rejection are never tested, so counting them as rejected would bias α̂ low). Older
    evidence decays by ``memory`` per verdict. K = 0 (plain decoding) is a valid choice; as it yields no
    evidence, one token is still drafted after ``first_probe`` plain rounds, then after gaps that double up to
    ``max_probe_gap``: a probe costs at most v(2) + c − 1 step, so probing costs a few percent at most.
    """

    name = "auto"

    def __init__(self, cost: CostModel, config: AutoKConfig | None = None) -> None:
        if not isinstance(cost, CostModel):
            raise ValueError(f"cost must be a CostModel, got {type(cost).__name__}")
        self.config = config or AutoKConfig()
        k_max = self.config.k_max
        if k_max is None:
            if cost.max_k is None:
                raise ValueError("give AutoKConfig.k_max for a verification cost without a finite curve")
            k_max = cost.max_k
        self.cost = cost
        self._round_costs = cost.round_costs(k_max)  # [k_max + 1]: v(K+1) + K·c
        self._accepted = self._rejected = 0.0  # decayed evidence
        self._plain_rounds = 0  # consecutive rounds at K = 0 since the last draft
        self._probe_gap = self.config.first_probe
        self._best = (math.nan, 0)  # (α̂, its best K): the last decision

    @property
    def alpha(self) -> float:
        """α̂, the current estimate of the acceptance rate."""
        a0, r0 = self.config.prior
        return (a0 + self._accepted) / (a0 + r0 + self._accepted + self._rejected)

    def _best_k(self) -> int:
        """argmax_K of the expected speedup at the current α̂ (recomputed only when α̂ has changed)."""
        alpha = self.alpha
        if alpha != self._best[0]:
            self._best = (alpha, int(np.argmax(speedup_by_k(alpha, self._round_costs))))
        return self._best[1]

    def next_k(self) -> int:
        k = self._best_k()
        if k > 0:
            self._plain_rounds, self._probe_gap = 0, self.config.first_probe
            return k
        self._plain_rounds += 1
        if self._plain_rounds <= self._probe_gap:
            return 0
        self._plain_rounds = 0
        self._probe_gap = min(2 * self._probe_gap, self.config.max_probe_gap)
        return 1

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        memory = self.config.memory
        for verdict in [True] * accepted + [False] * (accepted < drafted):  # in the order they were made
            self._accepted = memory * self._accepted + verdict
            self._rejected = memory * self._rejected + (not verdict)

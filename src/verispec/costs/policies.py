"""K policies: how many tokens to draft in each round, learned from the verdicts of earlier rounds.

The engine asks ``next_k(context)`` before each round (``context``: the positions already committed) and calls
``observe(drafted, accepted)`` after it, and ``observe_costs(timing)`` with the round's timings; it caps the
answer by the tokens still allowed and the context left, so a policy never has to know about either.

:class:`CostModelK` (``--k auto``) chooses each round's K from a cost model of this machine (see
:mod:`verispec.costs.calibrate`), corrected by the rounds' own timings (:mod:`verispec.costs.online`), and an
online estimate of the acceptance rate, K = 0 included.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from verispec.costs.analytic import BatchCost, CostModel, tokens_by_k
from verispec.costs.online import OnlineCosts, RoundTiming
from verispec.errors import UsageError
from verispec.inputs import check_int
from verispec.kernels.threads import ProbeSchedule

__all__ = [
    "CONTEXT_STEP",
    "AdditiveK",
    "AutoKConfig",
    "ConstantK",
    "CostModelK",
    "Evidence",
    "KPolicy",
    "PartsK",
    "TreeGate",
    "plan_batch",
]

CONTEXT_STEP = 128  # CostModelK's round costs follow the context in steps of this many positions


class KPolicy:
    """Chooses the draft length of each round and learns from the verdicts."""

    name = "policy"

    def next_k(self, context: int = 0) -> int:
        """The number of tokens to draft in the next round (0: plain decoding), after ``context``
        committed positions."""
        raise NotImplementedError

    def observe(self, drafted: int, accepted: int) -> None:
        """The last round drafted ``drafted`` tokens, of which ``accepted`` were accepted."""

    def observe_costs(self, timing: RoundTiming) -> None:
        """What the last round cost: its forward's and its drafter's seconds (a step that scored no prompt
        chunk and no tree)."""

    def tree_round(self, context: int = 0) -> bool:
        """Whether a token-tree sequence drafts its tree in the next round (else a plain round: its last
        token scored alone), after ``context`` committed positions: always, but for :class:`TreeGate`."""
        return True

    def observe_tree(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A token-tree sequence's last round: whether it ``drafted`` its tree, the ``tokens`` it committed,
        and its ``seconds`` (the step's forward and its drafting)."""


class ConstantK(KPolicy):
    """Always the same draft length."""

    def __init__(self, k: int) -> None:
        check_int(k, "k", 0)
        self.k = k
        self.name = str(k)

    def next_k(self, context: int = 0) -> int:
        return self.k


class AdditiveK(KPolicy):
    """k grows by 2 after a fully accepted draft and shrinks by 1 otherwise, within [k_min, k_max]."""

    name = "additive"

    def __init__(self, k_start: int = 4, k_min: int = 1, k_max: int = 16) -> None:
        if not (isinstance(k_min, int) and isinstance(k_max, int) and 1 <= k_min <= k_start <= k_max):
            raise UsageError(f"need 1 <= k_min <= k_start <= k_max, got {k_min}, {k_start}, {k_max}")
        self.k, self.k_min, self.k_max = k_start, k_min, k_max

    def next_k(self, context: int = 0) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        step = 2 if accepted == drafted else -1
        self.k = max(self.k_min, min(self.k_max, self.k + step))


class Evidence:
    """Acceptance verdicts by draft position, each position's older ones decayed: the successes and failures
    :class:`CostModelK` reads its rates from. One is a request's own; another, shared by the requests of a
    speculator, drafter and sampling setting, is where a new request's estimates start (a server learns its
    workload's acceptance instead of starting every request from the prior)."""

    def __init__(self, size: int) -> None:
        self.accepted = np.zeros(size)  # [size] decayed successes at each position
        self.rejected = np.zeros(size)  # [size] decayed failures at each position

    def add(self, drafted: int, accepted: int, memory: float) -> None:
        """A round drafted ``drafted`` tokens and ``accepted`` of them were accepted: a success at positions
        1..a and a failure at a + 1 when a < d (the positions it tested), each after multiplying that
        position's earlier evidence by ``memory``."""
        tested = min(accepted + (accepted < drafted), self.accepted.size)
        self.accepted[:tested] *= memory
        self.rejected[:tested] *= memory
        self.accepted[: min(accepted, tested)] += 1
        if accepted < tested:
            self.rejected[accepted] += 1

    def copy(self, size: int, strength: float = math.inf) -> Evidence:
        """A copy of its first ``size`` positions (none where it has fewer), each position's successes and
        failures scaled to at most ``strength`` verdicts in all (its rate kept)."""
        own = Evidence(size)
        n = min(size, self.accepted.size)
        total = self.accepted[:n] + self.rejected[:n]  # [n]
        scale = np.minimum(1.0, strength / np.maximum(total, 1e-12))  # [n]
        own.accepted[:n], own.rejected[:n] = self.accepted[:n] * scale, self.rejected[:n] * scale
        return own


@dataclass(frozen=True)
class AutoKConfig:
    """How :class:`CostModelK` estimates the acceptance rates and probes; validated with UsageError.

    prior: (accepted, rejected) pseudo-counts of the Beta prior on the first position's rate (default
    Beta(½, ½)); later positions have priors of the same strength centred on max(its mean, α̂ before them).
    memory: each verdict at a position multiplies that position's earlier evidence by this (0 < memory ≤ 1;
    1 keeps everything, 0.9 weighs roughly its last 10 verdicts), so that the estimates follow a changing
    text.
    probe_budget: while K = 0 pays best, the best K > 0 is still drafted now and then, so that the expected
    loss of these probes is at most this share of the plain rounds (0 < probe_budget ≤ 1).
    k_max: the largest K to choose (None: as far as the cost model's verification curve goes).
    explore: with costs measured online, the most plain rounds between probes until the drafter's cost has
    been seen (≥ 1): a calibration that prices drafting far too dear is found out within a few probes, not
    after a budget that its own wrong price sets.
    amortize: the rounds over which a drafter's catch-up is weighed (≥ 1): where drafting pays once caught
    up, the backlog is read as soon as what the next ``amortize`` rounds gain covers it (waiting only makes
    it longer); a batch's plan spreads a row's catch-up over that many rounds.
    carried: the most verdicts per draft position a request's estimates start with from earlier requests'
    (``shared``; their rates kept, > 0): a workload's other kinds of text (a head that agrees 10 % of the time
    on code, 60 % on arithmetic) say where a request starts, and its own few probes soon outweigh them.
    """

    prior: tuple[float, float] = (0.5, 0.5)
    memory: float = 0.9
    probe_budget: float = 0.02
    k_max: int | None = None
    explore: int = 16
    amortize: int = 16
    carried: float = 4.0

    def __post_init__(self) -> None:
        if len(self.prior) != 2 or not all(
            isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in self.prior
        ):
            raise UsageError(f"prior must be two finite pseudo-counts > 0, got {self.prior!r}")
        for name in ("memory", "probe_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise UsageError(f"{name} must be a number in (0, 1], got {value!r}")
        if self.k_max is not None:
            check_int(self.k_max, "k_max", 0)
        for name in ("explore", "amortize"):
            check_int(getattr(self, name), name, 1)
        carried = self.carried
        if isinstance(carried, bool) or not (isinstance(carried, (int, float)) and carried > 0):
            raise UsageError(f"carried must be a number > 0, got {carried!r}")


class CostModelK(KPolicy):
    """``--k auto``: each round drafts the K that maximizes the expected tokens per unit of time,

        K* = argmax_{K = 0..k_max} E[L](α̂_1..α̂_K) / (v(K+1) + K·c + c₀),   E[L] = 1 + α̂_1 + α̂_1·α̂_2 + …

    (:func:`verispec.costs.analytic.speedup_by_k`; the smallest K on ties; K = 0 pays no c₀), where v, c
    and c₀ (a proposal's cost besides its tokens) are the calibrated costs of this target and drafter on this
    machine and α̂_i estimates the probability that draft position i is
    accepted when every position before it was. Acceptance is estimated per position because it is far from
    independent: an n-gram guess whose first token is right is usually copying, and its next tokens are
    right too (on the bench's math prompts, 0.29 for the first position, then 0.86, 0.76, 0.68).

    Each α̂_i is the mean of a Beta posterior: a round that drafted d tokens and accepted a adds a success at
    positions 1..a and a failure at position a + 1 when a < d (the only positions it tested), each after
    multiplying that position's earlier evidence by ``memory``: the first position follows the text closely,
    and later ones, reached only in good stretches, keep what they learnt there. The prior of position i is
    centred on the larger of the prior's mean and α̂_{i−1}: a position not yet tested is taken to be as good
    as the one before it when that one is good, so a long run of accepted drafts grows K.

    ``costs_at`` (optional) gives the cost model at a context length (:meth:`Calibration.cost_model_at`):
    forwards grow dearer with the context, verification blocks more so, and the best K with them; the
    round costs follow the context in steps of :data:`CONTEXT_STEP` positions. Without it, ``cost`` holds
    everywhere. ``batch_costs_at`` (optional) gives the target's cost of a forward over several rows at a
    context length (:meth:`Calibration.batch_cost_at`), for :func:`plan_batch`.

    K = 0 (plain decoding) is a valid choice. As it yields no evidence, the best K > 0 is still drafted after
    ⌈loss / probe_budget⌉ plain rounds, where loss = v(K+1) + K·c + c₀ + g·u − E[L] is that probe's expected
    cost in plain steps: cheap probes (an n-gram lookup) come every few rounds, dear ones (a model draft)
    rarely, and probing costs at most ``probe_budget`` of the plain rounds' time in expectation. g·u is the
    drafter's catch-up (:attr:`CostModel.catch_up` u per position): the g positions committed since the last
    round that drafted (the whole prompt before the first), which a drafter keeping state of the context (a
    model draft's cache, a learned head's) reads before it drafts, at most :attr:`CostModel.catch_up_limit`
    of them (a learned head reads the last 64); every round's choice counts it for K > 0, so a drafter whose
    catch-up outgrows the budget (u ≥ probe_budget per plain round, without a limit) stops probing.

    ``shared`` (optional): the evidence of earlier and concurrent requests (:class:`Evidence`), where this
    one's starts (its rates, weighed as at most :attr:`AutoKConfig.carried` verdicts per position); every
    verdict is added to both, so a request's own then weighs most.

    ``online`` (optional, shared by the policies of one calibration): the costs measured as it runs
    (:class:`~verispec.costs.online.OnlineCosts`). The calibrated costs are then a prior, corrected by the
    timings the engine hands over (:meth:`observe_costs`); until the drafter's cost has been seen, probes
    come after at most ``explore`` plain rounds, so that a calibration that prices drafting far too dear
    is found out.
    """

    name = "auto"

    def __init__(
        self,
        cost: CostModel,
        config: AutoKConfig | None = None,
        costs_at: Callable[[int], CostModel] | None = None,
        batch_costs_at: Callable[[int], BatchCost] | None = None,
        online: OnlineCosts | None = None,
        shared: Evidence | None = None,
    ) -> None:
        if not isinstance(cost, CostModel):
            raise UsageError(f"cost must be a CostModel, got {type(cost).__name__}")
        self.config = config or AutoKConfig()
        k_max = self.config.k_max
        if k_max is None:
            if cost.max_k is None:
                raise UsageError("give AutoKConfig.k_max for a verification cost without a finite curve")
            k_max = cost.max_k
        self.cost, self.k_max, self.costs_at, self.batch_costs_at = cost, k_max, costs_at, batch_costs_at
        self.online = online
        self._costed = cost  # the cost model `_round_costs` and `_catch_up` are for
        self._round_costs = cost.round_costs(k_max)  # [k_max + 1]: v(K+1) + K·c + c₀ (K > 0)
        self.shared = shared
        # this request's verdicts, from the shared ones' rates
        self.evidence = Evidence(k_max) if shared is None else shared.copy(k_max, self.config.carried)
        self._catch_up = cost.catch_up  # u at the context step of `_round_costs`
        self._plain_rounds = 0  # consecutive rounds at K = 0
        self._read = 0  # the context when a round last drafted: the drafter has read it (0: nothing yet)
        self._caught_up = 0  # the positions that round's drafter read before it drafted (its backlog)
        self._alphas: np.ndarray | None = None  # [k_max] α̂ for the evidence; None: changed
        self._tokens: np.ndarray | None = None  # [k_max + 1] E[L] of every K for the evidence; None: changed
        # (catch-up, (best K, probe K, probe gap)) for the evidence; None: changed
        self._plan: tuple[float, tuple[int, int, int]] | None = None
        self._prior: tuple[int, CostModel, BatchCost | None] | None = None  # (context step, its prior)
        # ((context step, online version), its cost model as corrected, its batch grid (None: not yet asked))
        self._here: tuple[tuple[int, int], CostModel, BatchCost | None] | None = None

    @property
    def alphas(self) -> np.ndarray:
        """[k_max]: α̂_i, the estimated acceptance rate of each draft position given the ones before it
        (read-only; computed once for the evidence)."""
        if self._alphas is None:
            a0, r0 = self.config.prior
            strength, floor = a0 + r0, a0 / (a0 + r0)
            rates, mean = [], floor
            own = self.evidence
            for accepted, rejected in zip(own.accepted.tolist(), own.rejected.tolist(), strict=True):
                rates.append((accepted + strength * mean) / (accepted + rejected + strength))
                mean = max(floor, rates[-1])  # the next position's prior: at least as good as this one
            alphas = np.array(rates)  # [k_max]
            alphas.flags.writeable = False
            self._alphas = alphas
        return self._alphas

    def _decide(self, catch_up: float) -> tuple[int, int, int]:
        """(the best K, the best K > 0 to probe with, the plain rounds between probes) for the evidence, a
        round that drafts paying ``catch_up`` (g·u, in plain steps) besides its round cost."""
        if self._tokens is None:
            self._tokens = tokens_by_k(self.alphas)  # [k_max + 1]
        steady = int(np.argmax(self._tokens / self._round_costs))  # the best K once caught up
        gain = self._tokens[steady] - self._round_costs[steady]  # plain steps a round at it saves
        if steady > 0 and self.config.amortize * gain >= catch_up:
            return steady, steady, 0  # the backlog pays for itself within `amortize` rounds: read it now
        costs = self._round_costs + catch_up  # [k_max + 1]
        costs[0] = self._round_costs[0]
        speedups = self._tokens / costs  # [k_max + 1]
        best = int(np.argmax(speedups))
        if best > 0 or speedups.size == 1:
            return best, best, 0
        probe = 1 + int(np.argmax(speedups[1:]))
        loss = costs[probe] * (1 - speedups[probe])  # round cost − E[L], in plain steps
        gap = max(1, math.ceil(loss / self.config.probe_budget))
        if self.online is not None and not self.online.drafter_seen:
            gap = min(gap, self.config.explore)
        return best, probe, gap

    def backlog(self, context: int) -> int:
        """g: the committed positions the drafter reads before it drafts at ``context``: those since the last
        round that drafted (the whole context before the first), at most the cost model's
        ``catch_up_limit``."""
        unread, limit = max(0, context - self._read), self.cost.catch_up_limit
        return unread if limit is None else min(unread, limit)

    def drafts_at(self, context: int) -> None:
        """A round drafts after ``context`` positions: the drafter has read them (or skipped those before its
        catch-up's limit): :meth:`backlog` is 0."""
        self._caught_up = self.backlog(context)
        self._read = context

    def _prior_at(self, context: int) -> tuple[CostModel, BatchCost | None]:
        """The calibrated cost model and batch grid (None without ``batch_costs_at``) at ``context``: at the
        middle of its step of :data:`CONTEXT_STEP` positions, computed once per step."""
        step = context // CONTEXT_STEP
        if self._prior is None or self._prior[0] != step:
            middle = step * CONTEXT_STEP + CONTEXT_STEP // 2
            cost = self.costs_at(middle) if self.costs_at is not None else self.cost
            batch = self.batch_costs_at(middle) if self.batch_costs_at is not None else None
            self._prior = (step, cost, batch)
        return self._prior[1], self._prior[2]

    def cost_here(self, context: int) -> CostModel:
        """The cost model at ``context``: the calibrated one (:meth:`_prior_at`), as the costs measured online
        correct it; computed once per step and estimate."""
        key = (context // CONTEXT_STEP, self.online.version if self.online is not None else 0)
        if self._here is None or self._here[0] != key:
            cost = self._prior_at(context)[0]
            self._here = (key, cost if self.online is None else self.online.correct(cost), None)
        return self._here[1]

    def costs_here(self, context: int) -> tuple[CostModel, BatchCost | None]:
        """:meth:`cost_here` and the batch grid at ``context`` (None without ``batch_costs_at``), corrected
        likewise; the grid computed when first asked for (a batch's plan), once per step and estimate."""
        cost = self.cost_here(context)
        assert self._here is not None
        if self._here[2] is None:
            batch = self._prior_at(context)[1]
            if batch is not None and self.online is not None:
                batch = self.online.correct_batch(batch)
            self._here = (self._here[0], cost, batch)
        return cost, self._here[2]

    def next_k(self, context: int = 0) -> int:
        cost = self.cost_here(context)
        if cost is not self._costed:
            self._costed = cost
            self._round_costs, self._catch_up = cost.round_costs(self.k_max), cost.catch_up
            self._tokens = self._plan = None
        catch_up = self._catch_up * self.backlog(context)
        if self._plan is None or self._plan[0] != catch_up:
            self._plan = (catch_up, self._decide(catch_up))
        best, probe, gap = self._plan[1]
        if best > 0:
            self._plain_rounds = 0
            self.drafts_at(context)
            return best
        self._plain_rounds += 1
        if self._plain_rounds <= gap:
            return 0
        self._plain_rounds = 0
        self.drafts_at(context)
        return probe

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.evidence.add(drafted, accepted, self.config.memory)
        if self.shared is not None:
            self.shared.add(drafted, accepted, self.config.memory)
        self._alphas = self._tokens = self._plan = None

    def observe_costs(self, timing: RoundTiming) -> None:
        """Hands the round's timings to ``online`` (if any) with what the calibration predicts for them: its
        forward's cost (:func:`_forward_cost`; the single-row curve for one row) and its drafter's,
        K·c + c₀ + g·u over the g positions it read first."""
        if self.online is None:
            return
        forward = timing.forward
        cost, batch = self._prior_at(forward.context)
        steps = _forward_cost(cost, batch if forward.rows > 1 else None, forward.rows, forward.tokens)
        draft, _ = self._prior_at(timing.context)
        spent = draft.draft_cost(timing.drafted) + self._caught_up * draft.catch_up
        self.online.observe(timing, steps, spent)


class PartsK(KPolicy):
    """``--k auto`` for a drafter whose every round is drafted by one of its parts (prompt lookup or a learned
    head: :class:`~verispec.drafting.hybrid.LookupFirstDrafter`), which differ in what they cost and how
    often they are right: a K policy per part. Which part drafts depends on the context's tokens, which the
    drafter sees and the engine's K question does not: :meth:`next_k` answers the most any part drafts (the
    largest ``k_max``) and the drafter asks the drafting part's policy for its K (:meth:`part_k`, once per
    round); the round's verdict and timings go to that policy (none asked: a round that drafted nothing, to
    none)."""

    name = "auto"

    def __init__(self, parts: dict[str, CostModelK]) -> None:
        self.parts = parts
        self.cap = max(part.k_max for part in parts.values())
        self._active: CostModelK | None = None  # the policy of the part drafting this round

    def next_k(self, context: int = 0) -> int:
        self._active = None
        return self.cap

    def part_k(self, part: str, context: int) -> int:
        """The K of the round ``part`` drafts after ``context`` committed positions (its policy's)."""
        self._active = self.parts[part]
        return self._active.next_k(context)

    def observe(self, drafted: int, accepted: int) -> None:
        if self._active is not None:
            self._active.observe(drafted, accepted)

    def observe_costs(self, timing: RoundTiming) -> None:
        if self._active is not None:
            self._active.observe_costs(timing)


class TreeGate(KPolicy):
    """``--k auto`` for token trees: tree rounds, or plain ones where those commit more tokens per second,
    as measured while it runs. A tree is chosen before the first round by the calibrated costs at the
    agreement the drafter's file records on held-out data (``resolve``'s tree="auto"), but where the head's
    guesses are far worse than that (a prompt the answer copies: its first guess right 7 % of the time
    against 56 % held out) every tree round loses to plain decoding, and a tree cannot draft less as a
    chain's K can. So, as the kernels' thread count is chosen (:mod:`verispec.kernels.threads`): after
    FIRST tree rounds, PROBE rounds run the other way; whichever way committed more tokens per second over
    its latest KEPT rounds (their mean tokens over their median seconds) is kept (the other only by
    MARGIN), the next probe PERIOD rounds after this one's start, then up to MAX_PERIOD apart (the kernels'
    :class:`~verispec.kernels.threads.ProbeSchedule`).
    Which rounds draft depends on timings and verdicts past, never on a draw to come: the output is exactly
    the target's whichever way each round goes."""

    name = "auto"
    FIRST = 8
    PERIOD = 32
    MAX_PERIOD = 512
    PROBE = 4
    KEPT = 16
    MARGIN = 0.9

    def __init__(self) -> None:
        self.drafting = True  # the way kept: tree rounds
        self.samples: dict[bool, list[tuple[int, float]]] = {True: [], False: []}  # way → (tokens, seconds)
        self.schedule = ProbeSchedule(self.FIRST, self.PERIOD, self.MAX_PERIOD, self.PROBE)

    def next_k(self, context: int = 0) -> int:
        return int(self.tree_round(context))

    def tree_round(self, context: int = 0) -> bool:
        return self.drafting != self.schedule.probing()

    def observe_tree(self, drafted: bool, tokens: int, seconds: float) -> None:
        self.samples[drafted] = [*self.samples[drafted][1 - self.KEPT :], (tokens, max(seconds, 1e-9))]
        if self.schedule.advance():
            self._decide()

    def _rate(self, drafted: bool) -> float:
        """Tokens per second of the latest rounds drafted so (0: none yet): their mean tokens over their
        median seconds, so that one round slowed by a busy spell, or by the head reading a backlog, does not
        decide (a way's rounds cost about the same each; their tokens vary)."""
        samples = self.samples[drafted]
        if not samples:
            return 0.0
        return statistics.mean(t for t, _ in samples) / statistics.median(s for _, s in samples)

    def _decide(self) -> None:
        """A probe ended: keep the faster way (the other by MARGIN); schedule the next probe."""
        switch = self._rate(not self.drafting) * self.MARGIN > self._rate(self.drafting)
        self.drafting = self.drafting != switch
        self.schedule.settle(switch)


def _forward_cost(cost: CostModel, batch: BatchCost | None, rows: int, n: int) -> float:
    """V(b, n): a target forward over n new tokens of b rows in units of one single-token step: the
    calibrated batch grid, never below what one row of n tokens costs (rows share the weights' reads, each
    reads its own cache: b rows cost more; a grid extended past its widest rows by a segment that a busy
    machine's timing made fall priced 16 tokens of one row as 1.02 steps, timed 3.66), or without a grid
    that single-row curve v(n), extended linearly past its last point by its last segment's slope, never a
    falling one (a probe timed on a busy machine can end lower than it was: extended, it went below zero,
    and so did the slowdowns measured against it)."""
    last = cost.max_k + 1 if cost.max_k is not None else n
    if n <= last:
        alone = cost.verify(n)
    else:
        slope = max(cost.verify(last) - cost.verify(last - 1), 0.0) if last > 1 else 1.0
        alone = cost.verify(last) + slope * (n - last)
    return alone if batch is None else max(batch.forward(rows, n), alone)


def plan_batch(policies: Sequence[CostModelK], contexts: Sequence[int], caps: Sequence[int]) -> list[int]:
    """Each row's K for one step of a batch whose rows all draft with ``--k auto``: the K_i that maximise the
    batch's expected committed tokens per unit of time,

        Σ_i E[L_i](K_i) / (V(b, Σ_i (K_i + 1)) + Σ_i (K_i·c_i + c₀_i [K_i > 0])),

    V(b, n) the target's cost of one forward of n new tokens over the b rows (:func:`_forward_cost`, the first
    row's calibrated batch grid at the batch's mean context, by steps of :data:`CONTEXT_STEP` as
    :meth:`CostModelK.costs_here` gives it: rows share the weights' reads, each reads its own cache), c_i,
    c₀_i and α̂_i each row's own (``caps``: the most each may draft), and a row's first draft token also
    paying its drafter's c₀_i and catch-up g_i·u_i (:meth:`CostModelK.backlog`). Draft tokens are added one at
    a time where they raise the rate most, while any does: when the forward is cheap per extra token (a small
    batch, memory-bound), rows draft; when a batch is large enough that every extra token costs nearly what a
    committed token is worth, speculation turns itself off, and back on when the batch shrinks — no threshold.
    A batch of one is its policy's own choice (``next_k``, probing included), today's single-sequence rule."""
    if len(policies) == 1:
        return [min(policies[0].next_k(contexts[0]), caps[0])]
    context = round(sum(contexts) / len(contexts))
    first = policies[0]
    here = [p.costs_here(context) for p in policies]
    costs = [cost for cost, _ in here]
    target, batch = costs[0], here[0][1]
    b = len(policies)
    alphas = [p.alphas.tolist() for p in policies]  # [b][k_max]
    limits = [min(cap, first.k_max, len(a)) for cap, a in zip(caps, alphas, strict=True)]  # [b] most K_i
    spends = [cost.cost_ratio for cost in costs]  # [b] c_i: a draft token's cost
    # [b] a row's first draft token's: c_i + c₀_i + g_i·u_i, its catch-up spread over `amortize` rounds
    firsts = [cost.draft_cost(1) + cost.catch_up * p.backlog(at) / p.config.amortize
              for cost, p, at in zip(costs, policies, contexts, strict=True)]  # fmt: skip
    ks = [0] * b
    reach = [1.0] * b  # Π α̂ of each row's drafted positions: its next token's worth
    tokens, n, drafting = float(b), b, 0.0
    rate = tokens / _forward_cost(target, batch, b, n)
    while True:
        best, best_rate = -1, rate
        forward = _forward_cost(target, batch, b, n + 1) + drafting  # one more new token
        for i in range(b):
            k = ks[i]
            if k < limits[i]:
                candidate = (tokens + reach[i] * alphas[i][k]) / (forward + (spends[i] if k else firsts[i]))
                if candidate > best_rate:
                    best, best_rate = i, candidate
        if best < 0:
            for policy, context, k in zip(policies, contexts, ks, strict=True):
                if k:
                    policy.drafts_at(context)
            return ks
        k = ks[best]
        drafting += spends[best] if k else firsts[best]
        reach[best] *= alphas[best][k]
        tokens += reach[best]
        n += 1
        ks[best] = k + 1
        rate = best_rate

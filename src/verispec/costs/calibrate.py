"""Calibration: what a target forward and a draft step cost on this machine, measured once and cached.

The cost model of :mod:`verispec.costs.analytic` (and so ``--k auto`` and the bench's predicted speedups)
needs, for one target and one drafter on this machine:

- the verification curve v(k) = T_target(k new tokens) / T_target(1) for k = 1..:data:`K_MAX`: the target's
  cache holds a context of :data:`CONTEXT` positions (seeded random tokens), k tokens are fed and the cache
  is rolled back; after one untimed pass over every k (first calls build kernels), each T(k) is timed
  ``repetitions`` times, each right after a T(1), and v(k) is the median of those ratios, so that a slow spell
  of a shared machine cancels out of each pair. The same is measured after :data:`LONG_CONTEXT` positions:
  attention makes every forward dearer as the context grows, and a block of k tokens more so than one
  token, so that the costs of a round at context L (:meth:`Calibration.cost_model_at`) interpolate the two
  linearly in L (attention's cost is linear in L);
- the cost of a batch (:class:`~verispec.costs.analytic.BatchCost`): T_target(b rows × m new tokens each)
  for b in :data:`BATCH_ROWS` and m in :data:`ROW_TOKENS`, every row of one batch cache after the same
  context, at both contexts, each timed right after a T(1) of one row and kept as the median of those ratios
  times T(1). Rows share the weights' reads but each reads its own cache, so b rows of m tokens cost more
  than one row of b·m. A target whose rows cannot be scored together (not
  :class:`~verispec.models.base.RowModel`, or off the native kernels) is scored one row after another by the
  engine, and its grid is b · T(m), not timed;
- the cost ratio c = T_draft / T_target(1): the median, over ``repetitions`` proposals of :data:`DRAFT_K`
  tokens by the drafter itself (a model draft's forwards and greedy picks, an n-gram lookup) on the same
  context, of the time per drafted token over a T(1) timed just before; each proposal is rolled back as after
  a rejection, and the context grows by one token;
- the drafter's catch-up u: what reading one committed position it has not seen costs it (a model draft's
  cache, a learned head's features), paid by the first round that drafts after plain rounds: the median of
  :data:`FILLS` first proposals after ``begin`` (a whole context unread) less the steady proposal's time, per
  position read (a ``BoundedCatchUp`` drafter reads its last ``catch_up_limit``), over T(1). Nothing for a
  drafter that keeps no state of the context.

A first use (``--k auto``, ``tree="auto"``'s check, auto's choice of the learned drafter) does not wait for
all of that: it *probes*, once, in seconds even on a busy machine. A probe times the target after
:data:`PROBE_CONTEXT` positions at the block sizes :data:`PROBE_KS` only (v(k) linear between them; and one
of :data:`PROBE_WIDE` tokens, the batch grid's widest forward, for the grid), one
untimed pass and then timed passes begun within :data:`PROBE_SECONDS` (one at least, ``repetitions`` at most);
a probe whose curve falls past :data:`FALL` (one stalled forward) is timed once more at once, the steadier
of the two kept. Its batch grid is predicted, not timed (b rows of m tokens as one row of b·m tokens: rows
share the weights' reads, and each reads its own short cache), and nothing is timed at the long context (the
costs do not grow with the context). A drafter is probed likewise within :data:`PROBE_DRAFT_SECONDS` (one
whose proposals cost next to nothing, a lookup's, in :data:`PROBE_LEAST` passes). The probe is cached
(``probe: true``) like a full calibration and used from then on: ``--k auto`` takes any calibration as a prior
and corrects it by the rounds' own timings from the first rounds on (:mod:`verispec.costs.online`), which is
what makes a rough prior good enough. ``verispec calibrate`` (``force``) measures in full and replaces it.

Every measurement says how far the machine moved while it ran: the T(1)s timed beside its timings, in up to
four consecutive parts, each part's lower median (so that a single slow forward does not count), the largest
over the smallest (``drift``). A measurement that drifted more than :data:`DRIFT` (a busy spell began or ended
during it) is cached all the same, its drift recorded, with one line on stderr: it is never measured again on
every run (the online correction is what follows a busy machine), only by a later use that finds the machine
quiet (:func:`quiet`: a probe again, seconds, once it holds still) or by ``verispec calibrate``. A cached
calibration is not timed again at load.

The cache holds one JSON file per target in ``$VERISPEC_CACHE/calibration`` (by default
``~/.cache/verispec/calibration``), named by a hash of its identity: the model's class and architecture config
(weights do not change the cost, so checkpoints of one architecture share it), dtype, device, whether the CPU
fast path is on, the machine (torch version, thread count, CPU) and the measurement's own settings (context,
K_MAX, DRAFT_K). The drafters measured against that target
are kept in the same file under their own identity. Writes are atomic (temporary file, then rename); a file
that cannot be read back, or that belongs to another identity, is measured again and replaced.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from verispec.cores import available_cores
from verispec.costs.analytic import BatchCost, CostModel
from verispec.drafting.base import Allowed, BoundedCatchUp, Drafter, HiddenStateReader, Proposal, TreeDrafter
from verispec.errors import UsageError
from verispec.files import atomic_write
from verispec.inputs import check_int
from verispec.kernels.threads import THREADS
from verispec.models.base import HiddenStateModel, LanguageModel, RowInput, RowModel
from verispec.models.gguf import cache_dir
from verispec.models.identity import model_identity
from verispec.models.kv_cache import KVCache

__all__ = [
    "BATCH_ROWS",
    "CONTEXT",
    "DRAFT_K",
    "DRIFT",
    "FALL",
    "FILLS",
    "K_MAX",
    "NEGLIGIBLE",
    "PROBE_CONTEXT",
    "PROBE_DRAFT_SECONDS",
    "PROBE_LEAST",
    "PROBE_KS",
    "PROBE_WIDE",
    "PROBE_SECONDS",
    "PROBE_TRIES",
    "QUICK_REPETITIONS",
    "ReadingTree",
    "ROW_TOKENS",
    "Calibration",
    "DraftCosts",
    "TargetCosts",
    "TreeRound",
    "calibrate",
    "calibration_dir",
    "cpu_name",
    "quiet",
]

K_MAX = 16  # v(k) is measured for k = 1..K_MAX new tokens: K ≤ K_MAX − 1 draft tokens per round
CONTEXT = 256  # positions in the cache while timing (capped at half the model's context)
LONG_CONTEXT = 1024  # the second context timed (capped likewise): how costs grow with the context
DRAFT_K = 4  # tokens per timed proposal
FILLS = 3  # first proposals after begin timed, for the drafter's catch-up
BATCH_ROWS = (1, 2, 4, 8, 16)  # the batch grid: rows of one forward ...
ROW_TOKENS = (1, 2, 4)  # ... times new tokens in each row
QUICK_REPETITIONS = 5  # a probe's timed passes at most; ``verispec calibrate`` measures 10 in full
PROBE_SECONDS = 2.0  # a probe of a target begins its timed passes within this many seconds (the first always)
PROBE_DRAFT_SECONDS = 1.0  # and a probe of a drafter
PROBE_LEAST = 4  # passes a probe of a drafter times at least, however cheap the drafter
NEGLIGIBLE = 0.01  # a drafter whose proposal costs less than this share of T(1): its probe ends then
PROBE_CONTEXT = 64  # positions in the cache while probing (a prefill of 256 takes seconds on a busy machine)
PROBE_KS = (1, 2, 4, 8, K_MAX)  # the block sizes a probe times; v(k) linear between them
# and one block as wide as the batch grid's widest forward (16 rows of 4 tokens): what a token costs where a
# forward is compute-bound, which the grid's prediction extends to (the slope past K_MAX, from 8 and 16
# tokens alone, was 0.6 of it at 1 B cost on the AMD kind: batches of drafts priced too cheap)
PROBE_WIDE = 64
# A probe's curve that falls more than FALL (a forward of more tokens timed faster than one of fewer: one
# forward stalled, e.g. ~100 ms while a kernel thread held a core, seen on an idle 2-core Intel Xeon at 3 B
# cost, one pass per size) is timed again at once, PROBE_TRIES times in all at most; the steadiest is kept.
FALL = 1.25
PROBE_TRIES = 2
DRIFT = 2.0  # T(1) moving more than this factor within a measurement: said, and probed again when quiet
QUIET = 0.25  # a load average over the last minute below this share of the usable cores: a quiet machine
_VERSION = 7  # of the cache file format (7: a probe's grid from its PROBE_WIDE block)
_TINY = 1e-9  # seconds: the least a draft token costs (a lookup's proposal hardly grows with its length)
# part of the key: how it was measured
_METHOD = {
    "context": CONTEXT,
    "long_context": LONG_CONTEXT,
    "k_max": K_MAX,
    "draft_k": DRAFT_K,
    "fills": FILLS,
    "batch_rows": BATCH_ROWS,
    "row_tokens": ROW_TOKENS,
}
Grid = tuple[tuple[float, ...], ...]  # [len(BATCH_ROWS)][len(ROW_TOKENS)] seconds


@dataclass(frozen=True)
class TargetCosts:
    """A target's measured forward times on this machine."""

    label: str  # what it was called when measured (informational)
    seconds: tuple[float, ...]  # T_target(k) for k = 1..K_MAX, medians in seconds, at `context` positions
    repetitions: int
    measured_at: str  # ISO 8601, UTC
    context: int = CONTEXT  # the positions in the cache while timing `seconds`
    long_seconds: tuple[float, ...] = ()  # T_target(k) at `long_context` positions (empty: not measured)
    long_context: int = 0
    batch_seconds: Grid = ()  # T_target(b rows × m tokens) over BATCH_ROWS × ROW_TOKENS at `context`
    long_batch_seconds: Grid = ()  # the same at `long_context` (empty: not measured)
    probe: bool = False  # a first use's probe (PROBE_KS timed, the grid predicted), not a full measurement
    drift: float = 1.0  # how far T(1) moved while measuring (_drift)

    def __post_init__(self) -> None:
        _check_how(self.probe, self.drift)
        for timings in (self.seconds, self.long_seconds or self.seconds):
            if len(timings) < 2 or not all(_positive(s) for s in timings):
                raise UsageError(f"target timings must be at least two numbers > 0, got {timings!r}")
        if self.long_seconds and (
            len(self.long_seconds) != len(self.seconds) or not self.context < self.long_context
        ):
            raise UsageError("long-context timings need as many values, at a longer context")
        shape = (len(BATCH_ROWS), len(ROW_TOKENS))
        for grid in (self.batch_seconds, self.long_batch_seconds or self.batch_seconds):
            if len(grid) != shape[0] or not all(
                len(line) == shape[1] and all(_positive(s) for s in line) for line in grid
            ):
                raise UsageError(f"batch timings must be {shape[0]} x {shape[1]} numbers > 0, got {grid!r}")
        if bool(self.long_batch_seconds) != bool(self.long_seconds):
            raise UsageError("batch timings at the long context go with single-row ones")

    @property
    def verify_cost(self) -> tuple[float, ...]:
        """v(k) = T_target(k) / T_target(1) for k = 1..K_MAX (v(1) = 1), at the short context."""
        return tuple(s / self.seconds[0] for s in self.seconds)

    def seconds_at(self, context: int) -> tuple[float, ...]:
        """T_target(k) for k = 1..K_MAX after ``context`` positions: linear in the context through the two
        measured ones (the short one alone when the long one was not measured), never below half the short
        context's times."""
        return self._at(context, self.seconds, self.long_seconds)

    def step_at(self, context: int) -> float:
        """T_target(1) after ``context`` positions: :meth:`seconds_at`'s first alone (per round, for the
        costs measured as it runs)."""
        return self._at(context, self.seconds[:1], self.long_seconds[:1])[0]

    def batch_cost_at(self, context: int) -> BatchCost:
        """The cost of a forward over rows after ``context`` positions each, in units of one row's T(1)
        there: the grid interpolated in the context as :meth:`seconds_at` is."""
        one = self.seconds_at(context)[0]
        lines = zip(self.batch_seconds, self.long_batch_seconds or self.batch_seconds, strict=True)
        grid = [self._at(context, short, long if self.long_batch_seconds else ()) for short, long in lines]
        return BatchCost(BATCH_ROWS, ROW_TOKENS, tuple(tuple(s / one for s in line) for line in grid))

    def _at(self, context: int, short: tuple[float, ...], long: tuple[float, ...]) -> tuple[float, ...]:
        if not long:
            return short
        w = (context - self.context) / (self.long_context - self.context)
        return tuple(max(s / 2, s + w * (far - s)) for s, far in zip(short, long, strict=True))


@dataclass(frozen=True)
class DraftCosts:
    """A drafter's measured cost per drafted token on this machine."""

    label: str
    cost_ratio: float  # c = T_draft / T_target(1): a draft token's cost beyond the first
    seconds_per_token: float  # T_draft
    repetitions: int
    measured_at: str
    catch_up_seconds: float = 0.0  # per committed position the drafter had not read (>= 0)
    fixed_seconds: float = 0.0  # per proposal, besides its tokens' T_draft each (>= 0)
    probe: bool = False  # a first use's probe, not a full measurement
    drift: float = 1.0  # how far T(1) moved while measuring (_drift)
    catch_up_limit: int | None = None  # the most unread positions a catch-up reads (BoundedCatchUp)

    def __post_init__(self) -> None:
        _check_how(self.probe, self.drift)
        if self.catch_up_limit is not None:
            check_int(self.catch_up_limit, "catch_up_limit", 1)
        if not (_positive(self.cost_ratio) and _positive(self.seconds_per_token)):
            raise UsageError(
                f"draft costs must be numbers > 0, got {self.cost_ratio!r}, {self.seconds_per_token!r}"
            )
        for what, x in (("catch-up", self.catch_up_seconds), ("fixed cost", self.fixed_seconds)):
            if isinstance(x, bool) or not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0):
                raise UsageError(f"a drafter's {what} must be a number >= 0, got {x!r}")


class ReadingTree(TreeDrafter, HiddenStateReader, Protocol):
    """A tree drafter that branches a chain ``drafter`` and reads the target's hidden states (eagle's)."""

    @property
    def drafter(self) -> Drafter: ...


class TreeRound:
    """A tree drafter that reads the target's hidden states, timed as a drafter whose every proposal is its
    whole tree (``k`` aside): its calibrated c₀ + c is what drafting one round of that tree costs — a head
    forward per depth over the nodes there and the tree's assembly, far more than the chain's K·c for the
    tree's depth (the default eagle tree on SmolLM2: 0.39 of a plain step against 0.15)."""

    def __init__(self, tree: ReadingTree) -> None:
        self.tree = tree
        self.name = f"{tree.name} tree {tree.shape.name}"

    def begin(self, prompt: list[int]) -> None:
        self.tree.begin(prompt)

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        """hidden: [T, H], the target's final hidden states at the next T committed positions."""
        self.tree.observe_hidden(hidden)

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        self.tree.propose_tree(context, self.tree.shape, generator)
        return Proposal.empty()

    def observe(self, num_accepted: int) -> None:
        """Nothing to roll back: a tree's proposal leaves the drafter's cache as it found it."""

    def cost_identity(self) -> dict:
        paths = [list(path) for path in self.tree.shape.paths]
        return {"tree": paths, "of": self.tree.drafter.cost_identity()}

    @property
    def catch_up_limit(self) -> int | None:
        """Its chain drafter's (:class:`~verispec.drafting.base.BoundedCatchUp`): the tree reads with it."""
        drafter = self.tree.drafter
        return drafter.catch_up_limit if isinstance(drafter, BoundedCatchUp) else None


def _check_how(probe: object, drift: object) -> None:
    """UsageError unless ``probe`` is a bool and ``drift`` a number >= 1 (how a measurement went)."""
    if not isinstance(probe, bool):
        raise UsageError(f"probe must be true or false, got {probe!r}")
    if not (_positive(drift) and drift >= 1):  # type: ignore[operator]
        raise UsageError(f"a measurement's drift must be a number >= 1, got {drift!r}")


@dataclass(frozen=True)
class Calibration:
    """The costs of a target and (optionally) a drafter, and where they are cached."""

    target: TargetCosts
    draft: DraftCosts | None
    path: Path

    @property
    def cost_ratio(self) -> float:
        """c = T_draft / T_target(1); 0 without a drafter."""
        return self.draft.cost_ratio if self.draft else 0.0

    @property
    def cost_model(self) -> CostModel:
        """v(k), c, the drafter's catch-up and fixed cost as the analytic model takes them, at the short
        context."""
        return self._costs(self.target.seconds)

    def cost_model_at(self, context: int) -> CostModel:
        """v(k), c, the catch-up and fixed cost for rounds after ``context`` positions (see
        :meth:`TargetCosts.seconds_at`): the draft's seconds as measured, the target's forwards dearer as the
        context grows."""
        return self._costs(self.target.seconds_at(context))

    def _costs(self, seconds: tuple[float, ...]) -> CostModel:
        """The cost model of target forwards taking ``seconds`` (T(k), k = 1..): every cost over T(1)."""
        one = seconds[0]
        # the short context's T(1) over this one's: the drafter's seconds weigh less where forwards cost more
        relative = self.target.seconds[0] / one
        per_token, catch_up, fixed = (x * relative for x in self._draft_ratios())
        limit = self.draft.catch_up_limit if self.draft else None
        return CostModel(per_token, tuple(s / one for s in seconds), catch_up, fixed, limit)

    def _draft_ratios(self) -> tuple[float, float, float]:
        """The drafter's cost a token (c), a position caught up (u) and a proposal (c₀) over the T(1) timed
        beside its proposals (0 without one): each of its seconds over the same T(1), so that a machine
        running faster or slower between the target's timings and the drafter's changes none of them."""
        draft = self.draft
        if draft is None:
            return 0.0, 0.0, 0.0
        per_second = draft.cost_ratio / draft.seconds_per_token  # 1 / that T(1)
        return draft.cost_ratio, draft.catch_up_seconds * per_second, draft.fixed_seconds * per_second

    def batch_cost_at(self, context: int) -> BatchCost:
        """The target's cost of a forward over several rows after ``context`` positions, in the same unit as
        :meth:`cost_model_at` (see :meth:`TargetCosts.batch_cost_at`)."""
        return self.target.batch_cost_at(context)

    def step_seconds(self, context: int) -> float:
        """T_target(1) after ``context`` positions, in seconds: the unit of :meth:`cost_model_at` (what the
        costs measured as it runs are set against, :mod:`verispec.costs.online`)."""
        return self.target.step_at(context)

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "target": dataclasses.asdict(self.target),
            "draft": dataclasses.asdict(self.draft) if self.draft else None,
            "verify_cost": list(self.target.verify_cost),
            "cost_ratio": self.cost_ratio,
        }


def calibration_dir() -> Path:
    """``$VERISPEC_CACHE/calibration``, by default ``~/.cache/verispec/calibration``."""
    return cache_dir().parent / "calibration"


def cpu_name() -> str:
    """The CPU's model name, as the kernel reports it (else the platform's processor string)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine_identity() -> dict:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_name()}


def _digest(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def calibrate(
    target: LanguageModel,
    drafter: Drafter | None = None,
    *,
    target_label: str = "",
    draft_label: str = "",
    repetitions: int = QUICK_REPETITIONS,
    force: bool = False,
) -> Calibration:
    """The costs of ``target`` (and ``drafter``, if given) on this machine: from the cache, or else probed
    (seconds: at most ``repetitions`` timed passes, see the module) and cached. ``force``: measured in full,
    with ``repetitions`` timed repetitions, and cached in place of what was there; other drafters' entries
    stay (their costs are ratios to the T(1) timed beside them, whatever the target's timings say). The labels
    name the models in the cache file and notices."""
    check_int(repetitions, "repetitions", 1)
    target_label = target_label or type(target).__name__
    identity = {"model": model_identity(target), "machine": _machine_identity(), "method": _METHOD}
    path = calibration_dir() / f"{_digest(identity)}.json"
    entry = _read(path, identity)
    probe = not force
    if entry is None or force or _again(entry["target"], target_label):
        what = f"{target_label} on this machine ({repetitions} repetitions), cached in {path}"
        _begin(probe, what, target_label, path)
        entry = {
            "version": _VERSION,
            "identity": identity,
            "drafts": {} if entry is None else entry["drafts"],
        }
        with THREADS.held():
            costs = _measure_target(target, target_label, repetitions, probe)
        entry["target"] = dataclasses.asdict(costs)
        _write(path, entry)
    draft = None
    if drafter is not None:
        draft_identity = drafter.cost_identity()
        key = _digest(draft_identity)
        cached = entry["drafts"].get(key)
        if cached is None or force or _again(cached, draft_label or drafter.name):
            draft_label = draft_label or drafter.name
            _begin(probe, f"the {draft_label} drafter against {target_label}", target_label, path)
            with THREADS.held():
                measured = _measure_drafter(drafter, target, draft_label, repetitions, probe)
            cached = {"identity": draft_identity, **dataclasses.asdict(measured)}
            entry["drafts"][key] = cached
            _write(path, entry)
        draft = _draft_costs(cached)
    return Calibration(_target_costs(entry), draft, path)


class _Announced:
    """Whether this process said that it probes (one line, the first time)."""

    said = False


def _begin(probe: bool, what: str, target_label: str, path: Path) -> None:
    """Say what is measured: a full calibration each time ("calibrating WHAT"), a probe once a process (how
    long, where it is kept, how to skip it)."""
    if not probe:
        _notice(f"calibrating {what}")
    elif not _Announced.said:
        _Announced.said = True
        _notice(
            f"timing {target_label} on this machine for --k auto, once: a few seconds (cached in "
            f"{path.parent}; --k N skips it, `verispec calibrate` measures in full)"
        )


def quiet() -> bool:
    """Whether this machine looks quiet: its load average over the last minute below QUIET of the cores this
    process may use (where it is unknown: not quiet)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    return load < QUIET * available_cores()


def _again(cached: dict, label: str) -> bool:
    """Whether to probe a cached measurement again: it drifted more than DRIFT and the machine is quiet now
    (said on stderr)."""
    drift = cached.get("drift", 1.0)
    if drift <= DRIFT or not quiet():
        return False
    _notice(f"{label}'s costs were timed while T(1) moved {drift:.1f}x: timing again, the machine is quiet")
    _Announced.said = True  # what the probe's line would say
    return True


def _drifted(label: str, drift: float) -> None:
    """Say on stderr that a measurement's T(1) moved more than DRIFT while it ran (it is kept all the
    same)."""
    if drift > DRIFT:
        _notice(
            f"{label}: T(1) moved {drift:.1f}x while timing (a busy machine?): kept all the same, corrected "
            "by the rounds' own timings as it runs, and timed again by a later run that finds the machine "
            "quiet (or `verispec calibrate`)"
        )


def _drift(ones: Sequence[float]) -> float:
    """How far T(1) moved during one measurement: ``ones``, its T(1) timings in the order taken, cut into up
    to four consecutive parts of two or more; the largest of their lower medians over the smallest (1.0
    with fewer than four timings). A lower median: a single slow forward in a part is never its value."""
    parts = min(4, len(ones) // 2)
    if parts < 2:
        return 1.0
    bounds = [round(i * len(ones) / parts) for i in range(parts + 1)]
    medians = [statistics.median_low(ones[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return max(medians) / min(medians)


def _fall(seconds: Sequence[float]) -> float:
    """How far a curve T(1), T(2), ... falls from a size to a larger one (a forward over more tokens never
    costs less: a fall is a forward slowed by something else, a busy machine), as a drift: the largest
    T(j) / T(k) over j < k, 1.0 for a curve that never falls. A busy first probe here timed T(1) at 2.06 s
    and T(2) at 0.9 ms over its one pass each: a drift of 2,262, probed again once the machine is quiet."""
    most, fall = 0.0, 1.0
    for t in seconds:
        most = max(most, t)
        fall = max(fall, most / t)
    return fall


class _Budget:
    """How long a measurement goes on: each loop of passes begins its first pass always, another while
    fewer than its most are done and ``seconds`` have not passed since the budget was made (a probe's; a
    full measurement has no limit but its count)."""

    def __init__(self, seconds: float = math.inf) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    def more(self, done: int, most: int) -> bool:
        """Whether to begin another pass, ``done`` of at most ``most`` done."""
        return done < most and (done == 0 or time.perf_counter() - self.start < self.seconds)


# ---------------------------------------------------------------------------------------------- measuring


def _context(model: LanguageModel, extra: int, length: int = CONTEXT) -> list[int]:
    """Seeded random tokens: a timing context of ``length`` positions (capped at half the model's context),
    with room for ``extra`` more positions."""
    length = max(2, min(length, model.max_context // 2, model.max_context - extra))
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, model.vocab_size, (length,), generator=generator).tolist()


class _TargetTimer:
    """Times forwards of the target over k new tokens after a fixed context, rolling the cache back."""

    def __init__(self, model: LanguageModel, context: list[int]) -> None:
        self.model, self.context, self.device = model, context, model.device
        self.cache = model.new_cache()
        positions = torch.arange(len(context), device=self.device)[None]  # [1, L]
        model.forward(torch.tensor([context], device=self.device), positions, self.cache)

    def seconds(self, k: int) -> float:
        base = len(self.context)
        fed = [self.context[i % base] for i in range(k)]  # the context's tokens, again where k is longer
        tokens = torch.tensor([fed], device=self.device)  # [1, k]
        positions = torch.arange(base, base + k, device=self.device)[None]  # [1, k]
        start = time.perf_counter()
        self.model.forward(tokens, positions, self.cache)
        elapsed = time.perf_counter() - start
        self.cache.truncate(base)
        return elapsed


def _measure_target(model: LanguageModel, label: str, repetitions: int, probe: bool) -> TargetCosts:
    """The target's costs: a probe (the module), or in full T_target(k) for k = 1..K_MAX and the batch grid
    at the short and the long context (the long one where the model's context leaves room for it); the
    largest :func:`_drift` of their measurements recorded (and said, beyond DRIFT)."""
    if probe:
        short = _context(model, PROBE_WIDE, PROBE_CONTEXT)
        wide = min(PROBE_WIDE, model.max_context - len(short))  # the room a small model's context leaves
        ks = PROBE_KS + ((wide,) if wide > K_MAX else ())
        tries: list[tuple[float, tuple[float, ...], int]] = []  # (drift, seconds, passes) of each try
        while len(tries) < PROBE_TRIES and (not tries or tries[-1][0] > FALL):
            budget = _Budget(PROBE_SECONDS)
            seconds, drift, passes = _time_forwards(model, short, ks, repetitions, budget)
            tries.append((max(drift, _fall(seconds)), seconds, passes))  # few passes: a fall shows a hiccup
        drift, seconds, passes = min(tries, key=lambda attempt: attempt[0])
        grid = _one_row_grid(seconds) if _RowsTimer.of(model, 2) else _one_by_one(seconds)
        _drifted(label, drift)
        return TargetCosts(
            label, seconds[:K_MAX], passes, _now(), len(short), batch_seconds=grid, probe=True, drift=drift
        )
    short = _context(model, K_MAX)
    long = _context(model, K_MAX, LONG_CONTEXT)
    contexts = [short] if len(long) <= len(short) else [short, long]
    timer = _RowsTimer.of(model)
    every = tuple(range(1, K_MAX + 1))
    curves, grids, drifts = [], [], []
    for context in contexts:
        seconds, drift, _ = _time_forwards(model, context, every, repetitions, _Budget())
        grid, grid_drift = (
            timer.grid(context, seconds[0], repetitions) if timer else (_one_by_one(seconds), 1.0)
        )
        curves.append(seconds)
        grids.append(grid)
        drifts += [drift, grid_drift]
    _drifted(label, max(drifts))
    if len(contexts) == 1:
        return TargetCosts(
            label, curves[0], repetitions, _now(), len(short), batch_seconds=grids[0], drift=max(drifts)
        )
    return TargetCosts(
        label, curves[0], repetitions, _now(), len(short), curves[1], len(long), grids[0], grids[1],
        drift=max(drifts),
    )  # fmt: skip


def _one_by_one(seconds: tuple[float, ...]) -> Grid:
    """The grid of a target whose rows the engine scores one after another: b · T(m)."""
    return tuple(tuple(b * seconds[m - 1] for m in ROW_TOKENS) for b in BATCH_ROWS)


def _one_row_grid(seconds: tuple[float, ...]) -> Grid:
    """A probe's grid of a target that scores a batch's rows in one forward, predicted, not timed: b rows
    of m tokens as one row of b·m tokens (the rows share the weights' reads; each reads its own cache, little
    at a probe's short context), T(n) of the probe's curve (timed to PROBE_WIDE tokens where the model's
    context leaves room), past its end extended by the slope of its upper half."""
    last, half = len(seconds), len(seconds) // 2
    slope = max(0.0, (seconds[-1] - seconds[half - 1]) / (last - half))

    def row(n: int) -> float:
        return seconds[n - 1] if n <= last else seconds[-1] + (n - last) * slope

    return tuple(tuple(row(b * m) for m in ROW_TOKENS) for b in BATCH_ROWS)


class _RowsTimer:
    """Times forwards of the rows of one batch cache, every row after the same context, rolling them back."""

    def __init__(self, model: RowModel, caches: list[KVCache]) -> None:
        self.model, self.caches = model, caches

    @classmethod
    def of(cls, model: LanguageModel, rows: int = BATCH_ROWS[-1]) -> _RowsTimer | None:
        """A timer of ``rows`` rows for ``model`` if it scores the rows of a batch (of :class:`KVCache` rows,
        whose context is computed once and copied) in one forward, else None."""
        if not isinstance(model, RowModel):
            return None
        caches = model.new_cache_rows(rows)
        kept = [c for c in caches if isinstance(c, KVCache)]
        timer = cls(model, kept)
        together = len(kept) == len(caches) and model.scores_together(timer._rows(rows, [0]))
        return timer if together else None

    def _rows(self, rows: int, tokens: list[int]) -> list[RowInput]:
        out = []
        for cache in self.caches[:rows]:
            start = cache.length
            positions = torch.arange(start, start + len(tokens))  # [T]
            out.append(RowInput(cache, torch.tensor(tokens), positions, None, logits=True, hidden=False))
        return out

    def seconds(self, rows: int, tokens: list[int]) -> float:
        inputs = self._rows(rows, tokens)
        start = time.perf_counter()
        self.model.forward_rows(inputs)
        elapsed = time.perf_counter() - start
        for row in inputs:
            row.cache.truncate(row.cache.length - len(tokens))
        return elapsed

    def grid(self, context: list[int], one: float, repetitions: int) -> tuple[Grid, float]:
        """T(b rows × m tokens) after ``context`` (computed in the first row, copied to the others): the
        median over ``repetitions`` of its ratio to a T(1 row × 1 token) timed right before, times ``one``,
        after one untimed pass over the grid; and the :func:`_drift` of those T(1 row × 1 token)."""
        first = self.caches[0]
        extend = context[first.length :]
        self.model.forward_rows(self._rows(1, extend))
        for cache in self.caches[1:]:
            cache.copy_from(first)
        ratios: dict[tuple[int, int], list[float]] = {}
        singles: list[float] = []
        for repetition in range(repetitions + 1):
            for b in BATCH_ROWS:
                for m in ROW_TOKENS:
                    single, elapsed = self.seconds(1, context[:1]), self.seconds(b, context[:m])
                    if repetition:
                        singles.append(single)
                        ratios.setdefault((b, m), []).append(elapsed / single)
        grid = tuple(tuple(one * statistics.median(ratios[b, m]) for m in ROW_TOKENS) for b in BATCH_ROWS)
        return grid, _drift(singles)


def _time_forwards(
    model: LanguageModel, context: list[int], ks: Sequence[int], repetitions: int, budget: _Budget
) -> tuple[tuple[float, ...], float, int]:
    """T_target(k) for k = 1..max(ks) after ``context``, timed at the sizes ``ks`` (1 and K_MAX among them;
    linear between them) after one untimed pass over them, then in up to ``repetitions`` timed passes as
    ``budget`` allows: each T(k) is timed right after a T(1), v(k) is the median of those ratios (a slow
    spell of the machine cancels out of each pair), and T_target(k) = v(k) · the median T(1); the
    :func:`_drift` of those T(1), and the timed passes made."""
    timer = _TargetTimer(model, context)
    ratios: dict[int, list[float]] = {k: [] for k in ks}
    ones: list[float] = []
    for k in ks:  # untimed: first calls build kernels and grow buffers
        timer.seconds(1), timer.seconds(k)
    passes = 0
    while budget.more(passes, repetitions):
        for k in ks:
            one, elapsed = timer.seconds(1), timer.seconds(k)
            ones.append(one)
            ratios[k].append(elapsed / one)
        passes += 1
    t1 = statistics.median(ones)
    timed = [t1 * statistics.median(ratios[k]) for k in ks]
    curve = np.interp(np.arange(1, max(ks) + 1), ks, timed)
    return tuple(float(s) for s in curve), _drift(ones), passes


def _measure_drafter(
    drafter: Drafter, target: LanguageModel, label: str, repetitions: int, probe: bool
) -> DraftCosts:
    """A proposal of K tokens costs c₀ + K·c: over ``repetitions`` pairs of proposals of 1 and DRAFT_K
    tokens (a probe: as many as begin within PROBE_DRAFT_SECONDS, one at least, after PROBE_CONTEXT
    positions), each right after a target forward T(1) and a round that committed a token, and rolled back
    as after a rejection, c is the difference of their medians per token beyond the first over the median
    T(1), and c₀ the 1-token proposal's median less c (the line through both medians, neither part below
    zero: c at least a nanosecond); the catch-up: the median of FILLS first proposals after ``begin`` (the
    whole context unread; a probe's as many as its time allows) less a steady DRAFT_K proposal's, per
    position read; and the :func:`_drift` of the T(1)s, recorded (and said, beyond DRIFT). A drafter that
    reads the target's hidden states is handed those of every committed position, as the engine hands
    them."""
    budget = _Budget(PROBE_DRAFT_SECONDS if probe else math.inf)
    context = _context(target, 2 * repetitions + DRAFT_K + 2, PROBE_CONTEXT if probe else CONTEXT)
    timer = _TargetTimer(target, list(context))
    generator = torch.Generator().manual_seed(0)
    hidden, reader = None, drafter if isinstance(drafter, HiddenStateReader) else None
    if reader is not None:
        if not isinstance(target, HiddenStateModel):
            raise UsageError(f"the {drafter.name} drafter needs a target with hidden states (a native model)")
        final = context + context[: 2 * repetitions]  # the context after the last repetition
        tokens = torch.tensor([final], device=target.device)  # [1, L']
        positions = torch.arange(len(final), device=target.device)[None]  # [1, L']
        hidden = target.forward_hidden(tokens, positions, target.new_cache())[0]  # [L', H]
    fills: list[float] = []
    limit = drafter.catch_up_limit if isinstance(drafter, BoundedCatchUp) else None
    read = len(context) - 1  # a fill reads every position but the last (the last `limit` of them)
    read = read if limit is None else min(read, limit)
    while budget.more(len(fills), FILLS):
        drafter.begin(list(context))
        if hidden is not None and reader is not None:
            reader.observe_hidden(hidden[: len(context) - 1])
        start = time.perf_counter()
        drafter.propose(context, DRAFT_K, generator)
        fills.append(time.perf_counter() - start)
        drafter.observe(0)
    times: dict[int, list[float]] = {1: [], DRAFT_K: []}  # proposal length → seconds
    ones: list[float] = []
    appended, passes = 0, 0
    while budget.more(passes, repetitions) and not (probe and _negligible(times[DRAFT_K], ones, passes)):
        # after the last fill, as after a round that committed a token
        for k, seconds in times.items():  # each right after a target forward, as in a round
            ones.append(timer.seconds(1))
            context.append(context[appended])
            appended += 1
            if hidden is not None and reader is not None:
                reader.observe_hidden(hidden[len(context) - 2 : len(context) - 1])  # [1, H]
            start = time.perf_counter()
            drafter.propose(context, k, generator)
            seconds.append(max(time.perf_counter() - start, 1e-9))
            drafter.observe(0)
        passes += 1
    single, full = statistics.median(times[1]), statistics.median(times[DRAFT_K])
    per_token = max((full - single) / (DRAFT_K - 1), _TINY)  # a lookup's barely grows with K
    fixed = max(single - per_token, 0.0)
    catch_up = max(0.0, statistics.median(fills) - full) / read
    one, drift = statistics.median(ones), _drift(ones)
    _drifted(label, drift)
    return DraftCosts(label, per_token / one, per_token, passes, _now(), catch_up, fixed, probe, drift, limit)


def _negligible(proposals: list[float], ones: list[float], passes: int) -> bool:
    """Whether a probe has timed enough of a drafter whose proposals cost next to nothing (a lookup's): after
    :data:`PROBE_LEAST` passes, its median proposal under :data:`NEGLIGIBLE` of the median T(1); more passes
    would change no K, and a probe of an n-gram lookup would otherwise spend its whole budget timing the
    target's forwards beside it."""
    if passes < PROBE_LEAST:
        return False
    return statistics.median(proposals) < NEGLIGIBLE * statistics.median(ones)


# ---------------------------------------------------------------------------------------------- the cache


def _read(path: Path, identity: dict) -> dict | None:
    """The cache entry at ``path`` for ``identity``; None (with a notice if the file exists) when there is
    none or it cannot be used."""
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())
        if entry["version"] != _VERSION or entry["identity"] != json.loads(json.dumps(identity, default=str)):
            raise UsageError("written for another version or identity")
        if len(_target_costs(entry).seconds) != K_MAX:
            raise UsageError(f"not {K_MAX} timings")
        for draft in entry["drafts"].values():
            _draft_costs(draft)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        _notice(f"ignoring the unusable calibration file {path} ({type(err).__name__}: {err})")
        return None
    return entry


def _target_costs(entry: dict) -> TargetCosts:
    target = entry["target"]
    curves = {key: tuple(target[key]) for key in ("seconds", "long_seconds")}
    grids = {
        key: tuple(tuple(line) for line in target[key]) for key in ("batch_seconds", "long_batch_seconds")
    }
    return TargetCosts(**{**target, **curves, **grids})


def _draft_costs(cached: dict) -> DraftCosts:
    return DraftCosts(**{k: v for k, v in cached.items() if k != "identity"})


def _write(path: Path, entry: dict) -> None:
    """Write ``entry`` as JSON at ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(entry, indent=1, default=str))


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _notice(message: str) -> None:
    print(f"verispec: {message}", file=sys.stderr)

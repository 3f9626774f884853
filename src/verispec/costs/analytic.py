"""Analytic model of speculative decoding: how many tokens a target call yields, and what that is worth.

Notation (as everywhere in verispec): p is the target's distribution, q the draft's. One *round* drafts K
tokens, then the target verifies K+1 positions in one forward pass.

- Acceptance rate: α = Σ_x min(p(x), q(x)), the probability that rejection sampling accepts a token drawn
  from q (Leviathan et al. 2023, Chen et al. 2023).
- Tokens per target call, with positions accepted independently with probability α each:
  E[L] = 1 + α + α² + … + α^K = (1 − α^{K+1}) / (1 − α), and K + 1 at α = 1. With a per-position rate α_i
  (the probability of accepting the i-th draft token given that all before it were accepted):
  E[L] = 1 + Σ_{i=1..K} Π_{j≤i} α_j. A round always emits at least one token, so 1 ≤ E[L] ≤ K + 1.
- Cost of a round, in units of one plain decoding step T_target(1): v(K+1) + K·c, where
  c = T_draft / T_target(1) is the cost ratio of one draft step and v(k) = T_target(k) / T_target(1) is the
  verification cost curve (v(1) = 1 by definition; v ≡ 1 models a memory-bound target whose forward time
  does not depend on the number of new tokens).
- Speedup over plain decoding: E[L] / (v(K+1) + K·c). K = 0 is plain decoding: speedup 1 / v(1) = 1.

Every public function validates its arguments and raises UsageError with a one-line message.
"""

from __future__ import annotations

import bisect
import functools
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from verispec.errors import UsageError
from verispec.inputs import check_int, is_int

__all__ = [
    "DEFAULT_K_MAX",
    "BatchCost",
    "CostModel",
    "VerifyCost",
    "acceptance_rate",
    "best_tree_size",
    "break_even_alpha",
    "expected_speedup",
    "expected_tokens_per_call",
    "optimal_k",
    "speedup_by_k",
    "speedup_from_tokens",
    "tree_rates",
    "tree_tokens_bound",
]

VerifyCost = Callable[[int], float] | Sequence[float] | np.ndarray | None
"""v(k) = T_target(k new tokens) / T_target(1): a callable of k ≥ 1, a sequence with v[0] ↔ k = 1, or None
for v ≡ 1."""

DEFAULT_K_MAX = 32
"""Largest K that :func:`optimal_k` tries when neither k_max nor a finite verification curve bounds it."""

_ONE_TOL = 1e-6  # how far from 1 a probability vector's sum, and v(1), may be
_BISECT_TOL = 1e-12  # width of the final bracket of break_even_alpha
_TIE_TOL = 1e-12  # relative difference under which best_tree_size takes two rates as equal


# ---------------------------------------------------------------------------------------------- validation


def _check_real(name: str, value: object, low: float = -math.inf, high: float = math.inf) -> float:
    """value as a float, if it is a finite real number (not a bool) in [low, high]; else UsageError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not low <= float(value) <= high
    ):
        bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise UsageError(f"{name} must be a finite number {bounds}, got {value!r}")
    return float(value)


def _check_k(k: object, name: str = "k") -> int:
    """k as an int, if it is an integer (not a bool) ≥ 0; else UsageError."""
    return int(check_int(k, name, 0, integral=True))


def _alphas(alpha: float | Sequence[float] | np.ndarray, k: int | None) -> np.ndarray:
    """The per-position acceptance rates [K] of a round: a scalar α repeated k times (k required), or the
    given sequence (k, if given, must be its length)."""
    if np.ndim(alpha) == 0:
        if k is None:
            raise UsageError("k is required when alpha is a single number")
        return np.full(_check_k(k), _check_real("alpha", alpha, 0.0, 1.0))
    try:
        alphas = np.asarray(alpha, dtype=np.float64)
    except (TypeError, ValueError):
        raise UsageError(f"alpha must be a number or a sequence of numbers, got {alpha!r}") from None
    if alphas.ndim != 1:
        raise UsageError(f"per-position alpha must be one-dimensional, got shape {alphas.shape}")
    if not np.all((alphas >= 0) & (alphas <= 1)):  # also rejects NaN
        raise UsageError("every per-position alpha must lie in [0, 1]")
    if k is not None and _check_k(k) != alphas.size:
        raise UsageError(f"k = {k} does not match the {alphas.size} per-position alphas")
    return alphas


@dataclass(frozen=True)
class CostModel:
    """The cost of one round, in units of one plain decoding step T_target(1): v(K+1) + K·c (+ c₀ when K > 0).

    cost_ratio: c = T_draft / T_target(1) ≥ 0, the cost of one draft step.
    verify_cost: v(k) = T_target(k) / T_target(1) for k ≥ 1 new tokens: a callable of k, a sequence with
    v[0] ↔ k = 1 (stored as a tuple; it bounds K to len − 1), or None for v ≡ 1. Every value must be finite
    and > 0, and v(1) must be 1 (within 1e-6). A sequence is checked on construction, a callable at k = 1 on
    construction and at every other k when it is evaluated.
    catch_up: u ≥ 0, the drafter's cost of reading one committed position it has not seen yet (one committed
    in a plain round, K = 0: a model draft's cache or a learned head's features lag behind), paid by the next
    round that drafts; a round's c covers the positions one drafting round commits before the next.
    catch_up_limit: the most of those positions the drafter reads, the last ones (a learned head's window;
    None: all of them): a catch-up costs u · min(g, limit) after g positions.
    fixed_cost: c₀ ≥ 0, what a proposal costs besides its K draft steps (a drafter's first call after the
    target's forward: reading the round's new positions, its call into the kernels); a round that drafts
    nothing pays none of it.
    """

    cost_ratio: float = 0.0
    verify_cost: VerifyCost = None
    catch_up: float = 0.0
    fixed_cost: float = 0.0
    catch_up_limit: int | None = None

    def __post_init__(self) -> None:
        """Validate; store a sequence curve as a tuple of floats."""
        if self.catch_up_limit is not None:
            check_int(self.catch_up_limit, "catch_up_limit", 1)
        object.__setattr__(self, "cost_ratio", _check_real("cost_ratio", self.cost_ratio, 0.0))
        object.__setattr__(self, "catch_up", _check_real("catch_up", self.catch_up, 0.0))
        object.__setattr__(self, "fixed_cost", _check_real("fixed_cost", self.fixed_cost, 0.0))
        v = self.verify_cost
        if v is not None and not callable(v):
            try:
                curve = np.asarray(v, dtype=np.float64)
            except (TypeError, ValueError):
                raise UsageError(f"verify_cost must be a callable, a sequence or None, got {v!r}") from None
            if curve.ndim != 1 or curve.size == 0:
                raise UsageError(f"a verify_cost sequence must be one-dimensional and non-empty, got {v!r}")
            object.__setattr__(self, "verify_cost", tuple(float(x) for x in curve))
            if np.all((curve > 0) & (curve < math.inf)) and abs(curve[0] - 1.0) <= _ONE_TOL:
                return  # valid (the check below, at once: the policies build corrected models each round)
        for k in range(1, (self.max_k or 0) + 2):  # every entry of a sequence, v(1) of a callable
            self.verify(k)

    @property
    def max_k(self) -> int | None:
        """The largest draft length K this model can cost (None: unbounded)."""
        return len(self.verify_cost) - 1 if isinstance(self.verify_cost, tuple) else None

    def verify(self, k: int) -> float:
        """v(k), the cost of a target forward over k ≥ 1 new tokens, validated."""
        k = _check_k(k)
        if k < 1:
            raise UsageError(f"the verification cost is defined for k >= 1 new tokens, got {k}")
        v = self.verify_cost
        if v is None:
            return 1.0
        if isinstance(v, tuple):
            if k > len(v):
                raise UsageError(f"verify_cost has {len(v)} entries (k = 1..{len(v)}), k = {k} is beyond it")
            value = v[k - 1]
        else:
            assert callable(v)  # __post_init__ stored any sequence as a tuple
            value = v(k)
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        number = float(value) if real else math.nan  # NaN: not a number, refused below
        if not 0 < number < math.inf:
            raise UsageError(f"verify_cost({k}) must be a finite number > 0, got {value!r}")
        if k == 1 and abs(number - 1.0) > _ONE_TOL:
            raise UsageError(f"verify_cost(1) must be 1 (v(k) = T_target(k) / T_target(1)), got {value!r}")
        return number

    def draft_cost(self, k: int) -> float:
        """K·c + c₀: what drafting K tokens costs (nothing for K = 0)."""
        k = _check_k(k)
        return k * self.cost_ratio + self.fixed_cost if k else 0.0

    def round_cost(self, k: int) -> float:
        """v(K+1) + K·c + c₀: the cost of a round that drafts K tokens (K > 0) and verifies K+1 positions."""
        return self.verify(_check_k(k) + 1) + self.draft_cost(k)

    def round_costs(self, k_max: int) -> np.ndarray:
        """[k_max + 1]: :meth:`round_cost` of every K = 0..k_max."""
        k_max = _check_k(k_max, "k_max")
        if isinstance(self.verify_cost, tuple):  # checked on construction: at once
            self.verify(k_max + 1)  # within the curve
            drafting = self.cost_ratio * np.arange(k_max + 1) + self.fixed_cost  # [k_max + 1]
            drafting[0] = 0.0
            return np.array(self.verify_cost[: k_max + 1]) + drafting
        return np.array([self.round_cost(k) for k in range(k_max + 1)])


@dataclass(frozen=True)
class BatchCost:
    """The cost of one target forward over n new tokens spread over b sequences (rows of one batch), in units
    of one plain decoding step of one sequence T_target(1): a grid measured at b ∈ ``rows`` with m ∈
    ``tokens`` new tokens in every row, ``cost[i][j]`` ↔ (rows[i], tokens[j]), so that cost[0][0] = 1 when
    rows[0] = tokens[0] = 1. Both axes strictly increasing integers ≥ 1 with at least two points; every
    cost finite and > 0.

    Rows of a batch share the weights' reads but each reads its own cache, so b rows of m tokens cost more
    than one row of b·m tokens, and more so as the context grows.
    """

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    cost: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for name in ("rows", "tokens"):
            axis = getattr(self, name)
            if (
                not isinstance(axis, (tuple, list))
                or len(axis) < 2
                or not all(is_int(x, integral=True) and x >= 1 for x in axis)
                or any(a >= b for a, b in zip(axis, axis[1:], strict=False))
            ):
                raise UsageError(f"BatchCost.{name} must be >= 2 increasing integers >= 1, got {axis!r}")
            object.__setattr__(self, name, tuple(axis))
        try:
            grid = np.asarray(self.cost, dtype=np.float64)
        except (TypeError, ValueError):
            raise UsageError(f"BatchCost.cost must be a grid of numbers, got {self.cost!r}") from None
        if grid.shape != (len(self.rows), len(self.tokens)) or not np.all(np.isfinite(grid) & (grid > 0)):
            raise UsageError(
                f"BatchCost.cost must be {len(self.rows)} x {len(self.tokens)} numbers > 0, got {self.cost!r}"
            )
        object.__setattr__(self, "cost", tuple(tuple(float(x) for x in row) for row in grid))

    def forward(self, rows: int, tokens: int) -> float:
        """V(b, n): a forward of ``tokens`` = n ≥ b new tokens over ``rows`` = b ≥ 1 sequences, piecewise
        linear in the tokens per row n / b and then in b through the grid, extended linearly past its ends,
        never below the grid's smallest cost."""
        if not (is_int(rows, integral=True) and is_int(tokens, integral=True) and 1 <= rows <= tokens):
            raise UsageError(
                f"a batch forward needs 1 <= rows <= tokens, got {rows!r} rows, {tokens!r} tokens"
            )
        per_row = [_piecewise(self.tokens, line, tokens / rows) for line in self.cost]  # [len(rows)]
        return max(_piecewise(self.rows, per_row, rows), self._floor)

    @functools.cached_property
    def _floor(self) -> float:
        return min(min(line) for line in self.cost)


def _piecewise(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """The piecewise-linear curve through (xs, ys) at x, extended past either end by its end segment."""
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# ---------------------------------------------------------------------------------------------- the model


def acceptance_rate(*, p: np.ndarray, q: np.ndarray) -> float | np.ndarray:
    """α = Σ_x min(p(x), q(x)), the probability that rejection sampling accepts a token drawn from q.

    p, q: [..., V] target and draft distributions, same shape, non-negative, each summing to 1 (within 1e-6).
    Returns a float for 1-D inputs, else an array [...] with one α per distribution pair.
    """
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if p.shape != q.shape or p.ndim == 0 or p.shape[-1] == 0:
        raise UsageError(f"p and q must have one shape [..., V] with V >= 1, got {p.shape} and {q.shape}")
    for name, probs in (("p", p), ("q", q)):
        if not np.all(np.isfinite(probs) & (probs >= 0)):
            raise UsageError(f"{name} must be finite and non-negative")
        if np.any(np.abs(probs.sum(axis=-1) - 1.0) > _ONE_TOL):
            raise UsageError(f"{name} must sum to 1 over its last axis (within {_ONE_TOL:g})")
    alpha = np.minimum(p, q).sum(axis=-1)
    return float(alpha) if p.ndim == 1 else alpha


def expected_tokens_per_call(alpha: float | Sequence[float] | np.ndarray, k: int | None = None) -> float:
    """E[L], the expected number of tokens one target call (one round) emits.

    Scalar α with draft length k: E[L] = (1 − α^{K+1}) / (1 − α), K + 1 at α = 1.
    Per-position α = (α_1..α_K) (k optional, else must equal K): E[L] = 1 + Σ_{i=1..K} Π_{j≤i} α_j.
    Both are computed by the second formula, which is exact near α = 1.
    """
    alphas = _alphas(alpha, k)
    return float(1.0 + np.cumprod(alphas).sum())


def speedup_from_tokens(
    tokens_per_call: float, k: int, cost_ratio: float = 0.0, verify_cost: VerifyCost = None
) -> float:
    """Speedup over plain decoding given a (measured or modelled) number of tokens per target call τ:
    τ / (v(K+1) + K·c). τ must lie in [1, K+1]; see :class:`CostModel` for cost_ratio and verify_cost.

    Example: a 50 ms target and a 5 ms draft (c = 0.1), K = 5, 3 tokens accepted on average (τ = 4):
    4 · 50 / (50 + 5 · 5) = 2.67.
    """
    k = _check_k(k)
    tau = _check_real("tokens_per_call", tokens_per_call, 1.0, k + 1.0)
    return tau / CostModel(cost_ratio, verify_cost).round_cost(k)


def expected_speedup(
    alpha: float | Sequence[float] | np.ndarray,
    k: int | None = None,
    cost_ratio: float = 0.0,
    verify_cost: VerifyCost = None,
) -> float:
    """E[L] / (v(K+1) + K·c): the expected speedup over plain decoding, with E[L] from
    :func:`expected_tokens_per_call` (α scalar with k, or per-position) and the cost from :class:`CostModel`.
    """
    alphas = _alphas(alpha, k)
    return speedup_from_tokens(expected_tokens_per_call(alphas), alphas.size, cost_ratio, verify_cost)


def optimal_k(
    alpha: float,
    cost_ratio: float = 0.0,
    verify_cost: VerifyCost = None,
    k_max: int | None = None,
    fixed_cost: float = 0.0,
) -> int:
    """argmax over K ∈ 0..k_max of :func:`expected_speedup` (the smallest such K on ties; K = 0 is plain
    decoding, speedup 1), a proposal also paying ``fixed_cost`` (c₀, see :class:`CostModel`). k_max defaults
    to len(verify_cost) − 1 for a sequence, else :data:`DEFAULT_K_MAX`.
    """
    cost = CostModel(cost_ratio, verify_cost, fixed_cost=fixed_cost)
    if k_max is None:
        k_max = DEFAULT_K_MAX if cost.max_k is None else cost.max_k
    k_max = _check_k(k_max, "k_max")
    return int(np.argmax(speedup_by_k(alpha, cost.round_costs(k_max))))


def speedup_by_k(
    alpha: float | Sequence[float] | np.ndarray, round_costs: Sequence[float] | np.ndarray
) -> np.ndarray:
    """The expected speedup of every draft length at once: [K_max + 1], E[L](α, K) / round_costs[K] for
    K = 0..K_max, with round_costs from :meth:`CostModel.round_costs` (validated there) and α a scalar or
    per-position rates α_1..α_{K_max} (as for :func:`expected_tokens_per_call`); the per-round hot path of
    :class:`verispec.costs.policies.CostModelK`."""
    costs = np.asarray(round_costs, dtype=np.float64)  # [K_max + 1]
    return tokens_by_k(_alphas(alpha, costs.size - 1)) / costs


def tokens_by_k(alphas: np.ndarray) -> np.ndarray:
    """[K_max + 1]: E[L] = 1 + α_1 + α_1·α_2 + … (:func:`expected_tokens_per_call`'s products) of every draft
    length K = 0..K_max at once, for per-position rates ``alphas`` [K_max] already checked to lie in [0, 1]
    (:func:`speedup_by_k` checks them; :class:`verispec.costs.policies.CostModelK`'s own are so by
    construction)."""
    tokens = np.ones(alphas.size + 1)  # [K_max + 1]
    tokens[1:] += np.cumsum(np.cumprod(alphas))
    return tokens


def tree_tokens_bound(paths: Sequence[Sequence[int]], alphas: Sequence[float]) -> float:
    """An upper bound on the expected tokens a round of a static token tree commits (its accepted draft nodes
    and the target's next token), from the drafter's top-1 acceptance rate at each depth, ``alphas[d − 1]``
    at depth d (the last one deeper). ``paths``: every node's path of child ranks, () for the root (a
    :class:`~verispec.drafting.tree.TreeShape`'s). After an accepted node, its first-ranked child is accepted
    with probability α; its other children, of which one at most is accepted, with 1 − α at most together,
    all of it credited to the one whose subtree is worth most. A chain's bound is its expected tokens."""
    if not alphas:
        raise UsageError("tree_tokens_bound needs the acceptance rate of at least one depth")
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in paths:
        if path:
            children.setdefault(tuple(path[:-1]), []).append(tuple(path))

    def worth(node: tuple[int, ...]) -> float:  # the node and its subtree's expected tokens, once it is in
        kids = children.get(node, [])
        alpha = _check_real("alpha", alphas[min(len(node), len(alphas) - 1)], 0.0, 1.0)
        first = sum(worth(c) for c in kids if c[-1] == 0)
        others = max((worth(c) for c in kids if c[-1] != 0), default=0.0)
        return 1.0 + alpha * first + (1.0 - alpha) * others

    return worth(())


def tree_rates(scores: Sequence[float], cost: CostModel, draft_steps: int) -> np.ndarray:
    """The expected tokens per unit time of a dynamic tree that verifies its n best draft nodes, for every
    n ∈ 0..min(len(scores), v's range − 1):
    (1 + scores[0] + … + scores[n−1]) / (v(n + 1) + draft_steps·c + c₀).

    scores: the candidate draft nodes' path probabilities, highest first: a node's chance of being accepted
    when the draft is calibrated (its probability of agreeing with the target is what it believes), so
    their sum is the expected number of accepted tokens. draft_steps: the draft forwards the tree took,
    spent whatever n is chosen."""
    spent = cost.draft_cost(_check_k(draft_steps, "draft_steps"))
    n_max = len(scores) if cost.max_k is None else min(len(scores), cost.max_k)
    tokens = 1.0 + np.concatenate(([0.0], np.cumsum(np.asarray(scores[:n_max], dtype=np.float64))))
    return tokens / np.array([cost.verify(n + 1) + spent for n in range(n_max + 1)])


def best_tree_size(scores: Sequence[float], cost: CostModel, draft_steps: int) -> int:
    """How many draft nodes a dynamic tree should verify: the smallest n whose :func:`tree_rates` entry is
    within a relative 1e-12 of the best (a node that adds nothing measurable is not verified; 0 is a plain
    step)."""
    rates = tree_rates(scores, cost, draft_steps)
    return int(np.flatnonzero(rates >= rates.max() * (1 - _TIE_TOL))[0])


def break_even_alpha(k: int, cost_ratio: float = 0.0, verify_cost: VerifyCost = None) -> float | None:
    """The smallest α ∈ [0, 1] at which :func:`expected_speedup` ≥ 1, i.e. E[L](α) ≥ v(K+1) + K·c.

    E[L] increases continuously from 1 (α = 0) to K + 1 (α = 1), so: 0.0 when the round costs at most one
    plain step (v(K+1) + K·c ≤ 1, e.g. K = 0); None when even α = 1 does not pay (K + 1 < v(K+1) + K·c);
    otherwise found by bisection, to within 1e-12 and on the paying side. Example: K = 1, v ≡ 1 gives α = c.
    """
    k = _check_k(k)
    cost = CostModel(cost_ratio, verify_cost).round_cost(k)
    if cost <= 1.0:
        return 0.0
    if k + 1 < cost:
        return None
    lo, hi = 0.0, 1.0  # E[L](lo) < cost <= E[L](hi)
    while hi - lo > _BISECT_TOL:
        mid = 0.5 * (lo + hi)
        if expected_tokens_per_call(mid, k) >= cost:
            hi = mid
        else:
            lo = mid
    return hi

"""The one transform from logits to the distribution that defines sampling, and the draws from it.

Exactness in verispec is always *with respect to the target's transformed distribution*: speculative decoding
with parameters ``params`` produces tokens distributed exactly as ``probs_from_logits(target_logits, params)``
would, step after step. The engine applies the same function, with the same parameters, to the draft's logits
at every position, so that the draft proposes from the distribution it reports to the verifier.

The transforms run in a fixed order, the one transformers' ``generate`` uses:
temperature → top-k → top-p → min-p. Temperature 0 means greedy: the distribution is a point mass on the
first index of the largest logit.

Draws come from the request's generator in the order they happen (:func:`sample`), or, with
``SamplingParams(invariant=True)``, from the seed and the token's position alone (:func:`position_draws`): the
token at position t is then the same function of (seed, t, p_t) however it was reached, and a drafter that
draws from q at t with the same noise (:func:`draft_draw`) proposes the target's own draw whenever they agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from verispec.errors import UsageError
from verispec.options import SamplingParams

__all__ = ["RACE_GROUP", "draft_draw", "first_argmax", "position_draws", "probs_from_logits", "sample"]

_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)  # what a CPU tensor hands NumPy as it is


def first_argmax(scores: Tensor) -> Tensor:
    """scores [..., V] (V ≥ 1) → each row's index of its first maximum [...] int64, a NaN counting as the
    maximum: torch.argmax's convention (and NumPy's). In NumPy for a CPU tensor of a float type NumPy has:
    torch's reduction costs 10–20× as much at a vocabulary's width (~45 µs for one row of 49,152 here)."""
    if scores.device.type == "cpu" and scores.dtype in _NUMPY_FLOATS:
        return torch.from_numpy(np.asarray(scores.detach().numpy().argmax(-1), dtype=np.int64))
    return scores.argmax(-1)


def probs_from_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution that defines sampling with ``params``.

    logits: [..., V] float; -inf marks a token that can never be sampled; NaN, +inf and rows that are all -inf
    raise UsageError.
    Returns probs: [..., V] in the dtype of ``logits`` (float32 for half types), each row summing to 1.
    """
    if not torch.is_floating_point(logits):
        raise UsageError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise UsageError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    top = logits.amax(dim=-1, keepdim=True)  # [..., 1]: NaN if the row holds one (amax propagates NaN)
    if torch.isnan(top).any() or torch.isposinf(top).any():
        raise UsageError("logits contain NaN or +inf")
    if torch.isneginf(top).any():
        raise UsageError("a row of logits is entirely -inf: no token can be sampled")

    if params.greedy:
        first = first_argmax(logits).unsqueeze(-1)  # [..., 1]
        return torch.zeros_like(logits).scatter_(-1, first, 1.0)

    scores = logits / params.temperature
    # a temperature so small that the top logit / T overflows acts as its limit: the argmax token(s) alone
    overflow = ~torch.isfinite(top / params.temperature)  # [..., 1]
    if overflow.any():
        scores = torch.where(overflow, torch.where(logits == top, 0.0, float("-inf")), scores)
    vocab = scores.shape[-1]
    neg_inf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = torch.where(scores < kth, neg_inf, scores)
    if params.top_p < 1:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # a top_p below float32's least value is 0: drops all
        drop_sorted[..., 0] = False  # the most likely token is always kept, as transformers keeps it
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scores = torch.where(drop, neg_inf, scores)
    if params.min_p > 0:
        probs = scores.softmax(dim=-1)
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)
        scores = torch.where(probs < floor, neg_inf, scores)
    return scores.softmax(dim=-1)


def sample(weights: Tensor, generator: torch.Generator, num_samples: int = 1) -> Tensor:
    """``num_samples`` independent draws (with replacement) from each row of ``weights`` [..., V]: [...,
    num_samples] int64, index i drawn with probability weights[i] / Σ weights (non-negative; any positive
    total, so that a residual max(p − q, 0) is sampled as it is).

    The inverse of the cumulative weights in float64: one uniform u per draw from ``generator``, and the
    first index whose cumulative weight exceeds u · total, so that an index of zero weight is never drawn
    (u · total rounded up to the total falls back to the last index of positive weight). It draws what
    ``torch.multinomial`` draws, several times faster on a large vocabulary (0.15 against 0.9 ms for one row
    of 49,152 here)."""
    cdf = weights.double().cumsum(-1)  # [..., V]
    total = _total(cdf[..., -1:].contiguous())  # [..., 1]
    shape = (*weights.shape[:-1], num_samples)
    u = torch.rand(shape, generator=generator, dtype=torch.float64, device=weights.device) * total  # [..., n]
    last = torch.searchsorted(cdf, total)  # [..., 1]: the first index reaching the total, the last positive
    return torch.minimum(torch.searchsorted(cdf, u, right=True), last)  # [..., n]


def _total(total: Tensor) -> Tensor:
    if not bool(torch.all(total > 0)) or not bool(torch.all(torch.isfinite(total))):
        raise UsageError("cannot sample from weights that are not finite, non-negative and positive in total")
    return total


RACE_GROUP = 256  # token ids per group in the two levels of position_draws' race


def position_draws(weights: Tensor, seed: int, positions: Sequence[int]) -> Tensor:
    """The draws of ``SamplingParams.invariant``: weights [P, V] (a row per position, as in :func:`sample`)
    → [P] int64, row i's draw for the token at ``positions[i]``, a function of the seed, that position and
    the row alone.

    An exponential race in two levels over the ids in groups of :data:`RACE_GROUP`: first the group g with
    the least e_g / w(g) (w(g): the group's total weight), then, within it, the id v with the least
    e_v / w_v, where the e are unit exponentials from numpy's counter-based ``Philox`` keyed by the seed, its
    counter at (position, group); an id's noise does not depend on how long the row is. Each level is a
    race, so id v wins with probability w_v / Σ w. Two distributions drawn at the same position share their
    noise (a Gumbel-max coupling), and so draw the same id far more often than independent draws would, and
    nearly as often as the best coupling can (Σ min(p, q), what rejection sampling accepts); always where
    q = p. A draft drawn from q this way (:func:`draft_draw`) is the target's own draw that often."""
    if weights.ndim != 2 or weights.shape[0] != len(positions):
        raise UsageError(f"need weights [P, V] for {len(positions)} positions, got {tuple(weights.shape)}")
    w = weights.detach().to("cpu", torch.float64).numpy()  # [P, V]
    groups = -(-w.shape[1] // RACE_GROUP)
    if groups * RACE_GROUP != w.shape[1]:
        w = np.pad(w, ((0, 0), (0, groups * RACE_GROUP - w.shape[1])))  # [P, G · RACE_GROUP]
    drawn = _race(w.reshape(len(positions), groups, RACE_GROUP), seed, positions)
    return torch.tensor(drawn, dtype=torch.long, device=weights.device)


def _race(w: np.ndarray, seed: int, positions: Sequence[int]) -> list[int]:
    """:func:`position_draws` on w [P, G, RACE_GROUP] float64, the rows' weights in groups (zeros past the
    vocabulary). In NumPy, on the calling thread: a draw is ~25 small operations, which torch would split
    over its threads (waiting on a busy core) and dispatch at a far higher cost each."""
    totals = w.sum(-1)  # [P, G]
    _total(torch.from_numpy(totals.sum(-1)))
    blocks = -(-w.shape[1] // RACE_GROUP)  # the groups' noise, RACE_GROUP groups to a counter
    drawn = []
    with np.errstate(divide="ignore"):  # a group or an id of weight 0: e / 0 = inf, never the least
        for row, position in enumerate(positions):
            e = np.concatenate([_exponentials(seed, position, 2 * b) for b in range(blocks)])[: w.shape[1]]
            g = int((e / totals[row]).argmin())
            e = _exponentials(seed, position, 2 * g + 1)  # [RACE_GROUP]: the group's ids' noise
            drawn.append(g * RACE_GROUP + int((e / w[row, g]).argmin()))
    return drawn


def _exponentials(seed: int, position: int, index: int) -> np.ndarray:
    """RACE_GROUP unit exponentials [RACE_GROUP] float64 of counter (position, index) under key ``seed``: the
    counters of two calls lie 2^64 apart, far beyond what one call advances its counter by."""
    bits = np.random.Philox(key=seed, counter=(position << 128) | (index << 64))
    return np.random.Generator(bits).standard_exponential(RACE_GROUP)


def draft_draw(
    q: Tensor, generator: torch.Generator, params: SamplingParams, position: int, ids: Tensor | None = None
) -> Tensor:
    """A drafter's draw from q [W] for the token at ``position``: [1] int64, an index of q. From
    ``generator`` (:func:`sample`); with ``params.invariant``, the position's own draw (:func:`position_draws`
    with the generator's seed), with q's entries at the target's ids ``ids`` [W] (None: q's indices are
    them), so that the draft is the target's own draw there whenever the two agree."""
    if not params.invariant:
        return sample(q, generator)
    if ids is None:
        return position_draws(q.unsqueeze(0), generator.initial_seed(), [position])
    at = ids.cpu().numpy()  # [W]
    groups = -(-(int(at.max()) + 1) // RACE_GROUP)  # q spread over the ids up to the largest: its groups
    spread = np.zeros(groups * RACE_GROUP)  # [G · RACE_GROUP] float64
    spread[at] = q.detach().to("cpu", torch.float64).numpy()
    token = _race(spread.reshape(1, groups, RACE_GROUP), generator.initial_seed(), [position])[0]
    return torch.tensor(np.flatnonzero(at == token)[:1], device=q.device)  # [1]: its index in ids

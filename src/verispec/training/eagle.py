"""Training an EAGLE head (:class:`~verispec.drafting.learned.eagle.EagleHead`): :class:`EagleRecipe`, on CPU
in hours.

- batches: ``batch_tokens // window`` random windows of up to ``window`` slots, each in one sequence
  (sequences drawn in proportion to their length), read with teacher forcing on the target's true features,
  uniform noise of half-width ``noise`` × the features' RMS added to them (EAGLE's augmentation);
- unrolled steps (``unroll``): the head then runs again on its own predicted features, each slot attending to
  the true-feature slots before the draft began and to the predicted ones after, exactly as drafting step
  s + 1 sees them — this is what keeps acceptance up at draft positions 2..K;
- loss, averaged over the steps: smooth L1 of the predicted feature against the true one, plus ``ce_weight`` ×
  the cross-entropy of the draft logits against the token the target wrote next (its own sample: that is
  distillation), or against the target's own distribution (``ce_target`` distribution); only slots that
  predict an answer token count, and tokens outside the draft vocabulary only in the feature loss;
- evaluation: the top-1 agreement with the target's greedy token at each draft position (teacher-forced
  tokens, the head's own features);
- ``init``: a trained head to start from (fine-tuning), grown by ``layers`` beyond its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.drafting.learned.eagle import EagleHead
from verispec.drafting.learned.head import LearnedHead
from verispec.models.llama import Llama
from verispec.training.config import TrainConfig
from verispec.training.recipe import EVAL_POSITIONS, IGNORE, Recipe, TrainingData

__all__ = ["Batch", "EagleRecipe", "batch_loss", "heldout_windows", "sample_batch", "unrolled_features"]


@dataclass(frozen=True)
class Batch:
    """Windows of slots t (see :mod:`verispec.drafting.learned.eagle`) from sequences of a data set,
    right-padded."""

    tokens: Tensor  # [B, W] int64: x_{t+1}
    features: Tensor  # [B, W+1, H] float32: f_t for the W slots, then f of the slot after the window
    next_tokens: Tensor  # [B, W] int64: draft-vocabulary index of x_{t+2}, -100 where it does not count
    mask: Tensor  # [B, W] bool: slots whose predicted token is an answer token (not padding)
    positions: Tensor  # [B, W] int64: the slots t


def _window(data: TrainingData, seq: Tensor, start: Tensor, width: int) -> Batch:
    """The windows of ``width`` slots beginning at slot ``start`` [B] of sequences ``seq`` [B]."""
    offsets = torch.arange(width + 1)  # [W+1]
    slot = start[:, None] + offsets  # [B, W+1]
    last = data.lengths[seq, None] - 1  # [B, 1] last position of each sequence
    base = data.starts[seq, None]  # [B, 1]
    valid = slot[:, :-1] < last  # [B, W] a slot t needs f_{t+1}
    tokens = data.tokens[base + torch.minimum(slot[:, :-1] + 1, last)]  # [B, W]
    features = data.hidden[base + torch.minimum(slot, last)].float()  # [B, W+1, H]
    has_next = slot[:, :-1] + 2 <= last  # [B, W]
    following = data.tokens[base + torch.minimum(slot[:, :-1] + 2, last)]  # [B, W]
    mask = valid & (slot[:, :-1] + 2 >= data.prompt_lengths[seq, None])  # [B, W]
    next_tokens = torch.where(mask & has_next, data.draft_index[following], IGNORE)  # [B, W]
    return Batch(tokens * valid, features, next_tokens, mask, slot[:, :-1] * valid)


def sample_batch(data: TrainingData, windows: int, width: int, generator: torch.Generator) -> Batch:
    """``windows`` random windows of at most ``width`` slots (sequences drawn by length, starts uniform)."""
    slots = (data.lengths - 1).clamp(min=0)  # [S] slots of each sequence
    seq = torch.multinomial(slots.double(), windows, replacement=True, generator=generator)  # [B]
    room = (slots[seq] - width).clamp(min=0) + 1  # [B] possible starts
    start = (torch.rand(windows, generator=generator, dtype=torch.float64) * room).long()  # [B]
    return _window(data, seq, start, int(min(width, int(slots[seq].max()))))


def _unrolled_mask(width: int, step: int) -> Tensor:
    """Attention of unrolled step ``step`` ≥ 1 over the cache of steps 0..step: [W, (step+1)·W] bool.
    Slot t sees the true-feature slots ≤ t − step and, of each step j ≥ 1, the slot t − step + j (its own at
    j = step): what drafting step ``step`` sees when the draft began after slot t − step."""
    t = torch.arange(width)
    blocks = [t[None, :] <= t[:, None] - step]  # [W, W] step 0
    blocks += [t[None, :] == t[:, None] - step + j for j in range(1, step + 1)]  # [W, W] each
    return torch.cat(blocks, dim=1)


def unrolled_features(head: EagleHead, batch: Batch, unroll: int, noise: float, generator: torch.Generator):
    """The predicted features f̂_{t+1} of each step 0..unroll: a list of [B, W, H]. Step 0 reads the true
    features (plus uniform noise of half-width ``noise``); step s reads at slot t what step s − 1 predicted
    at slot t − 1."""
    b, w = batch.tokens.shape
    cache = head.new_cache(b, w, separate_layers=True)
    inputs = batch.features[:, :-1]  # [B, W, H]
    if noise > 0:
        inputs = inputs + (2 * torch.rand(inputs.shape, generator=generator) - 1) * noise
    out = head(batch.tokens, inputs, batch.positions, cache)  # [B, W, H]
    outs = [out]
    for step in range(1, unroll + 1):
        cache = cache.grown(w)
        shifted = torch.cat((batch.features[:, :1], out[:, :-1]), dim=1)  # [B, W, H]
        out = head(batch.tokens, shifted, batch.positions, cache, _unrolled_mask(w, step))
        outs.append(out)
    return outs


def _answer_slots(predicted: Tensor, batch: Batch, step: int) -> tuple[Tensor, Tensor, Tensor]:
    """(predicted, true features, slot mask) of the slots of one unrolled step whose loss counts: [M, H],
    [M, H], [B, W] bool. At step s the draft must begin after a true-feature slot: slots t >= s."""
    mask = batch.mask.clone()  # [B, W]
    mask[:, :step] = False
    return predicted[mask], batch.features[:, 1:][mask], mask


def _step_terms(
    head: EagleHead, predicted: Tensor, batch: Batch, step: int, ce_target: str
) -> tuple[Tensor, Tensor]:
    """(feature loss, cross-entropy) of one unrolled step's predictions [B, W, H]."""
    picked, true, mask = _answer_slots(predicted, batch, step)  # [M, H], [M, H], [B, W]
    regression = F.smooth_l1_loss(picked, true).nan_to_num(0.0)
    logits = head.logits(picked)  # [M, Vd]
    if ce_target == "distribution":
        with torch.no_grad():
            target_probs = head.logits(true).softmax(-1)  # [M, Vd]: the target's own, on the draft vocabulary
        return regression, -(target_probs * logits.log_softmax(-1)).sum(-1).mean().nan_to_num(0.0)
    targets = batch.next_tokens[mask]  # [M]
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    return regression, ce / (targets != IGNORE).sum().clamp(min=1)


def _agreement(head: EagleHead, predicted: Tensor, batch: Batch, step: int) -> Tensor:
    """[agreeing, counted]: the slots of one unrolled step whose draft argmax is the target's own (on the
    draft vocabulary), and all counted slots."""
    picked, true, _ = _answer_slots(predicted, batch, step)  # [M, H] each
    agreeing = (head.logits(picked).argmax(-1) == head.logits(true).argmax(-1)).sum()
    return torch.stack((agreeing, agreeing.new_tensor(picked.shape[0])))


def batch_loss(
    head: EagleHead, batch: Batch, config: TrainConfig, noise: float, generator: torch.Generator
) -> Tensor:
    """The training loss of ``batch`` (a scalar): over the steps 0..config.unroll, the mean of the feature
    loss + ce_weight × the cross-entropy; ``noise``: the feature noise's half-width (0: none)."""
    outs = unrolled_features(head, batch, config.unroll, noise, generator)
    terms = [_step_terms(head, f, batch, step, config.ce_target) for step, f in enumerate(outs)]
    total = sum(reg + config.ce_weight * ce for reg, ce in terms)
    assert isinstance(total, Tensor)  # the sum of at least one step's terms (unroll >= 0)
    return total / len(terms)


def _evaluate(head: EagleHead, data: TrainingData, max_tokens: int, window: int) -> list[float]:
    """Held-out agreement with the target's greedy choice at draft positions 1..EVAL_POSITIONS (teacher-forced
    tokens, the head's own features; an estimate of greedy acceptance): whole sequences in a fixed shuffled
    order (greedy and sampled answers mixed), one window each, until ``max_tokens`` slots."""
    totals = torch.zeros(EVAL_POSITIONS, 2, dtype=torch.long)  # [positions, (agreeing, counted)]
    with torch.no_grad():
        for seq, width in heldout_windows(data, window, max_tokens):
            batch = _window(data, torch.tensor([seq]), torch.zeros(1, dtype=torch.long), width)
            outs = unrolled_features(head, batch, EVAL_POSITIONS - 1, 0.0, torch.Generator())  # no noise
            for step, predicted in enumerate(outs):
                totals[step] += _agreement(head, predicted, batch, step)
    return (totals[:, 0] / totals[:, 1].clamp(min=1)).tolist()


def heldout_windows(data: TrainingData, window: int, max_tokens: int) -> Iterator[tuple[int, int]]:
    """The windows an evaluation reads, (sequence, slots): whole sequences in a fixed shuffled order (greedy
    and sampled answers mixed), one window of at most ``window`` slots each from its start, until
    ``max_tokens`` slots."""
    used = 0
    for seq in torch.randperm(data.starts.shape[0], generator=torch.Generator().manual_seed(0)).tolist():
        width = min(window, int(data.lengths[seq]) - 1)
        if width < 1:
            continue
        yield seq, width
        used += width
        if used >= max_tokens:
            return


class EagleRecipe(Recipe):
    """EAGLE heads: windows, teacher forcing and unrolled steps (module docstring), grown from ``start``."""

    def __init__(self, start: EagleHead | None = None) -> None:
        self.start = start

    @classmethod
    def of(cls, target: Llama, config: TrainConfig, start: LearnedHead | None) -> EagleRecipe:
        assert start is None or isinstance(start, EagleHead)  # init is refused for the other kinds
        return cls(start)

    def new_head(
        self,
        target: Llama,
        config: TrainConfig,
        draft_vocab: Tensor,
        metadata: dict,
        generator: torch.Generator,
    ) -> EagleHead:
        head = EagleHead.create(target, draft_vocab, generator, metadata, config.layers)
        if self.start is not None:
            head.adopt(self.start)
        return head

    def loss(
        self,
        head: EagleHead,
        data: TrainingData,
        config: TrainConfig,
        noise: float,
        generator: torch.Generator,
    ) -> Tensor:
        batch = sample_batch(data, config.batch_tokens // config.window, config.window, generator)
        return batch_loss(head, batch, config, noise, generator)

    def evaluate(self, head: EagleHead, data: TrainingData, config: TrainConfig) -> tuple[list[float], dict]:
        return _evaluate(head, data, config.eval_tokens, config.window), {}

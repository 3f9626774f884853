"""Training an EAGLE-3 head (Li et al. 2025) in the layout its authors publish
(:class:`~verispec.drafting.learned.eagle3.Eagle3Head`): :class:`Eagle3Recipe`, ``train-drafter --kind
eagle3``.

- features: the inputs of a low, a middle and a high layer of the target (:func:`~verispec.drafting.learned.
  eagle3.aux_layers`), fused by the head's ``fc`` [H, 3H]; they are never stored (3 × H a position): each
  batch's windows run through the target once, without gradients, from their sequence's start, which gives
  the three layers' states and the target's distribution at every position (a data set of token ids alone
  suffices: the target's own answers, or offline text, :mod:`verispec.training.text`);
- loss: the cross-entropy of the draft logits against the target's distribution on the draft vocabulary
  alone (:func:`~verispec.training.recipe.distilled_ce`; no feature regression), over the steps 0..``unroll``
  weighted 0.8^j as the authors weight them;
- training-time test: step 0 reads the fused states (teacher forcing), step j > 0 reads at slot t what step
  j − 1 output at slot t − 1 and attends to the true slots up to t − j and to its own earlier steps' slots of
  the same draft — what drafting step j sees (:func:`verispec.training.eagle.unrolled_features`, the same
  masks as verispec's EAGLE heads; slot t of step j is draft position j + 1 after context t − j);
- draft vocabulary: the ``draft_vocab`` most frequent target tokens of the training split (the loop's), as
  ``d2t``/``t2d``; ``lm_head`` starts from the target's own rows of it and is trained, the embedding is the
  target's, frozen and never written;
- evaluation: agreement of the draft's argmax with the target's greedy token over its whole vocabulary at
  draft positions 1..4 (teacher-forced tokens, the head's own states), on held-out windows;
- the head is written as ``model.safetensors`` + ``config.json`` (:meth:`Eagle3Head.save`): loadable by
  ``--drafter eagle3 --drafter-path DIR``, vLLM and SGLang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.drafting.learned.eagle import EagleHead
from verispec.drafting.learned.eagle3 import WEIGHTS, Eagle3Head
from verispec.drafting.learned.head import LearnedHead
from verispec.errors import UsageError
from verispec.models.llama import Llama
from verispec.training.config import TrainConfig
from verispec.training.eagle import Batch, heldout_windows, unrolled_features
from verispec.training.recipe import EVAL_POSITIONS, IGNORE, Recipe, TrainingData, distilled_ce

__all__ = ["STEP_DECAY", "Eagle3Recipe", "Windows", "agreement", "target_windows"]

STEP_DECAY = 0.8  # the weight of unrolled step j's loss is STEP_DECAY ** j (the authors' ploss_weight)
_NOT_USED = (
    "ce_target",
    "ce_weight",
    "noise",
)  # the EAGLE recipe's settings: refused unless at their defaults


@dataclass(frozen=True)
class Windows:
    """Windows of slots t of a data set's sequences with what the target computes there (right-padded)."""

    tokens: Tensor  # [B, W] int64: x_{t+1}
    hidden: Tensor  # [B, W+1, H·(1 + taps)]: the target's final state at t, then its tapped layers' inputs
    target: Tensor  # [B, W, H]: the target's final state at t + 1, whose logits predict x_{t+2}
    mask: Tensor  # [B, W] bool: slots whose predicted token x_{t+2} counts (an answer's, not padding)
    positions: Tensor  # [B, W] int64: the slots t


def target_windows(target: Llama, data: TrainingData, seq: Tensor, start: Tensor, width: int) -> Windows:
    """The windows of at most ``width`` slots beginning at slot ``start`` [B] of sequences ``seq`` [B], the
    target run over each sequence from its start to the window's end without gradients (its states depend
    on everything before)."""
    last = data.lengths[seq] - 1  # [B] the last position of each sequence
    ends = torch.minimum(start + width, last)  # [B] the last position each window reads
    length = int(ends.max()) + 1
    at = torch.arange(length)  # [L]
    index = data.starts[seq, None] + torch.minimum(at[None, :], ends[:, None])  # [B, L]
    tokens = torch.where(at[None, :] <= ends[:, None], data.tokens[index], 0)  # [B, L] right-padded
    with torch.no_grad():
        states = target.forward_hidden(tokens, at.expand(len(seq), -1), target.new_cache(len(seq), length))
    states = states.float()  # [B, L, H·(1 + taps)]
    slot = start[:, None] + torch.arange(width)  # [B, W]
    valid = slot < ends[:, None]  # [B, W]: a slot t needs position t + 1
    slot = torch.where(valid, slot, 0)
    following = torch.where(valid, slot + 1, 0)  # [B, W]

    def gathered(where: Tensor) -> Tensor:  # the states at positions where [B, W]: [B, W, H·(1 + taps)]
        return states.gather(1, where[..., None].expand(-1, -1, states.shape[-1]))

    after = gathered(following)  # [B, W, ...]
    return Windows(
        tokens=tokens.gather(1, following),
        hidden=torch.cat((gathered(slot), after[:, -1:]), 1),
        target=after[..., : target.config.hidden_size],
        mask=valid & (slot + 2 >= data.prompt_lengths[seq, None]),
        positions=slot,
    )


def _as_batch(windows: Windows, features: Tensor) -> Batch:
    """The windows as :func:`unrolled_features` reads them, with the head's ``features`` [B, W+1, H]."""
    return Batch(
        windows.tokens, features, torch.full_like(windows.tokens, IGNORE), windows.mask, windows.positions
    )


def _counted(windows: Windows, step: int) -> Tensor:
    """The slots of unrolled step ``step`` that count: [B, W] bool (the draft must begin after a true slot:
    slots t >= step)."""
    mask = windows.mask.clone()
    mask[:, :step] = False
    return mask


def agreement(
    head: EagleHead,
    target: Llama,
    data: TrainingData,
    read: Callable[[Tensor], Tensor],
    max_tokens: int,
    window: int,
) -> list[float]:
    """Held-out agreement of ``head``'s draft argmax (mapped to target ids) with the target's greedy token
    over its whole vocabulary at draft positions 1..EVAL_POSITIONS (teacher-forced tokens, the head's own
    features; an estimate of greedy acceptance) over the windows of :func:`heldout_windows`. ``read``: the
    head's features from the target's states [..., H·(1 + taps)] (an EAGLE-3 head's fc of its taps; an EAGLE
    head's final state). The same measure for every head that reads the target's states, whatever its draft
    vocabulary."""
    totals = torch.zeros(EVAL_POSITIONS, 2, dtype=torch.long)  # [positions, (agreeing, counted)]
    with torch.no_grad():
        for seq, width in heldout_windows(data, window, max_tokens):
            start = torch.zeros(1, dtype=torch.long)
            windows = target_windows(target, data, torch.tensor([seq]), start, width)
            greedy = target.logits(windows.target).argmax(-1)  # [1, W]: target ids
            batch = _as_batch(windows, read(windows.hidden))
            outs = unrolled_features(head, batch, EVAL_POSITIONS - 1, 0.0, torch.Generator())  # no noise
            for step, out in enumerate(outs):
                mask = _counted(windows, step)
                drafted = head.draft_vocab[head.logits(out[mask]).argmax(-1)]
                totals[step] += torch.stack((drafted.eq(greedy[mask]).sum(), mask.sum()))
    return (totals[:, 0] / totals[:, 1].clamp(min=1)).tolist()


class Eagle3Recipe(Recipe):
    """EAGLE-3 heads: the target run per batch, the distilled cross-entropy over the unrolled steps (module
    docstring)."""

    reads_stored_hidden = False
    drafter_name = WEIGHTS

    def __init__(self, target: Llama) -> None:
        self.target = target
        self.rows: Tensor | None = None  # [Vd, H] the target's own head rows of the draft vocabulary

    @classmethod
    def of(cls, target: Llama, config: TrainConfig, start: LearnedHead | None) -> Eagle3Recipe:
        if config.layers != 1:
            raise UsageError(
                f"an eagle3 head has one decoder layer (the published layout), not layers = {config.layers}"
            )
        default = TrainConfig()
        for name in _NOT_USED:
            if getattr(config, name) != getattr(default, name):
                raise UsageError(
                    f"the eagle3 recipe has no {name} (its loss is the cross-entropy against the target's "
                    "distribution alone, on the target's own states)"
                )
        return cls(target)

    def new_head(
        self,
        target: Llama,
        config: TrainConfig,
        draft_vocab: Tensor,
        metadata: dict,
        generator: torch.Generator,
    ) -> Eagle3Head:
        head = Eagle3Head.create(target, draft_vocab, generator, metadata)
        self.rows = head.head_weight.detach().clone()  # before any training step: the target's own
        return head

    def loss(
        self,
        head: Eagle3Head,
        data: TrainingData,
        config: TrainConfig,
        noise: float,
        generator: torch.Generator,
    ) -> Tensor:
        windows = self.sample(data, config.batch_tokens // config.window, config.window, generator)
        outs = unrolled_features(
            head,
            _as_batch(windows, head.fuse(windows.hidden[..., head.hidden_size :])),
            config.unroll,
            0.0,
            generator,
        )
        return step_loss(head, self.target_logits(windows), windows, outs)

    def sample(self, data: TrainingData, count: int, width: int, generator: torch.Generator) -> Windows:
        """``count`` random windows of at most ``width`` slots (sequences drawn by length, starts uniform)."""
        slots = (data.lengths - 1).clamp(min=0)  # [S] slots of each sequence
        seq = torch.multinomial(slots.double(), count, replacement=True, generator=generator)  # [B]
        room = (slots[seq] - width).clamp(min=0) + 1  # [B] possible starts
        start = (torch.rand(count, generator=generator, dtype=torch.float64) * room).long()  # [B]
        return target_windows(self.target, data, seq, start, int(min(width, int(slots[seq].max()))))

    def target_logits(self, windows: Windows) -> Tensor:
        """The target's logits on the draft vocabulary at each slot's next position: [B, W, Vd]."""
        assert self.rows is not None  # new_head
        return F.linear(windows.target, self.rows)

    def evaluate(self, head: Eagle3Head, data: TrainingData, config: TrainConfig) -> tuple[list[float], dict]:
        h = head.hidden_size
        return agreement(
            head, self.target, data, lambda s: head.fuse(s[..., h:]), config.eval_tokens, config.window
        ), {}


def step_loss(head: EagleHead, target_logits: Tensor, windows: Windows, outs: list[Tensor]) -> Tensor:
    """Σ_j STEP_DECAY^j · the distilled cross-entropy of step j's draft logits against ``target_logits``
    [B, W, Vd], over the slots that count at that step, normalised by Σ_j STEP_DECAY^j."""
    total = torch.zeros(())
    for step, out in enumerate(outs):
        mask = _counted(windows, step)
        picked = target_logits[mask]  # [M, Vd]
        ce = distilled_ce(head.logits(out[mask]), picked, picked.new_ones(picked.shape[0], dtype=torch.bool))
        total = total + STEP_DECAY**step * ce
    return total / sum(STEP_DECAY**step for step in range(len(outs)))

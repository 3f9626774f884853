"""Training a learned drafter on a data set of :mod:`verispec.drafting.learned.data` (the target's own
answers, with its final hidden state at every position), by kind: an EAGLE head
(:class:`~verispec.drafting.learned.eagle.EagleHead`), Medusa heads
(:class:`~verispec.drafting.learned.medusa.MedusaHeads`), a trained exit
(:class:`~verispec.drafting.learned.exit.ExitAdapter`) or lookahead tokens
(:class:`~verispec.drafting.learned.lookahead.LookaheadTokens`). What every kind shares: the draft vocabulary,
AdamW with warmup and cosine decay, the progress bar, held-out top-1 per draft position in ``log.jsonl``,
atomic checkpoints with exact ``resume``, and the target's fingerprint. Each kind's :class:`Recipe` gives its
fresh head, its batch loss and its evaluation.

The EAGLE recipe, on CPU in hours:

- draft vocabulary: the ``draft_vocab`` most frequent tokens of the training split's answers;
- batches: ``batch_tokens // window`` random windows of up to ``window`` slots, each in one sequence
  (sequences drawn in proportion to their length), read with teacher forcing on the target's true features,
  uniform noise of half-width ``noise`` × the features' RMS added to them (EAGLE's augmentation);
- unrolled steps (``unroll``): the head then runs again on its own predicted features, each slot attending to
  the true-feature slots before the draft began and to the predicted ones after, exactly as drafting step
  s + 1 sees them — this is what keeps acceptance up at draft positions 2..K;
- loss, averaged over the steps: smooth L1 of the predicted feature against the true one, plus ``ce_weight`` ×
  the cross-entropy of the draft logits against the token the target wrote next (its own sample: that is
  distillation); only slots that predict an answer token count, and tokens outside the draft vocabulary
  only in the feature loss;
- AdamW (β = 0.9, 0.95), learning rate warmed up linearly over ``warmup`` steps then cosine-decayed to 10 %,
  gradient norm clipped at ``grad_clip``;
- every ``eval_every`` steps: the held-out top-1 accuracy at each draft position (teacher-forced tokens, the
  head's own features), shown on the progress bar and appended to ``log.jsonl`` with the same measure on the
  training split (its gap to the held-out one says whether more data or more steps would help);
- every ``checkpoint_every`` steps: ``checkpoint.pt`` (weights, optimizer, step, random state) and the
  drafter file ``drafter.safetensors``, each written atomically; ``resume`` continues from the checkpoint and
  ends exactly where an uninterrupted run ends.

The Medusa recipe: ``batch_tokens`` random answer positions t; head i's cross-entropy against the token the
target wrote at t + 1 + i (``ce_target`` token), or against the target's own distribution there (distribution:
self-distillation, Medusa-2's); evaluated as each head's held-out accuracy at ranks 0..3 (the tree's shape is
chosen from them). The exit recipe: the target's first ``exit_layer`` layers computed once over both splits,
then at random answer positions the adapter's cross-entropy against the target's next token or distribution;
evaluated as held-out top-1 against the target's greedy token, beside the untrained exit's. The lookahead
recipe: ``batch_tokens // window`` sequences (drawn by length), each run through the frozen target into a
cache without gradient, then ``window`` random answer positions t of it each followed by the m lookahead
tokens (every group seeing the sequence up to t and its own earlier tokens, as drafting after x_t does), the
gradient flowing through every layer of the target back to the embeddings alone; lookahead j's cross-entropy
against the token the target wrote at t + 1 + j (or its distribution there); evaluated as held-out top-1
against the target's greedy token there, per lookahead token.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from verispec.drafting.learned.config import THROUGH_TARGET, TrainConfig
from verispec.drafting.learned.data import answered_precision, load_split, read_data_meta
from verispec.drafting.learned.eagle import EagleHead
from verispec.drafting.learned.exit import ExitAdapter, check_exit_layer, exit_features
from verispec.drafting.learned.head import LearnedHead, native_target, target_fingerprint
from verispec.drafting.learned.kinds import load_head
from verispec.drafting.learned.lookahead import LookaheadTokens, lookahead_mask
from verispec.drafting.learned.medusa import TOP_RANKS, MedusaHeads
from verispec.errors import UsageError
from verispec.files import atomic_path
from verispec.models.base import LanguageModel
from verispec.models.llama import KVCache, Llama, run_layers

__all__ = [
    "Batch",
    "TrainConfig",
    "TrainingData",
    "batch_loss",
    "draft_index",
    "sample_batch",
    "train_drafter",
    "unrolled_features",
]

CHECKPOINT = "checkpoint.pt"
DRAFTER = "drafter.safetensors"
LOG = "log.jsonl"
EVAL_POSITIONS = 4  # draft positions whose held-out accuracy is reported
_IGNORE = -100  # cross-entropy target of a slot that does not count
_FEATURE_CHECK_TOKENS = 32  # positions of the data set recomputed to check that it belongs to the target
_FEATURE_CHECK_TOLERANCE = 0.02  # relative error allowed (the data set stores float16)
# kinds trained through the float32 target (config.THROUGH_TARGET), whatever precision answered the data: the
# same weights computed another way differ more (SmolLM2's Q4_1 kernels, 8-bit activations, vs float32: 0.035)
_OTHER_PRECISION_TOLERANCE = 0.1


# ---------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class TrainingData:
    """One split of a data set, with each token's index in the draft vocabulary."""

    tokens: Tensor  # [N] int64, every sequence concatenated
    hidden: Tensor  # [N, H] float16: the target's final hidden state at each position
    starts: Tensor  # [S] int64: first position of each sequence
    lengths: Tensor  # [S] int64
    prompt_lengths: Tensor  # [S] int64
    draft_index: Tensor  # [V] int64: position of each target token in the draft vocabulary, or -100
    ends: Tensor  # [N] int64: the end (exclusive) of each position's sequence
    answers: Tensor  # [M] int64: the positions t whose next token x_{t+1} is one the target wrote
    reads: Tensor | None = None  # [N, H] float16: what the drafter reads, when not ``hidden`` (an exit's)

    @classmethod
    def from_split(cls, split: dict[str, Tensor], draft_index: Tensor) -> TrainingData:
        """From a split as :func:`verispec.drafting.learned.data.load_split` returns it."""
        offsets = split["offsets"].long()  # [S+1]
        starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]  # [S] each
        prompts = split["prompt_lengths"].long()  # [S]
        firsts = starts + (prompts - 1).clamp(min=0)  # [S] the first position predicting an answer token
        counts = (offsets[1:] - 1 - firsts).clamp(min=0)  # [S]
        within = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts).repeat_interleave(counts)
        return cls(
            tokens=split["tokens"].long(),
            hidden=split["hidden"],
            starts=starts,
            lengths=lengths,
            prompt_lengths=prompts,
            draft_index=draft_index,
            ends=offsets[1:].repeat_interleave(lengths),
            answers=firsts.repeat_interleave(counts) + within,
        )

    def following(self, positions: Tensor, ahead: int) -> Tensor:
        """The draft-vocabulary index of x_{t+ahead} for positions t [M], -100 past the end of t's sequence:
        [M] int64."""
        later = positions + ahead  # [M]
        inside = later < self.ends[positions]  # [M]
        return torch.where(
            inside, self.draft_index[self.tokens[later.clamp(max=self.tokens.shape[0] - 1)]], _IGNORE
        )


def draft_index(draft_vocab: Tensor, vocab_size: int) -> Tensor:
    """For each target token, its position in ``draft_vocab`` [Vd], or -100 (not drafted): [V] int64."""
    index = torch.full((vocab_size,), _IGNORE, dtype=torch.long)  # [V]
    index[draft_vocab] = torch.arange(draft_vocab.shape[0])
    return index


def _answer_tokens(split: dict[str, Tensor]) -> Tensor:
    """The tokens the target wrote (after each prompt) in a split: [M] int64."""
    offsets, prompts = split["offsets"].tolist(), split["prompt_lengths"].tolist()
    keep = torch.zeros(split["tokens"].shape[0], dtype=torch.bool)  # [N]
    for start, end, prompt in zip(offsets[:-1], offsets[1:], prompts, strict=True):
        keep[start + prompt : end] = True
    return split["tokens"][keep].long()


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
    next_tokens = torch.where(mask & has_next, data.draft_index[following], _IGNORE)  # [B, W]
    return Batch(tokens * valid, features, next_tokens, mask, slot[:, :-1] * valid)


def sample_batch(data: TrainingData, windows: int, width: int, generator: torch.Generator) -> Batch:
    """``windows`` random windows of at most ``width`` slots (sequences drawn by length, starts uniform)."""
    slots = (data.lengths - 1).clamp(min=0)  # [S] slots of each sequence
    seq = torch.multinomial(slots.double(), windows, replacement=True, generator=generator)  # [B]
    room = (slots[seq] - width).clamp(min=0) + 1  # [B] possible starts
    start = (torch.rand(windows, generator=generator, dtype=torch.float64) * room).long()  # [B]
    return _window(data, seq, start, int(min(width, int(slots[seq].max()))))


# ---------------------------------------------------------------------------------------------- model


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
    ce = F.cross_entropy(logits, targets, ignore_index=_IGNORE, reduction="sum")
    return regression, ce / (targets != _IGNORE).sum().clamp(min=1)


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


# ---------------------------------------------------------------------------------------------- recipes


def _later(data: TrainingData, positions: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The positions t + j, j = 1..count, after each of ``positions`` [M] (whose states predict what a Medusa
    head or a lookahead token guesses at t), clamped into the data set, and whether each lies inside t's
    sequence: [M, count] int64 and [M, count] bool."""
    later = positions[:, None] + torch.arange(1, count + 1)  # [M, count]
    return later.clamp(max=data.tokens.shape[0] - 1), later < data.ends[positions][:, None]


class Recipe(Protocol):
    """What a kind of learned drafter brings to the training loop."""

    def prepare(self, target: Llama, data: TrainingData) -> TrainingData:
        """``data`` with whatever the kind reads computed once (an exit's features); by default unchanged."""
        return data

    def new_head(
        self,
        target: Llama,
        config: TrainConfig,
        draft_vocab: Tensor,
        metadata: dict,
        generator: torch.Generator,
    ) -> LearnedHead:
        """A fresh trainable head on ``draft_vocab`` [Vd], drawn from ``generator``."""
        ...

    def loss(
        self, head: Any, data: TrainingData, config: TrainConfig, noise: float, generator: torch.Generator
    ) -> Tensor:
        """The loss (a scalar) of one random batch of ``data``."""
        ...

    def evaluate(self, head: Any, data: TrainingData, config: TrainConfig) -> tuple[list[float], dict]:
        """(top-1 agreement with the target's greedy token per draft position, further measures for the
        drafter file's training record)."""
        ...


def _evaluate(head: EagleHead, data: TrainingData, max_tokens: int, window: int) -> list[float]:
    """Held-out agreement with the target's greedy choice at draft positions 1..EVAL_POSITIONS (teacher-forced
    tokens, the head's own features; an estimate of greedy acceptance): whole sequences in a fixed shuffled
    order (greedy and sampled answers mixed), one window each, until ``max_tokens`` slots."""
    totals = torch.zeros(EVAL_POSITIONS, 2, dtype=torch.long)  # [positions, (agreeing, counted)]
    used, generator = 0, torch.Generator().manual_seed(0)  # the order; no noise is drawn
    with torch.no_grad():
        for seq in torch.randperm(data.starts.shape[0], generator=generator).tolist():
            width = min(window, int(data.lengths[seq]) - 1)
            if width < 1:
                continue
            batch = _window(data, torch.tensor([seq]), torch.zeros(1, dtype=torch.long), width)
            outs = unrolled_features(head, batch, EVAL_POSITIONS - 1, 0.0, generator)
            for step, predicted in enumerate(outs):
                totals[step] += _agreement(head, predicted, batch, step)
            used += width
            if used >= max_tokens:
                break
    return (totals[:, 0] / totals[:, 1].clamp(min=1)).tolist()


class EagleRecipe(Recipe):
    """EAGLE heads: windows, teacher forcing and unrolled steps (module docstring), grown from ``start``."""

    def __init__(self, start: EagleHead | None = None) -> None:
        self.start = start

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


def _sample_positions(data: TrainingData, count: int, generator: torch.Generator) -> Tensor:
    """``count`` answer positions drawn uniformly with replacement: [count] int64."""
    return data.answers[torch.randint(data.answers.shape[0], (count,), generator=generator)]


def _eval_positions(data: TrainingData, count: int) -> Tensor:
    """The first ``count`` answer positions of a fixed shuffled order: [min(count, M)] int64."""
    order = torch.randperm(data.answers.shape[0], generator=torch.Generator().manual_seed(0))
    return data.answers[order[:count]]


def _distilled_ce(logits: Tensor, target_logits: Tensor, valid: Tensor) -> Tensor:
    """Cross-entropy of draft ``logits`` [..., Vd] against the target's distribution on the draft vocabulary
    (``target_logits`` [..., Vd]) where ``valid`` [...] bool, averaged (0 when none is)."""
    probs = target_logits.softmax(-1)  # [..., Vd]
    return -(probs * logits.log_softmax(-1)).sum(-1)[valid].mean().nan_to_num(0.0)


class MedusaRecipe(Recipe):
    """Medusa heads: random answer positions, each head against the token (or distribution) it must guess."""

    def new_head(
        self,
        target: Llama,
        config: TrainConfig,
        draft_vocab: Tensor,
        metadata: dict,
        generator: torch.Generator,
    ) -> MedusaHeads:
        return MedusaHeads.create(target, draft_vocab, generator, metadata, config.heads)

    def loss(
        self,
        head: MedusaHeads,
        data: TrainingData,
        config: TrainConfig,
        noise: float,
        generator: torch.Generator,
    ) -> Tensor:
        positions = _sample_positions(data, config.batch_tokens, generator)  # [M]
        logits = head.logits(head(data.hidden[positions]))  # [M, K, Vd]
        if config.ce_target == "distribution":
            later, valid = _later(data, positions, head.num_heads)  # [M, K] each
            with torch.no_grad():
                target_logits = head.logits(data.hidden[later].float())  # [M, K, Vd]
            return _distilled_ce(logits, target_logits, valid)
        targets = torch.stack([data.following(positions, 1 + i) for i in range(1, head.num_heads + 1)], 1)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=_IGNORE).nan_to_num(0.0)

    def evaluate(
        self, head: MedusaHeads, data: TrainingData, config: TrainConfig
    ) -> tuple[list[float], dict]:
        """Per head, how often the target's greedy token is the head's rank-r token, r = 0..TOP_RANKS-1."""
        positions = _eval_positions(data, config.eval_tokens)  # [M]
        with torch.no_grad():
            logits = head.logits(head(data.hidden[positions]))  # [M, K, Vd]
            later, valid = _later(data, positions, head.num_heads)  # [M, K] each
            greedy = head.logits(data.hidden[later].float()).argmax(-1, keepdim=True)  # [M, K, 1]
            rank = (logits > logits.gather(-1, greedy)).sum(-1)  # [M, K]
        table = [
            [float((rank[:, i][valid[:, i]] == r).float().mean().nan_to_num(0.0)) for r in range(TOP_RANKS)]
            for i in range(head.num_heads)
        ]
        return [row[0] for row in table], {
            "heldout_rank_accuracy": [[round(a, 4) for a in row] for row in table]
        }


class ExitRecipe(Recipe):
    """A trained exit: the target's first layers computed once, then random answer positions."""

    def __init__(self, exit_layer: int) -> None:
        self.exit_layer = exit_layer

    def prepare(self, target: Llama, data: TrainingData) -> TrainingData:
        offsets = torch.cat([data.starts, (data.starts + data.lengths)[-1:]])  # [S+1]
        return dataclasses.replace(data, reads=exit_features(target, self.exit_layer, data.tokens, offsets))

    def new_head(
        self,
        target: Llama,
        config: TrainConfig,
        draft_vocab: Tensor,
        metadata: dict,
        generator: torch.Generator,
    ) -> ExitAdapter:
        return ExitAdapter.create(target, draft_vocab, generator, metadata, self.exit_layer)

    @staticmethod
    def _reads(data: TrainingData, positions: Tensor) -> Tensor:
        assert data.reads is not None  # prepare() computed them
        return data.reads[positions].float()  # [M, H]

    def loss(
        self,
        head: ExitAdapter,
        data: TrainingData,
        config: TrainConfig,
        noise: float,
        generator: torch.Generator,
    ) -> Tensor:
        positions = _sample_positions(data, config.batch_tokens, generator)  # [M]
        logits = head.logits(head(self._reads(data, positions)))  # [M, Vd]
        if config.ce_target == "distribution":
            with torch.no_grad():
                target_logits = head.logits(data.hidden[positions].float())  # [M, Vd]
            return _distilled_ce(logits, target_logits, torch.ones_like(positions, dtype=torch.bool))
        return F.cross_entropy(logits, data.following(positions, 1), ignore_index=_IGNORE).nan_to_num(0.0)

    def evaluate(
        self, head: ExitAdapter, data: TrainingData, config: TrainConfig
    ) -> tuple[list[float], dict]:
        """Top-1 agreement with the target's greedy token, and the untrained exit's (the adapter left out)."""
        positions = _eval_positions(data, config.eval_tokens)  # [M]
        with torch.no_grad():
            reads = self._reads(data, positions)  # [M, H]
            greedy = head.logits(data.hidden[positions].float()).argmax(-1)  # [M]
            trained = (head.logits(head(reads)).argmax(-1) == greedy).float().mean()
            untrained = (head.logits(reads).argmax(-1) == greedy).float().mean()
        return [float(trained.nan_to_num(0.0))], {
            "heldout_untrained_top1": round(float(untrained.nan_to_num(0.0)), 4)
        }


class LookaheadRecipe(Recipe):
    """Lookahead tokens, trained through the frozen target: a sequence in the target's cache (no gradient:
    it does not depend on what is trained), then the lookahead tokens after random answer positions of it,
    each group seeing what drafting there sees (:func:`~verispec.drafting.learned.lookahead.lookahead_mask`),
    and the gradient through every layer of the target back to the lookahead embeddings."""

    def __init__(self, target: Llama, count: int) -> None:
        if target.on_native_kernels:
            raise UsageError(
                "lookahead tokens are trained through the target's float32 layers (the native kernels "
                "compute no gradients): load the target in precision fp32"
            )
        self.target = target.requires_grad_(False)  # frozen: only the embeddings' gradient is wanted
        self.count = count

    def new_head(
        self,
        target: Llama,
        config: TrainConfig,
        draft_vocab: Tensor,
        metadata: dict,
        generator: torch.Generator,
    ) -> LookaheadTokens:
        return LookaheadTokens.create(target, draft_vocab, generator, metadata, self.count)

    def hidden(self, head: LookaheadTokens, data: TrainingData, seq: int, anchors: Tensor) -> Tensor:
        """The target's final hidden states at the lookahead tokens after ``anchors`` [A] (positions of the
        data set inside sequence ``seq``, ascending): [A, m, H] float32, differentiable in the embeddings."""
        target, m = self.target, head.num_tokens
        start, length = int(data.starts[seq]), int(data.lengths[seq])
        c = target.config
        cache = KVCache(
            c.num_layers,
            1,
            c.num_kv_heads,
            length + anchors.shape[0] * m,
            c.head_dim,
            dtype=target.dtype,
            device=target.device,
            separate_layers=True,
        )
        layers: Any = target.model.layers  # the _DecoderLayers run_layers takes
        with torch.no_grad():
            tokens = data.tokens[start : start + length].to(target.device)[None]  # [1, L]
            positions = torch.arange(length, device=target.device)[None]  # [1, L]
            run_layers(layers, target.model.embed_tokens(tokens), positions, cache, target.inv_freq)
        local = anchors - start  # [A] slots of the pending tokens
        inputs = head.embeddings.to(target.dtype).repeat(anchors.shape[0], 1)[None]  # [1, A·m, H]
        ahead = (local[:, None] + torch.arange(1, m + 1)).reshape(1, -1).to(target.device)  # [1, A·m]
        mask = lookahead_mask(local, length, m).to(target.device)  # [A·m, L + A·m]
        out = run_layers(layers, inputs, ahead, cache, target.inv_freq, mask)  # [1, A·m, H]
        return target.model.norm(out)[0].float().view(anchors.shape[0], m, -1)

    @staticmethod
    def _anchors(data: TrainingData, seq: int) -> Tensor:
        """The answer positions of sequence ``seq`` (each has a next token the target wrote): [M] int64."""
        start, end = int(data.starts[seq]), int(data.starts[seq] + data.lengths[seq])
        return data.answers[(data.answers >= start) & (data.answers < end)]

    def loss(
        self,
        head: LookaheadTokens,
        data: TrainingData,
        config: TrainConfig,
        noise: float,
        generator: torch.Generator,
    ) -> Tensor:
        """``batch_tokens // window`` sequences (drawn by length), ``window`` random answer positions each."""
        weights = data.lengths.double()  # [S]
        total = head.embeddings.new_zeros(())
        sequences = torch.multinomial(
            weights, config.batch_tokens // config.window, True, generator=generator
        )
        for seq in sequences.tolist():
            candidates = self._anchors(data, seq)  # [M]
            if candidates.numel() == 0:
                continue
            pick = torch.randperm(candidates.shape[0], generator=generator)[: config.window]
            anchors = candidates[pick].sort().values  # [A]
            logits = head.logits(self.hidden(head, data, seq, anchors))  # [A, m, Vd]
            later, valid = _later(data, anchors, head.num_tokens)  # [A, m] each
            if config.ce_target == "distribution":
                with torch.no_grad():
                    target_logits = head.logits(data.hidden[later].float())  # [A, m, Vd]
                total = total + _distilled_ce(logits, target_logits, valid)
            else:
                ahead = torch.stack(
                    [data.following(anchors, 1 + j) for j in range(1, head.num_tokens + 1)], 1
                )
                ce = F.cross_entropy(logits.flatten(0, 1), ahead.flatten(), ignore_index=_IGNORE)
                total = total + ce.nan_to_num(0.0)
        return total / sequences.shape[0]

    def evaluate(
        self, head: LookaheadTokens, data: TrainingData, config: TrainConfig
    ) -> tuple[list[float], dict]:
        """Per lookahead token j, how often its top token is the target's greedy token j + 1 positions after
        the anchor's next: whole sequences in a fixed shuffled order, every answer position, until
        ``eval_tokens`` anchors (draft token 1, the target's own, is not counted: it is the target's)."""
        totals = torch.zeros(head.num_tokens, 2)  # [m, (agreeing, counted)]
        order = torch.randperm(data.starts.shape[0], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for seq in order.tolist():
                anchors = self._anchors(data, seq)  # [A]
                if anchors.numel() == 0:
                    continue
                guess = head.logits(self.hidden(head, data, seq, anchors)).argmax(-1)  # [A, m]
                later, valid = _later(data, anchors, head.num_tokens)  # [A, m] each
                greedy = head.logits(data.hidden[later].float()).argmax(-1)  # [A, m]
                totals[:, 0] += ((guess == greedy) & valid).sum(0)
                totals[:, 1] += valid.sum(0)
                if totals[0, 1] >= config.eval_tokens:
                    break
        return (totals[:, 0] / totals[:, 1].clamp(min=1)).tolist(), {}


def _recipe(config: TrainConfig, target: Llama, start: LearnedHead | None) -> Recipe:
    """The recipe of ``config.kind`` (UsageError for an exit layer the target lacks)."""
    if config.kind == "medusa":
        return MedusaRecipe()
    if config.kind == "exit":
        return ExitRecipe(check_exit_layer(target, config.exit_layer))
    if config.kind == "lookahead":
        return LookaheadRecipe(target, config.lookahead)
    assert start is None or isinstance(start, EagleHead)  # init is refused for the other kinds
    return EagleRecipe(start)


# ---------------------------------------------------------------------------------------------- training


def _draft_vocabulary(answers: Tensor, size: int, vocab: int) -> Tensor:
    """The ``size`` most frequent of the ``answers`` tokens (ties: lower id first), ascending:
    [min(size, V)] int64."""
    counts = torch.bincount(answers, minlength=vocab)  # [V]
    order = torch.argsort(counts, descending=True, stable=True)  # [V]
    return order[: min(size, vocab)].sort().values


def _check_data(
    directory: Path, target: Llama, label: str, tolerance: float
) -> tuple[dict, dict[str, Tensor]]:
    """The data set's meta.json and held-out split, after checking that the data set exists and was made by
    ``target``: its sizes, and the hidden states of the first held-out positions recomputed by the target
    (their relative error at most ``tolerance``)."""
    meta = read_data_meta(directory)
    sizes = (meta.get("hidden_size"), meta.get("vocab_size"))
    if sizes != (target.config.hidden_size, target.vocab_size):
        raise UsageError(
            f"the data set in {directory} was made by target {meta.get('target')!r} (hidden size {sizes[0]}, "
            f"vocabulary {sizes[1]}), not by {label!r} ({target.config.hidden_size}, {target.vocab_size})"
        )
    held = load_split(directory, "heldout")
    n = min(_FEATURE_CHECK_TOKENS, int(held["offsets"][1]))
    tokens = held["tokens"][:n].long()[None]  # [1, n]
    with torch.no_grad():
        ours = target.forward_hidden(tokens, torch.arange(n)[None], target.new_cache(1, n))[0].float()
    error = float((ours - held["hidden"][:n].float()).norm() / ours.norm())
    if error > tolerance:
        raise UsageError(
            f"the data set in {directory} was made by target {meta.get('target')!r}: its hidden states "
            f"differ from those of {label!r} (relative error {error:.3f}); it was answered in precision "
            f"{answered_precision(meta)}: train in that precision (--precision), or make the data set again"
        )
    return meta, held


def _write_atomic(path: Path, obj: object) -> None:
    """Save ``obj`` to ``path`` with torch.save, atomically (a temporary file renamed over it)."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


@dataclass
class _Run:
    """A training run: where its files go, what they record about its origin, the head with its optimizer and
    random stream, and how far it has come."""

    config: TrainConfig
    out_dir: Path
    fingerprint: str  # target_fingerprint of the target
    draft_vocab: Tensor  # [Vd] int64
    coverage: float  # share of the training answers' tokens that are in the draft vocabulary
    data: dict[str, object]  # the data set's meta.json entries recorded in the drafter file
    recipe: Recipe
    head: LearnedHead
    optimizer: torch.optim.Optimizer
    generator: torch.Generator  # every random draw of the run, in order (initialisation, batches, noise)
    step: int = 0  # steps done
    seconds: float = 0.0  # time spent in the steps
    accuracy: list[float] = dataclasses.field(default_factory=lambda: [0.0] * EVAL_POSITIONS)  # last eval
    measures: dict = dataclasses.field(default_factory=dict)  # the kind's further measures, last eval

    @property
    def settings(self) -> dict[str, object]:
        """The training settings as the checkpoint and the drafter file record them."""
        return dataclasses.asdict(self.config)


def _checkpoint_path(out_dir: Path, resume: bool) -> Path:
    """The checkpoint file of the run in ``out_dir``, after checking that it exists when resuming and does
    not otherwise (UsageError)."""
    path = out_dir / CHECKPOINT
    if resume and not path.is_file():
        raise UsageError(f"nothing to resume: {out_dir} holds no {CHECKPOINT}")
    if not resume and path.exists():
        raise UsageError(f"{out_dir} already holds a training run: pass --resume, or choose another --out")
    return path


def _choose_draft_vocab(
    config: TrainConfig, target: Llama, target_label: str, answers: Tensor
) -> tuple[Tensor, LearnedHead | None]:
    """(draft vocabulary [Vd] int64, drafter to start from or None): that of ``config.init`` when given
    (its size must be ``config.draft_vocab``), else the most frequent of the ``answers`` [M] tokens."""
    start = load_head(config.init, target, target_label, kind="eagle") if config.init else None
    if start is None:
        return _draft_vocabulary(answers, config.draft_vocab, target.vocab_size), None
    if start.draft_vocab_size != config.draft_vocab:
        raise UsageError(
            f"the drafter {config.init} to start from has a draft vocabulary of "
            f"{start.draft_vocab_size} tokens, not draft_vocab = {config.draft_vocab}"
        )
    return start.draft_vocab, start


def _new_head(
    target: Llama, config: TrainConfig, draft_vocab: Tensor, recipe: Recipe, metadata: dict[str, str]
) -> tuple[LearnedHead, torch.optim.Optimizer, torch.Generator]:
    """A trainable head of the recipe's kind on ``draft_vocab`` [Vd], its AdamW optimizer and the run's random
    stream, which the initialisation has drawn from."""
    generator = torch.Generator().manual_seed(config.seed)
    head = recipe.new_head(target, config, draft_vocab, metadata, generator)
    for param in head.parameters():
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )
    return head, optimizer, generator


def _resume(run: _Run, checkpoint_path: Path) -> None:
    """Restore ``run`` from its checkpoint (UsageError when that was written with other settings, for another
    target or another draft vocabulary) and drop the logged evaluations made after it: they are made again."""
    state = torch.load(checkpoint_path, weights_only=True)
    settings = run.settings
    saved = {**dataclasses.asdict(TrainConfig()), **state["settings"]}  # newer settings: their defaults
    changed = [k for k in settings if saved[k] != settings[k]]
    if changed:
        differences = ", ".join(f"{k} {saved[k]!r} there, {settings[k]!r} now" for k in changed)
        raise UsageError(f"cannot resume the run in {run.out_dir}: its settings differ ({differences})")
    if state["target_fingerprint"] != run.fingerprint:
        raise UsageError(f"cannot resume the run in {run.out_dir}: it was made for another target")
    if not torch.equal(state["draft_vocab"], run.draft_vocab):
        raise UsageError(f"cannot resume the run in {run.out_dir}: the data set has changed")
    run.head.load_state_dict(state["head"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.generator.set_state(state["rng"])
    run.step, run.seconds, run.accuracy = state["step"], state["seconds"], state["accuracy"]
    run.measures = state.get("measures", {})
    log = run.out_dir / LOG
    if log.is_file():
        kept = [line for line in log.read_text().splitlines() if json.loads(line)["step"] <= run.step]
        log.write_text("".join(f"{line}\n" for line in kept))


def _save(run: _Run) -> None:
    """Write the drafter file (its training record in the metadata) and the checkpoint of ``run``."""
    run.head.metadata["training"] = {
        **run.settings,
        "steps_done": run.step,
        "seconds": round(run.seconds, 1),
        "heldout_top1_per_position": [round(a, 4) for a in run.accuracy],
        **run.measures,
        "draft_vocab_coverage": round(run.coverage, 4),
        "data": run.data,
    }
    run.head.save(run.out_dir / DRAFTER)
    _write_atomic(
        run.out_dir / CHECKPOINT,
        {
            "target_fingerprint": run.fingerprint,
            "settings": run.settings,
            "draft_vocab": run.draft_vocab,
            "head": run.head.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "rng": run.generator.get_state(),
            "step": run.step,
            "seconds": run.seconds,
            "accuracy": run.accuracy,
            "measures": run.measures,
        },
    )


def _train_step(run: _Run, train: TrainingData, noise: float) -> float:
    """One optimizer step of ``run`` on a random batch of ``train``; returns its loss."""
    config = run.config
    began = time.perf_counter()
    for group in run.optimizer.param_groups:
        group["lr"] = config.lr_at(run.step)
    loss = run.recipe.loss(run.head, train, config, noise, run.generator)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.head.parameters(), config.grad_clip)
    run.optimizer.step()
    run.step += 1
    run.seconds += time.perf_counter() - began
    return loss.item()


def _log_evaluation(run: _Run, loss: float | None, train: TrainingData, heldout: TrainingData) -> None:
    """Evaluate ``run``'s head on both splits, keep the held-out accuracy and append a line to the log
    (``loss``: the last step's, None before the first)."""
    config = run.config
    run.accuracy, run.measures = run.recipe.evaluate(run.head, heldout, config)
    record = {
        "step": run.step,
        "loss": loss,
        "seconds": round(run.seconds, 1),
        "heldout_top1": run.accuracy,
        **{f"heldout_{k.removeprefix('heldout_')}": v for k, v in run.measures.items()},
        "train_top1": run.recipe.evaluate(run.head, train, config)[0],
    }
    with (run.out_dir / LOG).open("a") as log:
        log.write(json.dumps(record) + "\n")


def _train_loop(run: _Run, train: TrainingData, heldout: TrainingData, noise: float, progress: bool) -> None:
    """Step ``run`` to ``config.steps``, evaluating and checkpointing at their intervals and at the end."""
    config = run.config
    bar = tqdm(
        total=config.steps, initial=run.step, desc=f"training {config.kind} drafter", disable=not progress
    )
    if progress:
        bar.write(
            f"draft vocabulary: {run.draft_vocab.shape[0]} tokens, "
            f"covering {run.coverage:.1%} of the answers",
            file=sys.stderr,
        )
    if run.step == 0 and config.init:  # where fine-tuning starts: the drafter's own accuracy on this data
        _log_evaluation(run, None, train, heldout)
    while run.step < config.steps:
        loss = _train_step(run, train, noise)
        if run.step % config.eval_every == 0 or run.step == config.steps:
            _log_evaluation(run, loss, train, heldout)
        bar.set_postfix(loss=f"{loss:.3f}", top1="/".join(f"{a:.2f}" for a in run.accuracy))
        bar.update(1)
        if run.step % config.checkpoint_every == 0 or run.step == config.steps:
            _save(run)
    bar.close()


def train_drafter(
    target: LanguageModel,
    data_dir: str | Path,
    out_dir: str | Path,
    config: TrainConfig = TrainConfig(),
    *,
    target_label: str = "",
    resume: bool = False,
    progress: bool = True,
) -> Path:
    """Train a drafter for ``target`` on the data set in ``data_dir``; returns the drafter file written into
    ``out_dir`` (with ``checkpoint.pt`` and ``log.jsonl``). ``resume`` continues from the checkpoint in
    ``out_dir``, which must have been written with the same settings for the same target. UsageError for an
    unsupported target, a missing or foreign data set, or a checkpoint that cannot be resumed."""
    target = native_target(target)
    label = target_label or "the target"
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    tolerance = _OTHER_PRECISION_TOLERANCE if config.kind in THROUGH_TARGET else _FEATURE_CHECK_TOLERANCE
    meta, heldout_split = _check_data(data_dir, target, label, tolerance)
    checkpoint_path = _checkpoint_path(out_dir, resume)
    fingerprint = target_fingerprint(target)
    train_split = load_split(data_dir, "train")
    answers = _answer_tokens(train_split)  # [M]
    draft_vocab, start = _choose_draft_vocab(config, target, target_label, answers)  # [Vd]
    index = draft_index(draft_vocab, target.vocab_size)  # [V]
    recipe = _recipe(config, target, start)
    train = recipe.prepare(target, TrainingData.from_split(train_split, index))
    heldout = recipe.prepare(target, TrainingData.from_split(heldout_split, index))
    noise = config.noise * float(train.hidden[:65536].float().pow(2).mean().sqrt())
    metadata = {"kind": config.kind, "target": target_label, "target_fingerprint": fingerprint}
    head, optimizer, generator = _new_head(target, config, draft_vocab, recipe, metadata)
    run = _Run(
        config=config,
        out_dir=out_dir,
        fingerprint=fingerprint,
        draft_vocab=draft_vocab,
        coverage=float(index[answers].ne(_IGNORE).float().mean()),
        data={k: meta.get(k) for k in ("target", "num_sequences", "num_tokens", "generation")},
        recipe=recipe,
        head=head,
        optimizer=optimizer,
        generator=generator,
    )
    if resume:
        _resume(run, checkpoint_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    _train_loop(run, train, heldout, noise, progress)
    return out_dir / DRAFTER

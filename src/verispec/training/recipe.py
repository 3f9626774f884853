"""What every kind's training recipe shares (:mod:`verispec.training.train` runs them): a data set's split as
:class:`TrainingData` (each token's index in the draft vocabulary, the answer positions), the :class:`Recipe`
protocol a kind implements (its fresh head, its batch loss, its evaluation), and the cross-entropy against the
target's own distribution (:func:`distilled_ce`). A kind's recipe is named by its entry in the drafter
registry (:class:`~verispec.drafting.registry.Trained`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from verispec.drafting.learned.head import LearnedHead
from verispec.models.llama import Llama
from verispec.training.config import TrainConfig

__all__ = ["DRAFTER", "EVAL_POSITIONS", "IGNORE", "Recipe", "TrainingData", "distilled_ce", "draft_index"]

DRAFTER = "drafter.safetensors"  # a verispec drafter file, in the run's directory
EVAL_POSITIONS = 4  # draft positions whose held-out accuracy is reported
IGNORE = -100  # cross-entropy target of a slot that does not count


@dataclass(frozen=True)
class TrainingData:
    """One split of a data set, with each token's index in the draft vocabulary."""

    tokens: Tensor  # [N] int64, every sequence concatenated
    hidden: Tensor  # [N, H] float16: the target's final hidden state at each position ([N, 0]: not read)
    starts: Tensor  # [S] int64: first position of each sequence
    lengths: Tensor  # [S] int64
    prompt_lengths: Tensor  # [S] int64
    draft_index: Tensor  # [V] int64: position of each target token in the draft vocabulary, or -100
    ends: Tensor  # [N] int64: the end (exclusive) of each position's sequence
    answers: Tensor  # [M] int64: the positions t whose next token x_{t+1} is one the target wrote
    reads: Tensor | None = None  # [N, H] float16: what the drafter reads, when not ``hidden`` (an exit's)

    @classmethod
    def from_split(cls, split: dict[str, Tensor], draft_index: Tensor) -> TrainingData:
        """From a split as :func:`verispec.training.data.load_split` returns it."""
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
            inside, self.draft_index[self.tokens[later.clamp(max=self.tokens.shape[0] - 1)]], IGNORE
        )

    def later(self, positions: Tensor, count: int) -> tuple[Tensor, Tensor]:
        """The positions t + j, j = 1..count, after each of ``positions`` [M] (whose states predict what a
        Medusa head or a lookahead token guesses at t), clamped into the data set, and whether each lies
        inside t's sequence: [M, count] int64 and [M, count] bool."""
        later = positions[:, None] + torch.arange(1, count + 1)  # [M, count]
        return later.clamp(max=self.tokens.shape[0] - 1), later < self.ends[positions][:, None]

    def sample_positions(self, count: int, generator: torch.Generator) -> Tensor:
        """``count`` answer positions drawn uniformly with replacement: [count] int64."""
        return self.answers[torch.randint(self.answers.shape[0], (count,), generator=generator)]

    def eval_positions(self, count: int) -> Tensor:
        """The first ``count`` answer positions of a fixed shuffled order: [min(count, M)] int64."""
        order = torch.randperm(self.answers.shape[0], generator=torch.Generator().manual_seed(0))
        return self.answers[order[:count]]


def draft_index(draft_vocab: Tensor, vocab_size: int) -> Tensor:
    """For each target token, its position in ``draft_vocab`` [Vd], or -100 (not drafted): [V] int64."""
    index = torch.full((vocab_size,), IGNORE, dtype=torch.long)  # [V]
    index[draft_vocab] = torch.arange(draft_vocab.shape[0])
    return index


class Recipe(Protocol):
    """What a kind of learned drafter brings to the training loop."""

    # whether it reads the data set's stored hidden states (else it computes what it reads from the tokens:
    # a data set of token ids alone, verispec.training.text's, will do)
    reads_stored_hidden: bool = True
    drafter_name: str = DRAFTER  # the drafter file it writes into the run's directory

    @classmethod
    def of(cls, target: Llama, config: TrainConfig, start: LearnedHead | None) -> Recipe:
        """The recipe of a run of ``config`` on ``target`` (``start``: the drafter it fine-tunes, ``init``,
        or None); UsageError for settings the target cannot take."""
        ...

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


def distilled_ce(logits: Tensor, target_logits: Tensor, valid: Tensor) -> Tensor:
    """Cross-entropy of draft ``logits`` [..., Vd] against the target's distribution on the draft vocabulary
    (``target_logits`` [..., Vd]) where ``valid`` [...] bool, averaged (0 when none is)."""
    probs = target_logits.softmax(-1)  # [..., Vd]
    return -(probs * logits.log_softmax(-1)).sum(-1)[valid].mean().nan_to_num(0.0)

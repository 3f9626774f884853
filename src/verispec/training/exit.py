"""Training an exit (:class:`~verispec.drafting.learned.exit.ExitAdapter`): :class:`ExitRecipe`. The target's
first ``exit_layer`` layers computed once over both splits, then at random answer positions the adapter's
cross-entropy against the target's next token or distribution; evaluated as held-out top-1 against the
target's greedy token, beside the untrained exit's."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.drafting.learned.exit import ExitAdapter, check_exit_layer, exit_features
from verispec.drafting.learned.head import LearnedHead
from verispec.models.llama import Llama
from verispec.training.config import TrainConfig
from verispec.training.recipe import IGNORE, Recipe, TrainingData, distilled_ce

__all__ = ["ExitRecipe"]


class ExitRecipe(Recipe):
    """A trained exit: the target's first layers computed once, then random answer positions."""

    def __init__(self, exit_layer: int) -> None:
        self.exit_layer = exit_layer

    @classmethod
    def of(cls, target: Llama, config: TrainConfig, start: LearnedHead | None) -> ExitRecipe:
        return cls(check_exit_layer(target, config.exit_layer))

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
        positions = data.sample_positions(config.batch_tokens, generator)  # [M]
        logits = head.logits(head(self._reads(data, positions)))  # [M, Vd]
        if config.ce_target == "distribution":
            with torch.no_grad():
                target_logits = head.logits(data.hidden[positions].float())  # [M, Vd]
            return distilled_ce(logits, target_logits, torch.ones_like(positions, dtype=torch.bool))
        return F.cross_entropy(logits, data.following(positions, 1), ignore_index=IGNORE).nan_to_num(0.0)

    def evaluate(
        self, head: ExitAdapter, data: TrainingData, config: TrainConfig
    ) -> tuple[list[float], dict]:
        """Top-1 agreement with the target's greedy token, and the untrained exit's (the adapter left out)."""
        positions = data.eval_positions(config.eval_tokens)  # [M]
        with torch.no_grad():
            reads = self._reads(data, positions)  # [M, H]
            greedy = head.logits(data.hidden[positions].float()).argmax(-1)  # [M]
            trained = (head.logits(head(reads)).argmax(-1) == greedy).float().mean()
            untrained = (head.logits(reads).argmax(-1) == greedy).float().mean()
        return [float(trained.nan_to_num(0.0))], {
            "heldout_untrained_top1": round(float(untrained.nan_to_num(0.0)), 4)
        }

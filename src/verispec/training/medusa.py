"""Training Medusa heads (:class:`~verispec.drafting.learned.medusa.MedusaHeads`): :class:`MedusaRecipe`.
``batch_tokens`` random answer positions t; head i's cross-entropy against the token the target wrote at
t + 1 + i (``ce_target`` token), or against the target's own distribution there (distribution:
self-distillation, Medusa-2's); evaluated as each head's held-out accuracy at ranks 0..3 (the tree's shape is
chosen from them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.drafting.learned.head import LearnedHead
from verispec.drafting.learned.medusa import TOP_RANKS, MedusaHeads
from verispec.models.llama import Llama
from verispec.training.config import TrainConfig
from verispec.training.recipe import IGNORE, Recipe, TrainingData, distilled_ce

__all__ = ["MedusaRecipe"]


class MedusaRecipe(Recipe):
    """Medusa heads: random answer positions, each head against the token (or distribution) it must guess."""

    @classmethod
    def of(cls, target: Llama, config: TrainConfig, start: LearnedHead | None) -> MedusaRecipe:
        return cls()

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
        positions = data.sample_positions(config.batch_tokens, generator)  # [M]
        logits = head.logits(head(data.hidden[positions]))  # [M, K, Vd]
        if config.ce_target == "distribution":
            later, valid = data.later(positions, head.num_heads)  # [M, K] each
            with torch.no_grad():
                target_logits = head.logits(data.hidden[later].float())  # [M, K, Vd]
            return distilled_ce(logits, target_logits, valid)
        targets = torch.stack([data.following(positions, 1 + i) for i in range(1, head.num_heads + 1)], 1)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE).nan_to_num(0.0)

    def evaluate(
        self, head: MedusaHeads, data: TrainingData, config: TrainConfig
    ) -> tuple[list[float], dict]:
        """Per head, how often the target's greedy token is the head's rank-r token, r = 0..TOP_RANKS-1."""
        positions = data.eval_positions(config.eval_tokens)  # [M]
        with torch.no_grad():
            logits = head.logits(head(data.hidden[positions]))  # [M, K, Vd]
            later, valid = data.later(positions, head.num_heads)  # [M, K] each
            greedy = head.logits(data.hidden[later].float()).argmax(-1, keepdim=True)  # [M, K, 1]
            rank = (logits > logits.gather(-1, greedy)).sum(-1)  # [M, K]
        table = [
            [float((rank[:, i][valid[:, i]] == r).float().mean().nan_to_num(0.0)) for r in range(TOP_RANKS)]
            for i in range(head.num_heads)
        ]
        return [row[0] for row in table], {
            "heldout_rank_accuracy": [[round(a, 4) for a in row] for row in table]
        }

"""Training lookahead tokens (:class:`~verispec.drafting.learned.lookahead.LookaheadTokens`):
:class:`LookaheadRecipe`. ``batch_tokens // window`` sequences (drawn by length), each run through the frozen
target into a cache without gradient, then ``window`` random answer positions t of it each followed by the m
lookahead tokens (every group seeing the sequence up to t and its own earlier tokens, as drafting after x_t
does), the gradient flowing through every layer of the target back to the embeddings alone; lookahead j's
cross-entropy against the token the target wrote at t + 1 + j (or its distribution there); evaluated as
held-out top-1 against the target's greedy token there, per lookahead token."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.drafting.learned.head import LearnedHead
from verispec.drafting.learned.lookahead import LookaheadTokens, lookahead_mask
from verispec.errors import UsageError
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Llama, run_layers
from verispec.training.config import TrainConfig
from verispec.training.recipe import IGNORE, Recipe, TrainingData, distilled_ce

__all__ = ["LookaheadRecipe"]


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

    @classmethod
    def of(cls, target: Llama, config: TrainConfig, start: LearnedHead | None) -> LookaheadRecipe:
        return cls(target, config.lookahead)

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
            run_layers(layers, target.embed(tokens), positions, cache, target.inv_freq)
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
            later, valid = data.later(anchors, head.num_tokens)  # [A, m] each
            if config.ce_target == "distribution":
                with torch.no_grad():
                    target_logits = head.logits(data.hidden[later].float())  # [A, m, Vd]
                total = total + distilled_ce(logits, target_logits, valid)
            else:
                ahead = torch.stack(
                    [data.following(anchors, 1 + j) for j in range(1, head.num_tokens + 1)], 1
                )
                ce = F.cross_entropy(logits.flatten(0, 1), ahead.flatten(), ignore_index=IGNORE)
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
                later, valid = data.later(anchors, head.num_tokens)  # [A, m] each
                greedy = head.logits(data.hidden[later].float()).argmax(-1)  # [A, m]
                totals[:, 0] += ((guess == greedy) & valid).sum(0)
                totals[:, 1] += valid.sum(0)
                if totals[0, 1] >= config.eval_tokens:
                    break
        return (totals[:, 0] / totals[:, 1].clamp(min=1)).tolist(), {}

"""A trained early exit (LayerSkip-style self-speculation with a frozen target): the target's own first N
layers, then a small trained adapter in front of the target's head restricted to a draft vocabulary.

The untrained early exit (``--draft layers:N``) puts the target's final norm and head straight after layer N,
which was never trained to predict the next token (accepted 0–10 % of the time). The target stays frozen here,
so that the output stays exactly the target's; what is trained is the exit::

    x = norm(h_N)  (the target's final norm on the layer-N residual stream)
    x + W_down SiLU(W_up x + b_up) + b_down → target head rows → logits over the draft vocabulary

W_down starts at zero, so an untrained adapter is the plain early exit on the draft vocabulary. The draft
(:class:`ExitDraft`) is a language model: it drafts autoregressively through
:class:`~verispec.drafting.draft_model.ModelDrafter`, reading and writing the target's own cache for layers
< N as the plain early exit does (those layers of the cache hold exactly what the draft computes).

Its q: the adapter's logits, −inf outside the draft vocabulary, through the engine's sampling transform: the
distribution each draft token is sampled from, conditioned on the draft tokens before it (the draft is
autoregressive), which is what rejection sampling needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.drafting.learned.head import LearnedHead, native_target, shape_count
from verispec.inputs import check_int
from verispec.models.base import Cache, LanguageModel
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Llama, _Linear

__all__ = ["ExitAdapter", "ExitDraft", "check_exit_layer", "exit_features"]


def check_exit_layer(target: Llama, exit_layer: object) -> int:
    """``exit_layer`` when the target has a layer after it; UsageError otherwise."""
    layers = target.config.num_layers
    return check_int(exit_layer, "the exit layer", 1, layers - 1)


class ExitAdapter(LearnedHead):
    """The trained exit at layer ``exit_layer`` of a target (module docstring). Trainable: ``up``,
    ``down``."""

    kind = "exit"

    def __init__(
        self, target: LanguageModel, draft_vocab: Tensor, metadata: dict[str, Any], exit_layer: int = 8
    ) -> None:
        super().__init__(target, draft_vocab, metadata)
        self.exit_layer = check_exit_layer(native_target(target), exit_layer)
        h = self.hidden_size
        self.up = _Linear(h, 2 * h, True, self.device, torch.float32)
        self.down = _Linear(2 * h, h, True, self.device, torch.float32)

    def fresh_start(self, target: Llama) -> None:
        """A zero output projection: the plain early exit on the draft vocabulary."""
        self.down.weight.zero_()

    def forward(self, features: Tensor) -> Tensor:
        """features: [..., H], the target's final norm of the layer-N residual → adapted features [..., H]."""
        x = features.float()
        return x + self.down(F.silu(self.up(x)))

    def shape_metadata(self) -> dict[str, str]:
        return {"exit_layer": str(self.exit_layer)}

    @classmethod
    def from_shape(
        cls, target: Llama, draft_vocab: Tensor, info: dict[str, Any], shape: dict[str, str], path: Path
    ) -> ExitAdapter:
        layers = target.config.num_layers
        return cls(target, draft_vocab, info, shape_count(shape, "exit_layer", 1, layers - 1, "", path))


class ExitDraft(nn.Module):
    """The target's first N layers and a trained exit: a language model (and a tree language model) for
    :class:`~verispec.drafting.draft_model.ModelDrafter`, whose logits are −inf outside the draft vocabulary.
    Shares the target's weights; ``config`` is the target's with N layers (the cache layers it reads)."""

    def __init__(self, target: Llama, adapter: ExitAdapter) -> None:
        super().__init__()
        self.first = target.first_layers(adapter.exit_layer)
        self.adapter = adapter
        self.config = self.first.config
        self.vocab_size = target.vocab_size
        self.max_context = target.max_context

    @property
    def device(self) -> torch.device:
        return self.first.device

    @property
    def dtype(self) -> torch.dtype:
        return self.first.dtype

    @property
    def cpu_precision(self) -> str | None:
        """The CPU fast path's weight format of the target's layers it runs (what its cost depends on)."""
        return self.first.cpu_precision

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> KVCache:
        return self.first.new_cache(batch_size, capacity)

    def forward(
        self, tokens: Tensor, positions: Tensor, cache: Cache, tree_mask: Tensor | None = None
    ) -> Tensor:
        """tokens, positions: [B, T] int64 → logits [B, T, V] float32, −inf outside the draft vocabulary;
        appends T slots to ``cache`` (the first N layers), as the target's own forward."""
        hidden = self.first.forward_hidden(tokens, positions, cache, tree_mask)  # [B, T, H]
        draft = self.adapter.logits(self.adapter(hidden))  # [B, T, Vd]
        logits = draft.new_full((*draft.shape[:-1], self.vocab_size), float("-inf"))  # [B, T, V]
        return logits.index_copy_(-1, self.adapter.draft_vocab, draft)

    def prefill(self, tokens: Tensor, positions: Tensor, cache: Cache) -> None:
        self.first.forward_hidden(tokens, positions, cache)


def exit_features(
    target: Llama, exit_layer: int, tokens: Tensor, offsets: Tensor, chunk: int = 512
) -> Tensor:
    """What the exit reads at every position of a data set's sequences: the target's final norm of its
    layer-``exit_layer`` residual stream. tokens: [N] int64, every sequence concatenated; offsets: [S+1]
    int64. Returns [N, H] float16, computed one sequence at a time on the target's plain path."""
    first = target.first_layers(exit_layer)
    out = torch.empty(tokens.shape[0], target.config.hidden_size, dtype=torch.float16)  # [N, H]
    bounds = offsets.tolist()
    with torch.no_grad():
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            n = end - start
            cache = first.new_cache(1, n)
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                ids = tokens[start + lo : start + hi].to(first.device)[None]  # [1, T]
                positions = torch.arange(lo, hi, device=first.device)[None]  # [1, T]
                out[start + lo : start + hi] = first.forward_hidden(ids, positions, cache)[0].half().cpu()
    return out

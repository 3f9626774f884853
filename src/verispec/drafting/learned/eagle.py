"""The EAGLE-style draft head: one transformer layer that predicts the target's next hidden state.

At slot t the head reads the pair (embed(x_{t+1}), f_t) — the embedding of token t+1 and the target's final
hidden state f_t at position t (after its last norm: the state whose logits predict x_{t+1}) — and predicts
f̂_{t+1}, from which the target's own output head, restricted to a *draft vocabulary* (the most frequent
target tokens of the training data), gives the logits of x_{t+2}::

    (embed(x_{t+1}), f_t) → fc (2H → H) → Llama decoder layer(s) → RMSNorm → f̂_{t+1} → target head rows

Drafting feeds the target's true features of the committed tokens, then runs on its own predictions
(Li et al. 2024, EAGLE). The embeddings and the head rows come from the target, frozen and never stored: a
drafter file holds only fc, the layer and the norm (float16), the draft vocabulary and metadata, and loads
only beside the target whose :func:`target_fingerprint` it records.

Beside a target on verispec's native kernels (:meth:`LearnedHead.optimize_for_cpu` with ``native``), fc, the
layers and the head rows run on those kernels in :data:`~verispec.drafting.learned.head.DRAFT_FORMAT`: the
layers as one native stack over a cache in the kernels' float16 tiled layout, RoPE from the target's config.
That head is another drafter than the float32 one it was packed from (its weights rounded), and every draft
distribution is computed from its own logits, so verification stays exact.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.drafting.learned.head import DRAFT_FORMAT, LearnedHead, native_target, shape_count
from verispec.errors import UsageError
from verispec.inputs import is_int
from verispec.kernels.cpu import NativeStack
from verispec.models.base import Cache, LanguageModel
from verispec.models.llama import (
    KVCache,
    Llama,
    _DecoderLayer,
    _Linear,
    _RMSNorm,
    native_stack,
    rope_tables,
    rows_of_one_cache,
    run_layers,
    run_native,
    run_native_rows,
)

__all__ = ["MAX_LAYERS", "EagleHead"]

MAX_LAYERS = 8  # the most decoder layers a head may have


class EagleHead(LearnedHead):
    """The draft head of a target (see the module docstring). Trainable: ``fc``, ``layers``, ``norm``.

    Build a fresh one with :meth:`create` or read a file with :meth:`load`; ``config`` is the target's with
    ``num_layers`` layers (one, as in EAGLE, unless asked). ``draft_vocab`` [Vd] int64 holds the target token
    id of each draft logit, ascending.
    """

    kind = "eagle"

    def __init__(
        self, target: LanguageModel, draft_vocab: Tensor, metadata: dict[str, Any], num_layers: int = 1
    ) -> None:
        super().__init__(target, draft_vocab, metadata)
        target = native_target(target)
        if not is_int(num_layers) or not 1 <= num_layers <= MAX_LAYERS:
            raise UsageError(f"a draft head has 1 to {MAX_LAYERS} decoder layers, got {num_layers!r}")
        self.config = dataclasses.replace(target.config, num_layers=num_layers)
        h, device = self.config.hidden_size, target.device
        self.fc = _Linear(2 * h, h, True, device, torch.float32)
        self.layers = nn.ModuleList(
            [_DecoderLayer(self.config, device, torch.float32) for _ in range(num_layers)]
        )
        self.norm = _RMSNorm(h, self.config.rms_norm_eps, device, torch.float32)
        # frozen, borrowed from the target: token embeddings (shared, not copied)
        self.embed_weight = nn.Buffer(target.model.embed_tokens.weight.detach(), persistent=False)  # [V, H]
        self.inv_freq = nn.Buffer(self.config.rope_inv_freq().to(device), persistent=False)  # [head_dim // 2]
        self._stack: NativeStack | None = None  # the layers on the native kernels (pack_native)
        # (the target's whole cache, the rows of the head's own cache for its rows): see cache_row
        self._rows: tuple[weakref.ref[Tensor], list[KVCache]] | None = None

    def fresh_start(self, target: Llama) -> None:
        """The output norm starts as the target's final norm (its output then has the target's scale)."""
        self.norm.weight.copy_(target.model.norm.weight)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def adopt(self, other: EagleHead) -> None:
        """Take the weights of ``other``, a head of the same target and draft vocabulary with at most this
        head's layers: its fc, layers and norm; this head's further layers get zero output projections
        (attention ``o_proj``, MLP ``down_proj``), so that they add nothing to the residual stream until
        trained and the two heads compute the same features."""
        if other.num_layers > self.num_layers or not torch.equal(other.draft_vocab, self.draft_vocab):
            raise UsageError(
                f"cannot start a {self.num_layers}-layer head from a {other.num_layers}-layer one"
                if other.num_layers > self.num_layers
                else "cannot start a head from one with another draft vocabulary"
            )
        with torch.no_grad():
            own = self.state_dict()
            for name, tensor in other.state_dict().items():
                own[name].copy_(tensor)
            for layer in self.layers[other.num_layers :]:
                assert isinstance(layer, _DecoderLayer)  # what __init__ fills the ModuleList with
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()

    def new_cache(
        self, batch_size: int = 1, capacity: int | None = None, separate_layers: bool = False
    ) -> KVCache:
        """An empty cache of the head's layers (default capacity: the target's context; ``separate_layers``
        for training, see :class:`~verispec.models.llama.KVCache`)."""
        c, native = self.config, self._stack is not None
        capacity = c.max_context if capacity is None else capacity
        return KVCache(
            self.num_layers,
            batch_size,
            c.num_kv_heads,
            capacity,
            c.head_dim,
            dtype=torch.float16 if native else torch.float32,  # native: the kernels' layout
            device=self.inv_freq.device,
            separate_layers=separate_layers,
            tiled=native,
        )

    def cache_row(self, slot: Cache | None) -> KVCache:
        """The head's cache for a sequence whose target cache is ``slot``: where that is row r of a whole
        cache of R rows (an engine's slots) and the head runs on the native kernels, row r of an R-row cache
        of the head's own (made once per whole target cache: every sequence drafting in that engine then
        has a row of it, and their drafts run in one forward, :meth:`forward_rows`); else a cache of its
        own."""
        if not self.rows_alone or not isinstance(slot, KVCache) or slot.row is None or slot.whole is None:
            return self.new_cache()
        whole = slot.whole[0]  # [layers, R, ...]: the target's keys
        if self._rows is None or self._rows[0]() is not whole:
            self._rows = (weakref.ref(whole), self.new_cache(batch_size=whole.shape[1]).rows())
        return self._rows[1][slot.row]

    def forward_rows(self, rows: Sequence[tuple[Tensor, Tensor, Tensor, KVCache]]) -> list[Tensor]:
        """:meth:`forward` of several sequences at once, each (tokens [T_i] int64, features [T_i, H],
        positions [T_i] int64, its cache) causally → f̂ [T_i, H] each: one native forward where the caches
        are rows of one of :meth:`cache_row`'s (each its own), else one forward each. A row's output is
        bit-identical to its forward alone (the kernels compute every row on its own)."""
        caches = [cache for *_, cache in rows]
        if len(rows) == 1 or self._stack is None or not rows_of_one_cache(caches):
            return [self(t[None], f[None], p[None], cache)[0] for t, f, p, cache in rows]
        tokens = torch.cat([t for t, *_ in rows])  # [N]
        features = torch.cat([f for _, f, *_ in rows])  # [N, H]
        embedded = F.embedding(tokens, self.embed_weight).float()  # [N, H]
        h = self.fc(torch.cat((embedded, features.float()), dim=-1)).contiguous()  # [N, H]
        rope = rope_tables(torch.cat([p for _, _, p, _ in rows]), self.inv_freq)
        norm = (self.norm.weight, self.config.rms_norm_eps)
        counts = [len(t) for t, *_ in rows]
        out = run_native_rows(self._stack, h, caches, counts, self.num_layers, rope, norm)  # [N, H]
        return list(out.split(counts))

    def pack_native(self) -> None:
        """fc on the native kernels, the layers as one native stack."""
        self.fc.pack_native(DRAFT_FORMAT)
        layers = [layer for layer in self.layers if isinstance(layer, _DecoderLayer)]  # all of them
        self._stack = native_stack(self.config, layers, DRAFT_FORMAT, measured=False)

    def forward(
        self, tokens: Tensor, features: Tensor, positions: Tensor, cache: KVCache, mask: Tensor | None = None
    ) -> Tensor:
        """tokens: [B, T] int64, x_{t+1} at each slot t; features: [B, T, H], f_t (true or predicted);
        positions: [B, T] int64, the slots t. Returns f̂_{t+1}: [B, T, H] float32; appends T slots to
        ``cache``. mask: [T, cache.length + T] bool (True = attend), None for causal attention."""
        embedded = F.embedding(tokens, self.embed_weight).float()  # [B, T, H]
        h = self.fc(torch.cat((embedded, features.float()), dim=-1))  # [B, T, H]
        if self._stack is not None:
            return self._native_layers(self._stack, h, positions, cache, mask)
        # run_layers takes the _DecoderLayers of the ModuleList, whose items torch types as plain Modules
        h = run_layers(self.layers, h, positions, cache, self.inv_freq, mask)  # type: ignore[arg-type]
        return self.norm(h)

    def _native_layers(
        self, stack: NativeStack, h: Tensor, positions: Tensor, cache: KVCache, mask: Tensor | None
    ) -> Tensor:
        """:meth:`forward` after fc on the native kernels: h [B, T, H] float32 through the layers (row b of
        the batch on row b of ``cache``, a tiled one from :meth:`new_cache`) and the norm → [B, T, H]."""
        b = h.shape[0]
        base = None  # the slots every token sees: the committed ones, or those the mask shows to all
        if mask is not None:
            base = min(cache.length, int(mask.all(0).cumprod(0).sum()))
            mask = mask[:, base:].repeat(b, 1).contiguous()  # [B·T, slots from base]
        rope = rope_tables(positions, self.inv_freq)
        norm = (self.norm.weight, self.config.rms_norm_eps)
        return run_native(stack, h, cache, self.num_layers, rope, norm, base=base, mask=mask)

    def shape_metadata(self) -> dict[str, str]:
        return {"num_layers": str(self.num_layers)}

    @classmethod
    def from_shape(
        cls, target: Llama, draft_vocab: Tensor, info: dict[str, Any], shape: dict[str, str], path: Path
    ) -> EagleHead:
        # files written before heads had a layer count: one
        return cls(target, draft_vocab, info, shape_count(shape, "num_layers", 1, MAX_LAYERS, "1", path))

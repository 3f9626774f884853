"""The EAGLE-style draft head: one transformer layer that predicts the target's next hidden state.

At slot t the head reads the pair (embed(x_{t+1}), f_t) — the embedding of token t+1 and the target's final
hidden state f_t at position t (after its last norm: the state whose logits predict x_{t+1}) — and predicts
f̂_{t+1}, from which the target's own output head, restricted to a *draft vocabulary* (the most frequent
target tokens of the training data), gives the logits of x_{t+2}::

    (embed(x_{t+1}), f_t) → fc (2H → H) → Llama decoder layer(s) → RMSNorm → f̂_{t+1} → target head rows

Drafting feeds the target's true features of the committed tokens, then runs on its own predictions
(Li et al. 2024, EAGLE). The embeddings and the head rows come from the target, frozen and never stored
(:class:`TokenRows`: the draft vocabulary's embedding rows kept, any other looked up where the target keeps
it, so a head with a reduced draft vocabulary never copies the whole table, 671 MB in float32 for Gemma 3's
262,144 tokens): a
drafter file holds only fc, the layer and the norm (float16), the draft vocabulary and metadata, and loads
only beside the target whose :func:`target_fingerprint` it records.

Beside a target on verispec's native kernels (:meth:`LearnedHead.optimize_for_cpu` with ``native``), fc, the
layers and the head rows run on those kernels in :data:`~verispec.drafting.learned.head.DRAFT_FORMAT`: the
layers as one native stack over a cache in the kernels' float16 tiled layout, RoPE from the target's config.
That head is another drafter than the float32 one it was packed from (its weights rounded), and every draft
distribution is computed from its own logits, so verification stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.drafting.learned.head import DRAFT_FORMAT, LearnedHead, native_target, shape_count
from verispec.errors import UsageError
from verispec.inputs import is_int
from verispec.kernels.cpu import DraftHead, NativeStack
from verispec.models.base import Cache, LanguageModel
from verispec.models.kv_cache import KVCache, RowsBeside, advance_rows, native_rows, rows_of_one_cache
from verispec.models.llama import (
    Llama,
    _DecoderLayer,
    _Linear,
    _RMSNorm,
    native_stack,
    rope_tables,
    run_layers,
    run_native,
)

__all__ = ["MAX_LAYERS", "EagleHead", "TokenRows"]

MAX_LAYERS = 8  # the most decoder layers a head may have


@dataclass(frozen=True)
class TokenRows:
    """A head's token embeddings, frozen: ``rows(ids)`` is ids [...] int64 → float32 [..., H]. The rows of
    the draft vocabulary (``kept`` [Vd, H], what a greedy draft's later steps read, and most tokens a head is
    fed) are kept in float32; any other is looked up where the target keeps it (a GGUF file's rows read in
    place, dequantized: tens of microseconds a call): the whole table is copied only where the draft
    vocabulary is the whole vocabulary (a published EAGLE-2 head's)."""

    lookup: Callable[[Tensor], Tensor]
    kept: Tensor  # [Vd, H] float32: the rows of the kept tokens
    index: Tensor  # [V] int64: each token's row in ``kept``, −1 where it has none

    @classmethod
    def of(cls, target: Llama, keep: Tensor, own: Tensor | None = None) -> TokenRows:
        """The target's embeddings, or the head's ``own`` table [V, H] where its file brings one, keeping the
        rows of the token ids ``keep`` [Vd]."""
        lookup: Callable[[Tensor], Tensor] = target.model.embed_tokens
        if own is not None:
            lookup = partial(F.embedding, weight=own.detach().to(target.device, torch.float32))
        index = torch.full((target.vocab_size,), -1, dtype=torch.long, device=keep.device)  # [V]
        index[keep] = torch.arange(keep.shape[0], device=keep.device)
        return cls(lookup, lookup(keep).float().contiguous(), index)

    def __call__(self, ids: Tensor) -> Tensor:
        at = self.index[ids]  # [...]: each id's kept row, −1 for none
        out = self.kept[at.clamp(min=0)]  # [..., H]
        missing = at < 0  # [...]
        if bool(missing.any()):
            out[missing] = self.lookup(ids[missing]).float()
        return out


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
        self.config = target.config.plain_layers(num_layers)
        h, device = self.config.hidden_size, target.device
        self.fc = _Linear(2 * h, h, True, device, torch.float32)
        self.layers = nn.ModuleList(
            [_DecoderLayer(self.config, device, torch.float32) for _ in range(num_layers)]
        )
        self.norm = _RMSNorm(h, self.config.rms_norm_eps, device, torch.float32)
        self.embed = TokenRows.of(target, self.draft_vocab)  # frozen, borrowed from the target
        self.inv_freq = nn.Buffer(self.config.rope_inv_freq().to(device), persistent=False)  # [head_dim // 2]
        self._stack: NativeStack | None = None  # the layers on the native kernels (pack_native)
        self._draft_head: DraftHead | None = None  # what the native drafting calls read (_native_head)
        self._rows = RowsBeside()  # the rows of the head's own cache beside an engine's: see cache_row

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
        for training, see :class:`~verispec.models.kv_cache.KVCache`)."""
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
        if not self.rows_alone or not RowsBeside.fits(slot):
            return self.new_cache()
        assert isinstance(slot, KVCache)  # fits
        return self._rows.row(slot, lambda rows: self.new_cache(batch_size=rows).rows())

    def forward_rows(self, rows: Sequence[tuple[Tensor, Tensor, Tensor, KVCache]]) -> list[Tensor]:
        """:meth:`forward` of several sequences at once, each (tokens [T_i] int64, features [T_i, H],
        positions [T_i] int64, its cache) causally → f̂ [T_i, H] each: on the native kernels one call
        (:meth:`_draft`) where the caches are rows of one of :meth:`cache_row`'s (each its own) or there is
        one sequence, else one forward each. A row's output is bit-identical to its forward alone (the kernels
        compute every row on its own)."""
        caches = [cache for *_, cache in rows]
        if self._native_head(caches) is None:
            return [self(t[None], f[None], p[None], cache)[0] for t, f, p, cache in rows]
        counts = [len(t) for t, *_ in rows]
        out, _ = self._draft(*_joined(rows), caches, counts, picks=None)
        return list(out.split(counts))

    def feed_rows(self, rows: Sequence[tuple[Tensor, Tensor, Tensor, KVCache]]) -> tuple[Tensor, Tensor]:
        """:meth:`forward_rows` → each row's last f̂ [R, H] and its draft logits [R, Vd] (on the native
        kernels in the same call)."""
        caches = [cache for *_, cache in rows]
        if self._native_head(caches) is None:
            last = torch.stack([f[-1] for f in self.forward_rows(rows)])  # [R, H]
            return last, self.logits(last)
        counts = [len(t) for t, *_ in rows]
        ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32) - 1  # [R]: last tokens
        out, logits = self._draft(*_joined(rows), caches, counts, picks=ends)
        assert logits is not None  # picked
        return out[ends.long()], logits

    def step_rows(
        self, tokens: Sequence[int], features: Tensor, positions: Sequence[int], caches: Sequence[KVCache]
    ) -> tuple[Tensor, Tensor]:
        """One draft step of N sequences: token i and feature i (features [N, H]) at position i, each on its
        cache → (f̂ [N, H], its draft logits [N, Vd]); on the native kernels in one call."""
        ids, at = torch.tensor(tokens), torch.tensor(positions)  # [N] each
        if self._native_head(caches) is None:
            rows = [(ids[i : i + 1], features[i : i + 1], at[i : i + 1], c) for i, c in enumerate(caches)]
            out = torch.cat(self.forward_rows(rows))  # [N, H]
            return out, self.logits(out)
        n = len(caches)
        out, logits = self._draft(ids, features, at, caches, [1] * n, torch.arange(n, dtype=torch.int32))
        assert logits is not None  # picked
        return out, logits

    def greedy_rows(
        self,
        tokens: Sequence[int],
        features: Tensor,
        positions: Sequence[int],
        caches: Sequence[KVCache],
        steps: Sequence[int],
    ) -> list[list[int]] | None:
        """Greedy drafting of N sequences in one native call: sequence i reads tokens[i] and features[i]
        ([N, H]) at positions[i], then steps[i] − 1 more (steps ≥ 1), each the argmax of the draft logits
        before it with the predicted feature: each sequence's steps[i] draft tokens, as :meth:`step_rows` and
        the argmax would draft them one by one. None where the head is not on the native kernels."""
        head = self._native_head(caches)
        if head is None:
            return None
        assert self._stack is not None  # _native_head
        for cache, count in zip(caches, steps, strict=True):
            cache._reserve(count)  # room for every step
        first = native_rows(caches, [1] * len(caches))  # each row's first slot, its cache row, the cache
        del first["base"]  # each step sees its row's slots before it
        most = max(steps)
        at = torch.tensor(positions)[:, None] + torch.arange(most)  # [N, S]: each row's steps' positions
        rope = {k: v.view(len(steps), most, -1) for k, v in rope_tables(at, self.inv_freq).items()}
        drafts = self._stack.draft_greedy(
            head,
            inputs=self.embed(torch.tensor(tokens)),  # [N, H]
            features=features.float(),
            steps=torch.tensor(steps, dtype=torch.int32),
            **first,
            **rope,
        )
        advance_rows(caches, steps)
        return [row[:count] for row, count in zip(drafts.tolist(), steps, strict=True)]

    def _native_head(self, caches: Sequence[KVCache]) -> DraftHead | None:
        """The head as the native drafting calls take it, where a forward over ``caches`` runs in one
        call (one cache, or rows of one of :meth:`cache_row`'s); else None."""
        if self._stack is None or self.fc.native is None or self._native_rows is None:
            return None
        if len(caches) > 1 and not rows_of_one_cache(caches):
            return None
        if self._draft_head is None:
            norm = self.norm.weight.detach()  # [H] float32
            rows = self.embed.kept  # [Vd, H]: the draft vocabulary's
            self._draft_head = DraftHead(self.fc.native, norm, self._native_rows, self.draft_vocab, rows)
        return self._draft_head

    def _draft(
        self,
        tokens: Tensor,
        features: Tensor,
        positions: Tensor,
        caches: Sequence[KVCache],
        counts: Sequence[int],
        picks: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """The head over N tokens (tokens [N] int64, features [N, H], positions [N]), the next ``counts[i]``
        on ``caches[i]``, in one native call: (f̂ [N, H], the draft logits [P, Vd] of the tokens ``picks``
        [P] int32, or None)."""
        head = self._native_head(caches)
        assert self._stack is not None and head is not None  # the callers' check
        out, logits = self._stack.draft(
            head,
            inputs=self.embed(tokens),  # [N, H]
            features=features.float(),
            picks=picks,
            **rope_tables(positions, self.inv_freq),
            **native_rows(caches, counts),
        )
        advance_rows(caches, counts)
        return out, logits

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
        embedded = self.embed(tokens)  # [B, T, H]
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


def _joined(rows: Sequence[tuple[Tensor, Tensor, Tensor, KVCache]]) -> tuple[Tensor, Tensor, Tensor]:
    """The rows' tokens [N], features [N, H] and positions [N], one after another."""
    return (
        torch.cat([t for t, *_ in rows]),
        torch.cat([f for _, f, *_ in rows]),
        torch.cat([p for _, _, p, _ in rows]),
    )

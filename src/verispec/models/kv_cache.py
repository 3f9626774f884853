"""The keys and values of a model's layers for a batch of sequences, allocated once and rolled back by moving
a length (:class:`KVCache`); its rows, each a sequence's cache of its own scored together with the others
(:meth:`KVCache.rows`, :func:`rows_of_one_cache`, :func:`native_rows`), and the rows of a drafter's own cache
beside an engine's slots (:class:`RowsBeside`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from verispec.errors import UsageError
from verispec.inputs import check_int, is_int
from verispec.models.base import check_compact, check_truncate

__all__ = ["KEY_TILE", "KVCache", "RowsBeside", "advance_rows", "native_rows", "rows_of_one_cache"]

KEY_TILE = 16  # slots per key tile in the native kernels' cache (KVCache tiled)


class KVCache:
    """Keys and values of every layer for ``batch_size`` sequences, allocated once for ``capacity`` slots.

    Slots ``[0, length)`` are committed; a forward writes its T new tokens at ``length .. length + T - 1`` and
    moves ``length`` on. ``truncate`` only moves ``length`` back, so rolling back rejected draft tokens costs
    nothing and never copies.

    ``separate_layers``: each layer's keys and values in a tensor of its own (``keys[i]`` reads the same
    either way), for training through the cache: a layer's write then leaves the tensors autograd saved for
    the layers before it untouched. Engine caches hold every layer in one tensor (one gather compacts all).

    ``tiled``: the native kernels' layout (:mod:`verispec.kernels`), float16 only: keys in tiles of
    :data:`KEY_TILE` slots, ``keys`` [layers, B, kv_heads, capacity / 16, head_dim, 16], so that one vector
    load holds one dimension of 16 slots; ``values`` as usual; the capacity rounded up to whole tiles.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        separate_layers: bool = False,
        tiled: bool = False,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("capacity", capacity),
            ("head_dim", head_dim),
        ):
            check_int(value, name, 1)
        if tiled and (separate_layers or dtype != torch.float16):
            raise UsageError("a tiled cache holds every layer in one float16 tensor")
        self._capacity = capacity
        self.tiled = tiled
        self.row: int | None = None  # a row view's index in `whole` (see :meth:`rows`)
        if tiled:
            capacity = -(-capacity // KEY_TILE) * KEY_TILE
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        # keys, values: [layers, B, kv_heads, capacity, head_dim] (separate_layers: a list of the layers'
        # [B, kv_heads, capacity, head_dim]; tiled: keys [layers, B, kv_heads, capacity / 16, head_dim, 16]);
        # keys are stored after RoPE
        self.keys: Tensor | list[Tensor]
        self.values: Tensor | list[Tensor]
        if tiled:
            tiles = (*shape[:3], capacity // KEY_TILE, head_dim, KEY_TILE)
            # uninitialised, as the other layouts: a slot is read only after it is written (the lanes of a
            # key tile past the last written slot are computed on, and dropped)
            self.keys = torch.empty(tiles, dtype=dtype, device=device)
            self.values = torch.empty(shape, dtype=dtype, device=device)
        elif separate_layers:
            self.keys = [torch.empty(shape[1:], dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.empty(shape[1:], dtype=dtype, device=device) for _ in range(num_layers)]
        else:
            self.keys = torch.empty(shape, dtype=dtype, device=device)
            self.values = torch.empty(shape, dtype=dtype, device=device)
        self.whole: tuple[Tensor, Tensor] | None = None  # a row view's: the batch's keys and values tensors
        self._length = 0

    @property
    def length(self) -> int:
        """Committed slots."""
        return self._length

    @property
    def capacity(self) -> int:
        """Slots available in all."""
        return self._capacity

    @property
    def batch_size(self) -> int:
        return self.values[0].shape[0]

    @property
    def separate_layers(self) -> bool:
        return isinstance(self.keys, list)

    def truncate(self, length: int) -> None:
        """Drop every slot from ``length`` on (0 ≤ length ≤ self.length; UsageError otherwise)."""
        check_truncate(self._length, length)
        self._length = length

    def compact(self, start: int, keep: Sequence[int]) -> None:
        """Move the entries of slots ``keep`` (ascending, each in [start, length)) to slots start, start + 1,
        …, and drop every slot after them: a token tree's accepted path kept in place, the rest dropped. One
        gather over every layer at once; nothing moves when ``keep`` is already start, start + 1, …"""
        keep = check_compact(self._length, start, keep)
        end = start + len(keep)
        if keep != list(range(start, end)):
            if not (isinstance(self.keys, Tensor) and isinstance(self.values, Tensor)):  # separate layers
                raise UsageError("a cache of separate layers (for training) does not compact")
            index = torch.tensor(keep, dtype=torch.int64, device=self.keys.device)  # [len(keep)]
            # values (and untiled keys): [layers, B, kv_heads, capacity, head_dim]; index_select copies first
            self.values[:, :, :, start:end] = self.values.index_select(3, index)
            if not self.tiled:
                self.keys[:, :, :, start:end] = self.keys.index_select(3, index)
            else:  # keys [layers, B, kv_heads, tiles, head_dim, 16]: slot s is (tile s // 16, lane s % 16)
                # [len(keep), layers, B, kv_heads, head_dim]
                moved = self.keys[:, :, :, index // KEY_TILE, :, index % KEY_TILE]
                for slot, key in zip(range(start, end), moved, strict=True):
                    self.keys[:, :, :, slot // KEY_TILE, :, slot % KEY_TILE] = key
        self._length = end

    def rows(self) -> list[KVCache]:
        """One cache per sequence of this batch cache, each a view of its row (nothing is copied) with a
        length of its own: the slots of a continuous batch, scored together by :meth:`Llama.forward_rows`."""
        if not isinstance(self.keys, Tensor) or not isinstance(self.values, Tensor) or self.row is not None:
            raise UsageError("only a whole cache in one tensor has rows")
        out = []
        for i in range(self.batch_size):
            view = object.__new__(KVCache)
            view.keys, view.values = self.keys[:, i : i + 1], self.values[:, i : i + 1]
            view._length, view._capacity, view.tiled = 0, self._capacity, self.tiled
            view.row, view.whole = i, (self.keys, self.values)
            out.append(view)
        return out

    def first_layers(self, num_layers: int) -> KVCache:
        """A cache over this one's first ``num_layers`` layers (views: nothing is copied) whose length starts
        at this one's and then moves on its own: the cache of an early-exit draft (:meth:`Llama.first_layers`)
        of the model that fills this one, which computes exactly those layers, so the draft finds every slot
        the full model has written. Slots the draft writes beyond that are the full model's to overwrite."""
        layers = len(self.keys)
        check_int(num_layers, "num_layers", 1, layers)
        view = object.__new__(KVCache)
        view.keys, view.values = self.keys[:num_layers], self.values[:num_layers]
        view._length, view._capacity, view.tiled = self._length, self._capacity, self.tiled
        view.row = self.row
        view.whole = None if self.whole is None else (self.whole[0][:num_layers], self.whole[1][:num_layers])
        return view

    def copy_from(self, source: KVCache, length: int | None = None) -> None:
        """Hold a copy of ``source``'s first ``length`` committed slots (default: all), and that length: one
        prefix's entries given to another sequence (another row of a batch) without computing them again.
        Both in one tensor of the same layout and shape but for the capacity, whose slots must fit in this
        one's."""
        for cache in (self, source):
            if not isinstance(cache.keys, Tensor) or not isinstance(cache.values, Tensor):
                raise UsageError("copy_from takes caches that hold every layer in one tensor")
        assert isinstance(self.keys, Tensor) and isinstance(self.values, Tensor)
        assert isinstance(source.keys, Tensor) and isinstance(source.values, Tensor)
        n = source.length if length is None else length
        if not is_int(n) or not 0 <= n <= source.length:
            raise UsageError(f"cannot copy {n!r} slots of a cache of length {source.length}")
        same = self.tiled == source.tiled and self.values.shape[:3] == source.values.shape[:3]
        if not same or self.values.shape[4:] != source.values.shape[4:] or n > self.capacity:
            raise UsageError(f"cannot copy {n} slots of a cache of another layout or shape, or past capacity")
        slots = -(-n // KEY_TILE) if self.tiled else n  # keys: whole tiles of 16 slots when tiled
        self.keys[:, :, :, :slots] = source.keys[:, :, :, :slots]
        self.values[:, :, :, :n] = source.values[:, :, :, :n]
        self._length = n

    def grown(self, extra: int) -> KVCache:
        """A new cache holding copies of this one's committed slots, with room for ``extra`` more: a copy that
        autograd follows, so that training can extend one context along several branches (the unrolled
        draft steps of :mod:`verispec.training.eagle`) without writing into tensors it still needs."""
        check_int(extra, "extra", 0)
        if self.tiled:
            raise UsageError("a tiled cache (the native kernels') does not grow: training uses the plain one")
        batch, heads, _, head_dim = self.keys[0].shape
        grown = KVCache(
            len(self.keys),
            batch,
            heads,
            self._length + extra,
            head_dim,
            dtype=self.keys[0].dtype,
            device=self.keys[0].device,
            separate_layers=self.separate_layers,
        )
        for i in range(len(self.keys)):
            grown.keys[i][:, :, : self._length] = self.keys[i][:, :, : self._length]
            grown.values[i][:, :, : self._length] = self.values[i][:, :, : self._length]
        grown._length = self._length
        return grown

    def _reserve(self, num_tokens: int) -> tuple[int, int]:
        """The slot range [start, end) the next ``num_tokens`` tokens go to (UsageError past capacity)."""
        start, end = self._length, self._length + num_tokens
        if end > self.capacity:
            raise UsageError(
                f"cache overflow: {start} committed + {num_tokens} new slots exceed "
                f"its capacity {self.capacity}"
            )
        return start, end


class RowsBeside:
    """The rows of a cache of one's own beside an engine's slots: for a sequence whose target cache is row r
    of a whole cache of R rows, row r of an R-row cache made once per whole target cache (by ``make(R)``),
    so that the sequences of one engine have the rows of one cache (drafted for in one forward); a new
    whole cache (another engine) gets new rows."""

    def __init__(self) -> None:
        self._held: tuple[weakref.ref[Tensor], list[Any]] | None = None  # the target's keys, the rows

    @staticmethod
    def fits(slot: object) -> bool:
        """Whether ``slot`` is a row of a whole cache (an engine's slot)."""
        return isinstance(slot, KVCache) and slot.row is not None and slot.whole is not None

    def row(self, slot: KVCache, make: Callable[[int], list[Any]]) -> Any:
        """Row ``slot.row`` of the rows made beside ``slot``'s whole cache (``slot``: :meth:`fits`)."""
        assert slot.whole is not None and slot.row is not None  # fits
        whole = slot.whole[0]  # [layers, R, ...]: the target's keys
        if self._held is None or self._held[0]() is not whole:
            self._held = (weakref.ref(whole), make(whole.shape[1]))
        return self._held[1][slot.row]


def rows_of_one_cache(caches: Sequence[object]) -> bool:
    """Whether ``caches`` are rows of one whole cache (:meth:`KVCache.rows`), each its own: what
    :func:`run_native_rows` takes."""
    if not all(isinstance(c, KVCache) and c.whole is not None for c in caches):
        return False
    wholes = {id(c.whole[0]) for c in caches if isinstance(c, KVCache) and c.whole is not None}
    return len(wholes) == 1 and len({id(c) for c in caches}) == len(caches)


def native_rows(caches: Sequence[KVCache], counts: Sequence[int]) -> dict[str, Tensor]:
    """Where a native forward puts the next ``counts[i]`` tokens of each of ``caches`` (rows of one whole
    tiled cache, each its own, :func:`rows_of_one_cache`; or one tiled cache of its own): each token's row,
    slot and base (seq, slot, base [N] int32, N = Σ counts; causal) and the keys and values it writes to.
    The caches' lengths move after the forward (:func:`advance_rows`)."""
    seq: list[int] = []
    slot: list[int] = []
    base: list[int] = []
    for cache, t in zip(caches, counts, strict=True):
        start, _ = cache._reserve(t)
        seq += [0 if cache.row is None else cache.row] * t
        slot += range(start, start + t)
        base += [start] * t
    whole = caches[0].whole
    keys, values = (caches[0].keys, caches[0].values) if whole is None else whole
    assert isinstance(keys, Tensor) and isinstance(values, Tensor)  # tiled: one tensor each
    return {
        "seq": torch.tensor(seq, dtype=torch.int32),  # [N]
        "slot": torch.tensor(slot, dtype=torch.int32),  # [N]
        "base": torch.tensor(base, dtype=torch.int32),  # [N]
        "keys": keys,
        "values": values,
    }


def advance_rows(caches: Sequence[KVCache], counts: Sequence[int]) -> None:
    """The caches of a native forward of :func:`native_rows` hold their new tokens."""
    for cache, t in zip(caches, counts, strict=True):
        cache._length += t

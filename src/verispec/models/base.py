"""The narrow interfaces between the engine and a language model: model, cache, tokenizer.

Guarantees the engine relies on:

- ``forward`` appends exactly T entries to the cache, at slots ``cache.length .. cache.length + T - 1``, and
  returns logits for each of the T new tokens; token j of the call attends to every committed slot and to new
  tokens 0..j (causal).
- ``cache.truncate(n)`` forgets every slot from n on in O(1): rollback is moving the length back. Slots below
  n are never modified by a later ``forward``.
- The same inputs give the same logits (no hidden state outside the cache).

Token trees (:mod:`verispec.drafting.tree`) need more, from a :class:`TreeLanguageModel` and its
:class:`TreeCache`:

- ``forward(..., tree_mask=M)`` with M: [T, T] bool changes only whom the new tokens attend to: token j of the
  call attends to every committed slot and to the new tokens i with M[j, i] (M[j, j] must be True); positions
  are the caller's (committed length + depth for a tree). Its T entries are appended as without a mask.
- ``cache.compact(start, keep)`` moves the entries of the slots ``keep`` (ascending, each in
  [start, length)) to slots start, start + 1, …, and drops every slot after them: the length becomes
  start + len(keep). The moved entries equal (up to rounding) those a plain forward over the kept tokens at
  those slots would have written: each was computed attending to its own ancestors only.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from verispec.errors import UsageError
from verispec.inputs import is_int

if TYPE_CHECKING:
    from verispec.grammar.tools import Tools


@runtime_checkable
class Cache(Protocol):
    """Per-sequence key/value state of a model, preallocated, rolled back by moving its length."""

    @property
    def length(self) -> int:  # committed slots
        ...

    @property
    def capacity(self) -> int:  # slots available in all
        ...

    def truncate(self, length: int) -> None:
        """Drop every slot from ``length`` on (0 ≤ length ≤ self.length; UsageError otherwise)."""
        ...


def check_truncate(length: int, to: int) -> None:
    """UsageError unless a cache of ``length`` committed slots can be truncated ``to`` that many: an integer
    in [0, length] (:meth:`Cache.truncate`)."""
    if not is_int(to) or not 0 <= to <= length:
        raise UsageError(f"cannot truncate a cache of length {length} to {to!r}")


def check_compact(length: int, start: int, keep: Sequence[int]) -> list[int]:
    """``keep`` as a list where a cache of ``length`` committed slots can compact it from ``start``
    (:meth:`TreeCache.compact`: integers ascending within [start, length), start in [0, length]); else
    UsageError."""
    keep = list(keep)
    if not is_int(start) or not 0 <= start <= length:
        raise UsageError(f"cannot compact a cache of length {length} from slot {start!r}")
    bounds = [start - 1, *keep, length]
    if not all(is_int(s) for s in keep) or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise UsageError(f"slots to keep must ascend within [{start}, {length}), got {keep}")
    return keep


@runtime_checkable
class LanguageModel(Protocol):
    """A causal language model the engine can drive."""

    vocab_size: int  # width of the logits
    max_context: int  # the most positions a cache can hold

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> Cache:
        """An empty cache for ``batch_size`` sequences of at most ``capacity`` (default max_context) slots."""
        ...

    def forward(self, tokens: Tensor, positions: Tensor, cache: Cache) -> Tensor:
        """tokens: [B, T] int64; positions: [B, T] int64 (RoPE positions, normally cache.length + arange(T)).

        Returns logits: [B, T, vocab_size] float32. Appends T slots to ``cache``."""
        ...

    def prefill(self, tokens: Tensor, positions: Tensor, cache: Cache) -> None:
        """Appends T slots to ``cache`` exactly as :meth:`forward` would, without computing the logits (a
        prompt's prefill needs none: the output head over every prompt position is most of its cost)."""
        ...


@runtime_checkable
class TreeCache(Cache, Protocol):
    """A cache that can keep an accepted path of a token tree and drop the rest."""

    def compact(self, start: int, keep: Sequence[int]) -> None:
        """Move the entries of slots ``keep`` (ascending, in [start, length)) to start, start + 1, …; the
        length becomes start + len(keep) (UsageError for slots out of that range or not ascending)."""
        ...


@runtime_checkable
class TreeLanguageModel(LanguageModel, Protocol):
    """A language model that scores a whole token tree in one forward."""

    def forward(
        self, tokens: Tensor, positions: Tensor, cache: Cache, tree_mask: Tensor | None = None
    ) -> Tensor:
        """As :meth:`LanguageModel.forward`; tree_mask: [T, T] bool, new token j attends to new token i iff
        tree_mask[j, i] (None: causal). UsageError when this model cannot take a custom mask."""
        ...


@runtime_checkable
class HiddenStateModel(TreeLanguageModel, Protocol):
    """A language model that also returns its final hidden states, for drafters that read them (the learned
    heads of :mod:`verispec.drafting.learned`)."""

    def forward_hidden(
        self, tokens: Tensor, positions: Tensor, cache: Cache, tree_mask: Tensor | None = None
    ) -> Tensor:
        """As :meth:`TreeLanguageModel.forward`, but the final hidden states [B, T, H] (after the last norm)
        instead of logits; appends the same T cache entries."""
        ...

    def logits(self, hidden: Tensor) -> Tensor:
        """The logits [..., V] of final hidden states [..., H] (the model's head)."""
        ...


@dataclass(frozen=True, eq=False)
class RowInput:
    """One sequence's part of a batched forward (:class:`RowModel`): ``tokens`` [T] int64 at ``positions``
    [T] int64, appended at the end of ``cache`` (a row of the batch's cache); ``tree_mask`` [T, T] bool or
    None (causal); whether its ``logits`` and its final ``hidden`` states are wanted."""

    cache: Cache
    tokens: Tensor
    positions: Tensor
    tree_mask: Tensor | None
    logits: bool
    hidden: bool


@runtime_checkable
class RowModel(Protocol):
    """A language model that scores the rows of one cache in one forward, each row exactly as it would be
    scored alone (bit for bit: a row's outputs never depend on the other rows)."""

    def new_cache_rows(self, rows: int) -> list[Cache]:
        """Caches of ``rows`` sequences, each with its own length, stored together."""
        ...

    def copy_prefix(self, source: Cache, dest: Cache, length: int) -> None:
        """``dest`` holds ``source``'s first ``length`` slots (both rows from :meth:`new_cache_rows`), and
        that length: the entries another row would compute for the same first tokens, bit for bit."""
        ...

    def scores_together(self, rows: Sequence[RowInput]) -> bool:
        """Whether :meth:`forward_rows` takes these rows in one forward (rows of one cache from
        :meth:`new_cache_rows`, each its own)."""
        ...

    def forward_rows(self, rows: Sequence[RowInput]) -> list[tuple[Tensor | None, Tensor | None]]:
        """Every row's (logits [T, V] float32 or None, final hidden states [T, H] or None), as wanted;
        appends each row's T entries to its cache."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """Text ↔ token ids for one model."""

    vocab_size: int
    bos_token_id: int | None  # prepended by encode(add_bos=True) when not None
    eos_token_ids: frozenset[int]  # any of these ends generation

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens skipped); decode(a + b) starts with decode(a) once a ends on a
        whole character, which is what streaming relies on."""
        ...

    def chat_prompt(self, user_message: str | Sequence[Mapping[str, Any]], tools: Tools | None = None) -> str:
        """``user_message`` wrapped in the model's chat template, ready to generate the assistant's reply; it
        may also be a whole conversation, {"role", "content"} messages ending with a user turn (or tool
        results: OpenAI's assistant ``tool_calls`` and ``tool`` messages), the functions it may call
        ``tools``. UsageError when the model has no chat template."""
        ...


def has_chat_template(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` wraps a message in a chat template (a llama2.c one never does)."""
    try:
        tokenizer.chat_prompt("hi")
    except ValueError:  # UsageError: no template
        return False
    return True


@runtime_checkable
class SpelledTokenizer(Tokenizer, Protocol):
    """A tokenizer that spells each of its tokens in bytes: what drafting across tokenizers reads
    (:mod:`verispec.drafting.cross_tokenizer`)."""

    def token_bytes(self) -> list[bytes]:
        """[vocab_size] the bytes each id stands for in text: byte-level and SentencePiece conventions
        undone ("Ġ", "▁" and ``<0xNN>`` are bytes), a special token's own text, b"" for a token that stands
        for no text (unknown, padding); a word-initial space where the tokenizer writes one. A piece that is
        part of a UTF-8 character is those bytes alone."""
        ...

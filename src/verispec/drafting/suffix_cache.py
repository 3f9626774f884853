"""The global suffix cache: previous requests' outputs (and, if asked, prompts), shared by every request of a
speculator, bounded by a token budget, thread-safe, saved and loaded whole.

What it stores is token ids only, nothing else of a request: each finished request's output as one sequence
(its prompt too with ``prompts=True``), oldest first. Once the tokens held would pass ``budget``, the oldest
sequences are evicted (a sequence longer than the budget keeps its last ``budget`` tokens). Memory: the tokens
(8 bytes each) and their positions (8 bytes each) in :class:`~verispec.drafting.suffix_index.TokenIndex`, at
most twice the budget between compactions: about 32 bytes per token of budget, 32 MB for the default one
million tokens.

Whatever it holds, the output's distribution is the target's: its tokens are single guesses, which the
verifier accepts or replaces exactly as the target's sampling would (the enumeration suite proves it with
adversarial contents). It changes only how fast tokens come.

The file (:meth:`SuffixCache.save`, :meth:`SuffixCache.load`) is a NumPy ``.npz`` archive of plain arrays
(no pickles): a format tag, the tokenizer's identity, the budget, the held sequences' lengths and tokens. A
file that is not one, or was written for another tokenizer, is refused with a one-line UsageError (never
ignored: a silently cold cache would hide a wrong path, and saving over it at exit would lose it).
"""

from __future__ import annotations

import hashlib
import threading
import zipfile
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from verispec.drafting.suffix_index import SEPARATOR, SuffixConfig, TokenIndex
from verispec.drafting.tree import TreeShape
from verispec.errors import UsageError
from verispec.files import atomic_path
from verispec.inputs import is_int

__all__ = ["DEFAULT_BUDGET", "FORMAT", "SuffixCache", "tokenizer_identity"]

DEFAULT_BUDGET = 1_000_000  # tokens held across requests
FORMAT = "verispec-suffix-cache-1"


def tokenizer_identity(tokenizer) -> str:
    """What a cache's token ids mean: the tokenizer's vocabulary size and, when it spells its tokens
    (:class:`~verispec.models.base.SpelledTokenizer`), a hash of their bytes."""
    spell = getattr(tokenizer, "token_bytes", None)
    spelled = hashlib.sha256(b"\0".join(spell())).hexdigest()[:16] if callable(spell) else "unspelled"
    return f"{tokenizer.vocab_size}:{spelled}"


class SuffixCache:
    """Token sequences of previous requests, for every request of a speculator to draft from.

    budget: the most tokens held (an integer >= 1); prompts: whether :meth:`add` keeps prompts as well as
    outputs; vocabulary: the tokenizer's identity (:func:`tokenizer_identity`), checked by :meth:`load`
    ("" accepts any). One lock serialises every call: a lookup holds it well under a millisecond."""

    def __init__(self, budget: int = DEFAULT_BUDGET, *, prompts: bool = False, vocabulary: str = "") -> None:
        if not is_int(budget) or budget < 1:
            raise UsageError(f"a suffix cache's budget is an integer >= 1 tokens, got {budget!r}")
        self.budget, self.prompts, self.vocabulary = int(budget), prompts, vocabulary
        self._lock = threading.Lock()
        self._index = TokenIndex()
        self._lengths: deque[int] = deque()  # each held sequence's tokens, oldest first
        self._held = 0
        self._evictions = 0
        self._added = 0  # sequences added so far, evicted ones included

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """A finished request's ``output`` (and ``prompt``, with ``prompts``) enter the cache as a new
        sequence each, the oldest evicted beyond the budget."""
        for tokens in ([prompt] if self.prompts else []) + [output]:
            if len(tokens):
                self._add(tokens)

    def _add(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)[-self.budget :]
        with self._lock:
            while self._lengths and self._held + len(tokens) > self.budget:
                oldest = self._lengths.popleft()
                self._held -= oldest
                self._evictions += 1
                self._index.evict(self._index.start + oldest + 1)  # and its separator
            self._index.extend(tokens)
            self._index.close()
            self._lengths.append(len(tokens))
            self._held += len(tokens)
            self._added += 1

    def stats(self) -> dict[str, int]:
        """tokens held, sequences held, sequences evicted so far, and the budget."""
        with self._lock:
            return {
                "tokens": self._held,
                "sequences": len(self._lengths),
                "evictions": self._evictions,
                "budget": self.budget,
            }

    def chain(self, context: Sequence[int], config: SuffixConfig, k: int) -> tuple[list[int], float]:
        """The likeliest continuation of ``context`` here and its score
        (:meth:`~verispec.drafting.suffix_index.TokenIndex.draft_chain`)."""
        with self._lock:
            return self._index.draft_chain(context, config, k)

    def tree(
        self, context: Sequence[int], shape: TreeShape, config: SuffixConfig
    ) -> tuple[list[int], list[int], float]:
        """The tree of ``context``'s continuations here in ``shape``: its nodes, tokens and score
        (:meth:`~verispec.drafting.suffix_index.TokenIndex.draft_tree`)."""
        with self._lock:
            return self._index.draft_tree(context, shape, config)

    @property
    def added(self) -> int:
        """Sequences added so far, evicted ones included: a mark for :meth:`sequences`."""
        with self._lock:
            return self._added

    def sequences(self, since: int = 0) -> list[list[int]]:
        """The held sequences, oldest first; with ``since`` (an earlier :attr:`added`), only those added
        after it."""
        with self._lock:
            live = self._index.tokens[self._index.start : self._index.size]  # [L]
            ends = np.flatnonzero(live == SEPARATOR)  # [S]
            starts = np.concatenate([[0], ends + 1])[:-1]  # [S]
            skip = max(0, len(ends) - (self._added - since))  # the held ones added before the mark
            return [live[s:e].tolist() for s, e in zip(starts[skip:], ends[skip:], strict=True)]

    def merge(self, sequences: Iterable[Sequence[int]], vocabulary: str = "") -> None:
        """Add another cache's ``sequences`` (a batch worker's, since it started from the same file) as the
        newest, in order; ``vocabulary``: that cache's tokenizer identity, a UsageError when it is not this
        one's (this one's, when empty, becomes it)."""
        if vocabulary and self.vocabulary and vocabulary != self.vocabulary:
            raise UsageError(
                f"cannot merge a suffix cache of another tokenizer ({vocabulary}, not {self.vocabulary})"
            )
        self.vocabulary = self.vocabulary or vocabulary
        for tokens in sequences:
            if len(tokens):
                self._add(tokens)

    def save(self, path: str | Path, mode: int | None = None) -> None:
        """Write the cache to ``path`` (an ``.npz`` archive; module docstring), atomically; ``mode``: the
        file's permissions (a server tenant's: 0o600), None: a plain ``open()``'s."""
        held = self.sequences()
        lengths = np.array([len(s) for s in held], dtype=np.int64)  # [S]
        tokens = np.array([t for s in held for t in s], dtype=np.int64)  # [sum(lengths)]
        with atomic_path(path, mode) as tmp, tmp.open("wb") as out:
            np.savez(
                out,
                format=np.array(FORMAT),
                vocabulary=np.array(self.vocabulary),
                budget=np.array(self.budget),
                lengths=lengths,
                tokens=tokens,
            )

    @classmethod
    def load(
        cls, path: str | Path, budget: int | None = None, *, prompts: bool = False, vocabulary: str = ""
    ) -> SuffixCache:
        """The cache saved at ``path``, with ``budget`` (None: the saved one; a smaller one keeps the newest
        sequences); UsageError, one line, for a file that is not a suffix cache or was saved for another
        tokenizer than ``vocabulary`` ("": any, the cache then keeps the saved one) (module docstring)."""
        saved_for, saved_budget, lengths, tokens = _read(Path(path))
        if vocabulary and saved_for and saved_for != vocabulary:
            raise UsageError(
                f"the suffix cache {path} was saved for another tokenizer ({saved_for}, not {vocabulary})"
            )
        budget = saved_budget if budget is None else budget
        cache = cls(budget, prompts=prompts, vocabulary=vocabulary or saved_for)
        for sequence in np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []:
            cache._add(sequence.tolist())
        return cache

    @staticmethod
    def check(path: str | Path) -> None:
        """UsageError, one line, unless ``path`` holds a suffix cache (read, not indexed: fast, and before a
        model loads); its tokenizer is checked by :meth:`load`."""
        _read(Path(path))


def _read(path: Path) -> tuple[str, int, np.ndarray, np.ndarray]:
    """A cache file's tokenizer identity, budget, sequence lengths and tokens; UsageError unless it is one."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            tag = str(archive["format"])
            if tag != FORMAT:
                raise ValueError(f"format {tag[:40]!r}, not {FORMAT!r}")
            saved_for, saved_budget = str(archive["vocabulary"]), int(archive["budget"])
            lengths, tokens = archive["lengths"], archive["tokens"]
        if lengths.ndim != 1 or tokens.ndim != 1 or lengths.dtype.kind != "i" or tokens.dtype.kind != "i":
            raise ValueError("lengths and tokens are not integer vectors")
        if (lengths < 0).any() or int(lengths.sum()) != len(tokens) or (tokens < 0).any():
            raise ValueError("lengths and tokens disagree")
    except OSError as err:
        raise UsageError(f"cannot read the suffix cache {path}: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as err:
        why = "not an archive of arrays" if "pickle" in str(err) else str(err).splitlines()[0]  # numpy's
        raise UsageError(f"{path} is not a verispec suffix cache ({why})") from None
    return saved_for, saved_budget, lengths, tokens

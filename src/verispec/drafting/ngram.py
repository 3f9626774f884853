"""Prompt lookup: draft tokens copied from what followed earlier occurrences of the context's suffix, as a
chain (:class:`NGramDrafter`) or a tree of several matches (:class:`NGramTreeDrafter`)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from verispec.drafting.base import Allowed, Proposal, allowed_guesses, allowed_tree, check_static
from verispec.drafting.tree import TreeProposal, TreeShape
from verispec.errors import UsageError

__all__ = ["NGramDrafter", "NGramTreeDrafter"]


class NGramDrafter:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the context's last n tokens.

    For n from ``max_ngram`` down to ``min_ngram``, the last n tokens of the context are searched for earlier
    in the context; at the latest match, the (up to k) tokens that followed it are proposed as single guesses.

    Worked example, with max_ngram=3, min_ngram=1, k=3 and the context (as words)::

        the cat sat on the mat . the cat
                                 ^^^^^^^ last 3 tokens ". the cat"? no earlier match
        last 2 tokens "the cat" match at position 0 → propose "sat on the"

    Copy-heavy outputs (summaries, edits, answers quoting a passage) accept long runs of these guesses.
    By default a match needs two tokens (``min_ngram=2``): a single matching token is a weak signal, and on
    the bench's greedy SmolLM2-135M outputs, dropping those guesses saves more verification positions than
    it loses accepted tokens (predicted decoding speedup +3–7 % on summarization, RAG, code editing and code
    completion, ±1 % elsewhere).
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise UsageError(f"need 1 <= min_ngram <= max_ngram, got min {min_ngram!r}, max {max_ngram!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._seen: list[int] = []  # the context indexed so far
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram → where its latest continuation starts

    def begin(self, prompt: list[int]) -> None:
        self._seen, self._latest = [], {}

    def _index(self, context: list[int]) -> None:
        """Index every n-gram of the context that ends before its last token (incrementally: the context
        grows between rounds; another context is indexed afresh)."""
        if context[: len(self._seen)] != self._seen:
            self._seen, self._latest = [], {}
        for end in range(max(len(self._seen), 1), len(context)):  # n-grams ending at `end` - 1
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._latest[tuple(context[end - n : end])] = end
        self._seen = context[:-1] if len(context) > 1 else []

    def propose(
        self, context: list[int], k: int, generator: torch.Generator, allowed: Allowed | None = None
    ) -> Proposal:
        """The first of :meth:`continuations`, from an index kept across rounds (a lookup per n-gram length
        instead of a scan of the whole context)."""
        if k <= 0:
            return Proposal.empty()
        self._index(context)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(context[-n:]))
            if start is not None:
                guesses = allowed_guesses(context[start : start + k], allowed)
                return Proposal(tokens=torch.tensor(guesses, dtype=torch.long), q=None)
        return Proposal.empty()

    def continuations(self, context: list[int], k: int) -> Iterator[np.ndarray]:
        """The (up to k) tokens that followed each earlier occurrence of the context's last n tokens, best
        first: the longest n first, and for each n the latest occurrence first. Each is [1..k] int64."""
        ids = np.asarray(context, dtype=np.int64)  # [N]
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            # windows[i] = ids[i : i + n] for every start i whose window ends before the last token
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [N - n, n]
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            for hit in hits[::-1]:
                start = int(hit) + n
                yield ids[start : start + k].copy()

    def observe(self, num_accepted: int) -> None:
        pass

    def cost_identity(self) -> dict:
        return {"drafter": self.name, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}


class NGramTreeDrafter:
    """Prompt lookup, branched: the continuations of several earlier occurrences of the context's suffix —
    the longest n-gram first, then the latest occurrence — merged into a prefix tree (single guesses).

    Where a chain proposes only the latest match, the tree also keeps the other continuations that earlier
    occurrences (or shorter suffixes) suggest, each as a sibling branch where it first differs."""

    name = "ngram"

    def __init__(self, shape: TreeShape, lookup: NGramDrafter | None = None) -> None:
        check_static(shape, "ngram")
        self.shape = shape
        self.lookup = NGramDrafter() if lookup is None else lookup  # its n-gram lengths

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose_tree(
        self, context: list[int], shape: TreeShape, generator: torch.Generator, allowed: Allowed | None = None
    ) -> TreeProposal:
        return allowed_tree(
            shape.merge(context[-1], self.lookup.continuations(context, shape.max_depth)), allowed
        )

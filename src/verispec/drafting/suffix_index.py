"""The suffix index SuffixDecoding drafts from: token sequences stored end to end, where each token occurs,
the longest match of a context's suffix, and the continuations of its occurrences scored by frequency.

SuffixDecoding (Oliaro et al., NeurIPS 2025) keeps suffix trees whose nodes count how often each substring
occurs: the node of the context's longest matching suffix (at most ``max_depth`` tokens), then its children by
count, give the likely next tokens with an empirical probability count(child) / count(node). This index gives
the same numbers without a node per substring (a depth-bounded trie over a million tokens holds tens of
millions of Python objects): the tokens live in one NumPy array, each sequence followed by a separator (-1),
and each token's positions in an ``array`` of int64, ascending. A match starts from the occurrences of the
context's last token (the most recent ``max_candidates`` of them) and narrows them one token back at a time;
the occurrences left are the node's, and grouping the tokens that follow them, depth by depth, walks its
subtree. Positions before :attr:`TokenIndex.start` are evicted (skipped, then dropped when they are half of
the array).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from verispec.drafting.tree import TreeShape
from verispec.errors import UsageError
from verispec.inputs import check_int

__all__ = ["SEPARATOR", "Match", "SuffixConfig", "TokenIndex"]

SEPARATOR = -1  # follows every closed sequence: no match or continuation crosses it
_FEW = 48  # occurrences grouped in Python rather than NumPy (TokenIndex._children)


@dataclass(frozen=True)
class SuffixConfig:
    """How a suffix drafter matches and how much it drafts (the paper's and ArcticInference's defaults).

    max_depth: the longest suffix matched (tokens); min_match: the shortest match drafted from; alpha: draft
    at most ⌊alpha · match length⌋ tokens; min_prob: the least empirical path probability of a draft token;
    max_candidates: the most recent occurrences of the context's last token a match starts from (bounds a
    lookup's time in a large cache)."""

    max_depth: int = 24
    min_match: int = 1
    alpha: float = 1.0
    min_prob: float = 0.1
    max_candidates: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_depth", "min_match", "max_candidates"):
            value = getattr(self, name)
            check_int(value, f"suffix {name}", 1)
        if self.min_match > self.max_depth:
            raise UsageError(f"suffix min_match {self.min_match} exceeds max_depth {self.max_depth}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise UsageError(f"suffix alpha must be a number > 0, got {self.alpha!r}")
        if not (isinstance(self.min_prob, (int, float)) and 0 < self.min_prob <= 1):
            raise UsageError(f"suffix min_prob must be in (0, 1], got {self.min_prob!r}")


@dataclass(frozen=True)
class Match:
    """The occurrences of a context's longest matching suffix that have a continuation."""

    length: int  # tokens matched, 0 when none
    ends: np.ndarray  # [M] int64: where each occurrence ends (its last token's position), ascending


class TokenIndex:
    """Token sequences end to end (the last one open: :meth:`extend` grows it, :meth:`close` ends it) and
    the positions of each token; not thread-safe (the global cache holds a lock around it)."""

    def __init__(self) -> None:
        # [capacity] the first `size` used; always one slot more than used, so that tokens[size] and
        # tokens[-1] are separators (a match walking back past position 0 reads one and stops)
        self.tokens = np.full(1024, SEPARATOR, dtype=np.int64)
        self.size = 0
        self.start = 0  # positions before it are evicted
        self._where: dict[int, array] = {}  # token -> its positions (int64), ascending

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the open sequence."""
        n = len(tokens)
        if self.size + n >= len(self.tokens):
            grown = np.full(max(2 * len(self.tokens), self.size + n + 1), SEPARATOR, dtype=np.int64)
            grown[: self.size] = self.tokens[: self.size]
            self.tokens = grown
        self.tokens[self.size : self.size + n] = tokens
        for offset, token in enumerate(tokens):
            self._where.setdefault(int(token), array("q")).append(self.size + offset)
        self.size += n

    def close(self) -> None:
        """End the open sequence (nothing matches across its end)."""
        self.extend([SEPARATOR])

    def evict(self, end: int) -> None:
        """Drop every position before ``end`` (a sequence boundary: its tokens become separators, so no
        match reaches them); the array is compacted once the evicted part is half of it."""
        self.tokens[self.start : end] = SEPARATOR
        self.start = max(self.start, end)
        if self.start > self.size // 2:
            self._compact()

    def _compact(self) -> None:
        live = self.tokens[self.start : self.size].copy()  # [L]
        self.tokens = np.full(max(1024, 2 * len(live)), SEPARATOR, dtype=np.int64)
        self.tokens[: len(live)] = live
        self.size, self.start, self._where = len(live), 0, {}
        order = np.argsort(live, kind="stable")  # [L] positions grouped by token, ascending within each
        values, firsts = np.unique(live[order], return_index=True)
        groups = np.split(order, firsts[1:]) if len(live) else []  # everything evicted: no group
        for token, group in zip(values.tolist(), groups, strict=True):
            if token != SEPARATOR:
                self._where[token] = array("q", group.astype(np.int64).tobytes())

    def match(self, context: Sequence[int], max_depth: int, max_candidates: int) -> Match:
        """The longest suffix of ``context`` (at most ``max_depth`` tokens) that occurs here followed by a
        token, among the last ``max_candidates`` occurrences of its last token."""
        empty = Match(0, np.zeros(0, dtype=np.int64))
        where = self._where.get(int(context[-1])) if context else None
        if where is None:
            return empty
        ends = self._candidates(np.frombuffer(where, dtype=np.int64), max_candidates)
        if len(ends) == 0:
            return empty
        length = 1
        for back in range(1, min(max_depth, len(context))):
            # [M'] those whose token `back` before is the context's too (an evicted token, a sequence's end
            # and, before position 0, tokens[-1] are separators: a match stops there)
            same = ends[self.tokens[ends - back] == int(context[-1 - back])]
            if not len(same):
                break
            ends, length = same, back + 1
        return Match(length, ends)

    def _candidates(self, where: np.ndarray, most: int) -> np.ndarray:
        """The last ``most`` of a token's positions ``where`` [O] (ascending) that are live and followed by
        a token, looked for in a window from the end that doubles until it holds them or everything (a
        frequent token's whole list is never scanned for a lookup)."""
        live = where[np.searchsorted(where, self.start) :]  # [L]
        window = most + 16
        while True:
            ends = live[-window:]  # [W]
            ends = ends[self.tokens[ends + 1] != SEPARATOR]  # [W'] followed by a token (tokens[size]: none)
            if len(ends) >= most or window >= len(live):
                return ends[-most:]
            window *= 2

    def _limited(self, context: Sequence[int], config: SuffixConfig) -> tuple[Match, int]:
        """The match of ``context`` (none below ``min_match``) and the depth it pays to draft to."""
        match = self.match(context, config.max_depth, config.max_candidates)
        if match.length < config.min_match:
            return Match(0, match.ends[:0]), 0
        return match, int(config.alpha * match.length)

    def draft_chain(self, context: Sequence[int], config: SuffixConfig, k: int) -> tuple[list[int], float]:
        """The likeliest continuation of ``context`` (:meth:`chain`), at most min(k, ⌊alpha · match
        length⌋) tokens, and its score."""
        match, limit = self._limited(context, config)
        return self.chain(match, min(k, limit), config.min_prob)

    def draft_tree(
        self, context: Sequence[int], shape: TreeShape, config: SuffixConfig
    ) -> tuple[list[int], list[int], float]:
        """The tree of ``context``'s continuations in ``shape`` (:meth:`tree`), at most ⌊alpha · match
        length⌋ deep: its nodes, tokens and score."""
        match, limit = self._limited(context, config)
        return self.tree(match, int(context[-1]), shape, limit, config.min_prob)

    def _children(self, ends: np.ndarray, depth: int, width: int) -> list[tuple[int, int, np.ndarray]]:
        """The ``width`` most frequent tokens ``depth`` positions after ``ends`` [M] (ties: the smaller token
        first), each with its count and the occurrences it follows [count]; a sequence's end is no token.
        Few occurrences are grouped in Python (NumPy's fixed cost per call is larger there)."""
        if len(ends) <= _FEW:
            groups: dict[int, list[int]] = {}
            for end in ends.tolist():
                token = int(self.tokens[end + depth]) if end + depth < self.size else SEPARATOR
                if token != SEPARATOR:
                    groups.setdefault(token, []).append(end)
            top = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))[:width]
            return [(token, len(group), np.array(group, dtype=np.int64)) for token, group in top]
        at = ends + depth  # [M]
        following = np.where(at < self.size, self.tokens[np.minimum(at, self.size - 1)], SEPARATOR)  # [M]
        values, counts = np.unique(following[following != SEPARATOR], return_counts=True)  # [U], [U]
        order = np.argsort(-counts, kind="stable")[:width]  # [≤ width]
        return [(int(values[i]), int(counts[i]), ends[following == values[i]]) for i in order]

    def chain(self, match: Match, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The likeliest continuation of ``match``, up to ``limit`` tokens: at each depth the most frequent
        next token among the occurrences still on the path, while the path's empirical probability (the
        product of count(child) / count(node)) stays >= ``min_prob``; and its score, the sum of those
        probabilities (the tokens it expects accepted)."""
        ends, prob, score = match.ends, 1.0, 0.0
        tokens: list[int] = []
        for depth in range(1, limit + 1):
            if len(ends) == 1:  # one occurrence left: its continuation, each token with the same probability
                rest = self.tokens[ends[0] + depth : min(ends[0] + limit + 1, self.size)].tolist()
                rest = rest[: rest.index(SEPARATOR)] if SEPARATOR in rest else rest
                return tokens + rest, score + prob * len(rest)
            best = self._children(ends, depth, 1)
            if not best or prob * best[0][1] / len(ends) < min_prob:
                break
            token, count, following = best[0]
            prob *= count / len(ends)
            tokens.append(token)
            score += prob
            ends = following
        return tokens, score

    def tree(
        self, match: Match, root: int, shape: TreeShape, limit: int, min_prob: float
    ) -> tuple[list[int], list[int], float]:
        """The nodes of ``shape`` (ascending, the root first) this match fills, their tokens and the tree's
        score: a node's children are the tokens that follow its occurrences, by count (rank 0 the most
        frequent; siblings distinct), kept down to depth ``limit`` while their path's probability is >=
        ``min_prob``; the score sums the kept nodes' path probabilities."""
        nodes, tokens, score = [0], [root], 0.0
        filled = {0: (match.ends, 1.0)}  # shape node -> (its occurrences [M], its path probability)
        ranked: dict[int, list[tuple[int, float, np.ndarray]]] = {}  # node -> its children's candidates
        depths = shape.depth.tolist()
        widths: dict[int, int] = {}  # node -> how many children the shape gives it
        for node in range(1, shape.num_nodes):
            parent = shape.parent_list[node]
            widths[parent] = max(widths.get(parent, 0), shape.paths[node][-1] + 1)
        for node in range(1, shape.num_nodes):
            parent, rank, depth = shape.parent_list[node], shape.paths[node][-1], depths[node]
            if parent not in filled or depth > limit:
                continue
            if parent not in ranked:
                ends, prob = filled[parent]
                ranked[parent] = [
                    (token, prob * count / len(ends), following)
                    for token, count, following in self._children(ends, depth, widths[parent])
                ]
            if rank >= len(ranked[parent]) or ranked[parent][rank][1] < min_prob:
                continue
            token, prob, ends = ranked[parent][rank]
            filled[node] = (ends, prob)
            nodes.append(node)
            tokens.append(token)
            score += prob
        return nodes, tokens, score

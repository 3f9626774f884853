"""K policies: how many tokens to draft in each round, learned from the verdicts of earlier rounds.

The engine asks ``next_k()`` before each round and calls ``observe(drafted, accepted)`` after it; it caps the
answer by the tokens still allowed and the context left, so a policy never has to know about either.
"""

from __future__ import annotations

__all__ = ["AdditiveK", "ConstantK", "KPolicy"]


class KPolicy:
    """Chooses the draft length of each round and learns from the verdicts."""

    name = "policy"

    def next_k(self) -> int:
        """The number of tokens to draft in the next round (0: plain decoding)."""
        raise NotImplementedError

    def observe(self, drafted: int, accepted: int) -> None:
        """The last round drafted ``drafted`` tokens, of which ``accepted`` were accepted."""


class ConstantK(KPolicy):
    """Always the same draft length."""

    def __init__(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        self.k = k
        self.name = str(k)

    def next_k(self) -> int:
        return self.k


class AdditiveK(KPolicy):
    """k grows by 2 after a fully accepted draft and shrinks by 1 otherwise, within [k_min, k_max]."""

    name = "additive"

    def __init__(self, k_start: int = 4, k_min: int = 1, k_max: int = 16) -> None:
        if not (isinstance(k_min, int) and isinstance(k_max, int) and 1 <= k_min <= k_start <= k_max):
            raise ValueError(f"need 1 <= k_min <= k_start <= k_max, got {k_min}, {k_start}, {k_max}")
        self.k, self.k_min, self.k_max = k_start, k_min, k_max

    def next_k(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        step = 2 if accepted == drafted else -1
        self.k = max(self.k_min, min(self.k_max, self.k + step))

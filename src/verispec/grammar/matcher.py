"""A sequence's grammar state over llguidance's matcher (:class:`~verispec.grammar.rounds.GrammarState`).

The matcher holds the committed tokens and then the tentative path, but for an end-of-sequence token: that
one is checked against the mask and kept in the path, never given to the matcher (llguidance allows it again
after itself, and rolling back over it put the matcher's count of tokens out of step with the path: a draft
past the end then left the matcher inside the text), and nothing is allowed after it. Moving the path rolls
the matcher back (``rollback``) to the prefix the two paths share and consumes the rest, a token only where
the mask computed before it allows it (a token it does not allow would put the matcher in its error state for
good). The masks of the path's prefixes are kept until rolled back, so a chain's forced run and drafts compute
each once: a path that the tentative one begins with is answered from them without moving the matcher (a
round's masks asked again from its first position, after its forced run and drafts computed them).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from verispec.errors import UsageError
from verispec.grammar.constraint import CHECKED_START, Constraint, first_line
from verispec.grammar.rounds import forced_run
from verispec.grammar.tokens import llg_tokenizer

if TYPE_CHECKING:
    from verispec.models.base import SpelledTokenizer

__all__ = ["MatcherState", "start_state"]

_BITS = torch.arange(32, dtype=torch.int32)  # [32]


class MatcherState:
    """The state of one sequence under a compiled grammar: ``matcher`` an ``llguidance.LLMatcher`` made
    for this sequence alone, over a tokenizer of ``vocab_size`` tokens."""

    def __init__(self, matcher, vocab_size: int, eos: Collection[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._eos = frozenset(eos)  # the end-of-sequence tokens: nothing is allowed after one
        self._ended = False  # whether the committed tokens end with one
        self._path: list[int] = []  # the tentative tokens the matcher has consumed after the committed ones
        self._masks: list[Tensor] = []  # [V] bool each: the mask after the committed tokens and _path[:i]
        self._bitmask = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)  # [ceil(V / 32)]

    def mask_after(self, path: Sequence[int]) -> Tensor | None:
        shared = 0  # the tokens the tentative path and ``path`` begin with alike
        while shared < min(len(self._path), len(path)) and self._path[shared] == path[shared]:
            shared += 1
        if shared == len(path) < len(self._masks):  # a prefix of the tentative path: its mask is kept
            return self._masks[shared]
        self._rollback(shared)
        for token in path[len(self._path) :]:
            if not bool(self._mask()[token]):
                return None
            if token not in self._eos and not self.matcher.consume_token(token):
                return None
            self._path.append(token)
        return self._mask()

    def settle(self, tokens: Sequence[int]) -> None:
        if self.mask_after(tokens) is None:
            why = self._error() if self.matcher.is_error() else "a token it does not allow was committed"
            raise UsageError(f"the grammar failed: {why}")
        self._rollback(len(tokens))  # the matcher stands after ``tokens``, not after a longer tentative path
        self._ended = self._at_end()
        self._path, self._masks = [], self._masks[len(tokens) :]

    @property
    def finished(self) -> bool:
        return self._ended or bool(self.matcher.is_stopped())

    def _rollback(self, keep: int) -> None:
        """Keep the first ``keep`` tentative tokens."""
        if keep < len(self._path):
            self.matcher.rollback(sum(1 for t in self._path[keep:] if t not in self._eos))
            del self._path[keep:]
            del self._masks[keep + 1 :]

    def _mask(self) -> Tensor:
        """[V] bool, the matcher's mask where it stands (computed once per tentative prefix); nothing after
        an end-of-sequence token."""
        if len(self._masks) > len(self._path):
            return self._masks[len(self._path)]
        if self._at_end():
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)  # [V]
        else:
            self.matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
            if self.matcher.is_error():
                raise UsageError(f"the grammar failed: {self._error()}")
            bits = (self._bitmask.unsqueeze(1) >> _BITS) & 1  # [ceil(V / 32), 32]
            mask = bits.flatten()[: self.vocab_size].bool()  # [V]
        self._masks.append(mask)
        return mask

    def _at_end(self) -> bool:
        """Whether the matcher stands after an end-of-sequence token."""
        return self._path[-1] in self._eos if self._path else self._ended

    def _error(self) -> str:
        return self.matcher.get_error().strip().splitlines()[0]


def start_state(constraint: Constraint, tokenizer: SpelledTokenizer) -> MatcherState:
    """A fresh grammar state of ``constraint`` for one sequence of ``tokenizer``'s tokens, its start checked:
    :class:`~verispec.grammar.constraint.InvalidConstraint` when the grammar does not compile for it, allows
    no first token, or allows none after the tokens it forces from the start (up to
    :data:`~verispec.grammar.constraint.CHECKED_START` of them; their masks are kept for the first round). The
    first mask walks llguidance's lexer over the whole of a long forced value once (a 500 KB ``const``: about
    a second, in the caller's thread, not the engine's)."""
    import llguidance

    tokens = llg_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(tokens, constraint.grammar, log_level=0)
    if matcher.is_error():
        raise constraint.invalid(first_line(matcher.get_error()))
    state = MatcherState(matcher, tokens.vocab_size, tokenizer.eos_token_ids)
    try:
        start = forced_run(state, CHECKED_START)
        if len(start) < CHECKED_START and not (start and start[-1] in tokenizer.eos_token_ids):
            after = state.mask_after(start)  # None: a forced token it could not take (its limits)
            if after is None or not bool(after.any()):
                why = first_line(matcher.get_error()) if matcher.is_error() else "no token is allowed"
                raise UsageError(f"after its first {len(start)} tokens, {why}")
    except UsageError as err:
        raise constraint.invalid(f"no output can be made of it ({err})") from None
    return state

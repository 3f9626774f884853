"""llguidance's tokenizer made from a tokenizer's spelled tokens
(:class:`~verispec.models.base.SpelledTokenizer`), so that every tokenizer verispec loads (transformers,
llama2.c, GGUF) constrains alike, with its own end-of-sequence tokens; made once per tokenizer.

Special tokens (end and start of sequence, tokens spelled as no bytes, a transformers tokenizer's special
added tokens) are never text to a grammar. llguidance tokenizes the text a grammar forces with the
tokenizer's own ``encode`` where that spells the text exactly, else greedily by longest token (a
SentencePiece ``encode`` writes a leading space): its mask keeps that tokenization of forced text.

Forced text is tokenized by its first characters alone. At every mask inside a forced run llguidance asks for
the tokens of ALL the text forced from there (the rest of a ``const`` or ``enum`` value), makes the mask the
first of them, and looks at no more than the last two longest tokens' bytes of the list (it chops those that
the grammar might extend); so the whole rest of a 500 KB ``const`` was tokenized at every token (0.7 s each,
the engine waiting). A text longer than :attr:`_Wrapped.window` characters (four times the longest token's
bytes, at least 256) is answered with the tokens of its first ``window`` characters: the first token is the
one the whole text's tokenization begins with (a tokenization is decided within words, and a token's choice
hundreds of characters before the cut is not changed by it), the tail llguidance chops lies within those
characters, and the mask's cost no longer grows with the value (what the tokens' masks are is a function of
the text alone, so every path through the matcher, speculative or not, sees the same masks).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from verispec.errors import UsageError
from verispec.models.base import SpelledTokenizer

if TYPE_CHECKING:
    from llguidance import LLTokenizer

__all__ = ["llg_tokenizer"]

_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer → its LLTokenizer


@runtime_checkable
class MarksSpecialTokens(Protocol):
    """A tokenizer that names its special tokens (transformers' adapter)."""

    def special_token_ids(self) -> frozenset[int]: ...


class _Wrapped:
    """What ``llguidance.TokenizerWrapper`` reads: the tokens' bytes, the special ids, and text → ids."""

    def __init__(self, tokenizer: SpelledTokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokenizer.token_bytes()
        eos = sorted(tokenizer.eos_token_ids)
        if not eos:
            raise UsageError("constrained generation needs a tokenizer with an end-of-sequence token")
        self.eos_token_id = eos[0]
        self.bos_token_id = tokenizer.bos_token_id
        named = tokenizer.special_token_ids() if isinstance(tokenizer, MarksSpecialTokens) else frozenset()
        special = set(eos) | named | {i for i, b in enumerate(self.tokens) if not b}
        if tokenizer.bos_token_id is not None:
            special.add(tokenizer.bos_token_id)
        self.special_token_ids = sorted(special)
        self.greedy: LLTokenizer | None = None  # the LLTokenizer once made: its greedy tokenization
        self.window = max(256, 4 * max(map(len, self.tokens)))  # characters of forced text tokenized

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance asks with bytes first; text then
            raise TypeError("text only")
        text = text[: self.window]  # forced text: its first characters decide the mask (module docstring)
        ids = self.tokenizer.encode(text, add_bos=False)
        if b"".join(self.tokens[i] for i in ids) == text.encode():
            return ids
        assert self.greedy is not None
        return self.greedy.greedy_tokenize(text)


def llg_tokenizer(tokenizer: SpelledTokenizer) -> LLTokenizer:
    """The ``llguidance.LLTokenizer`` of ``tokenizer`` (made once per tokenizer object)."""
    made = _MADE.get(tokenizer)
    if made is None:
        import llguidance

        wrapped = _Wrapped(tokenizer)
        made = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(wrapped), eos_token=sorted(tokenizer.eos_token_ids)
        )
        wrapped.greedy = made
        _MADE[tokenizer] = made
    return made

"""Text as it is generated: incremental detokenization (:class:`TextAssembler`) and the :class:`Chunk` each
round hands a reader (its tokens, the text that became final with them, their log-probabilities)."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.engine.sequence import TokenLogprob
from verispec.models.base import Tokenizer

__all__ = ["STOP_REACH", "TEXT_WINDOW", "Chunk", "TextAssembler"]


@dataclass(frozen=True)
class Chunk:
    """What one round committed: its tokens, and the text that became final with them (possibly empty: text
    is held back until it is whole characters and cannot be the start of a stop string); ``logprobs``: each
    token's, when the request asks for them (see :meth:`verispec.api.Speculator.request`)."""

    text: str
    token_ids: list[int]
    logprobs: tuple[TokenLogprob, ...] = ()


TEXT_WINDOW = 8  # tokens decoded before the newest ones, so that a tokenizer's joins across them are seen
STOP_REACH = 64  # tokens (beyond a stop string's length) whose text a stop check searches


class TextAssembler:
    """Incremental detokenization: emits text only once it is final (whole UTF-8 characters, and not a
    possible beginning of a stop string), and cuts the text before a stop string.

    A step decodes only its newest tokens, after a window of :data:`TEXT_WINDOW` tokens before them, not the
    whole output: the text of the tokens before the window is kept (``kept``: the decoded ``ids[:anchor]``),
    and the window's own text is cut from the front of the decode. Where the decode of the window and the
    tokens after it does not begin with the window's text alone (a join the window cannot see), everything
    is decoded again. A stop check searches the text of the last tokens alone: the text before them held no
    stop string, or the sequence would have stopped there. With ``calls`` (the text that opens a tool call,
    where the output may make calls), stop strings are searched in the text before the first call opens
    alone: a call, and the calls after it, are never cut (once a call has opened, nothing is searched)."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: tuple[str, ...], calls: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.calls = calls
        self.opened = False  # a call has opened in the text: no stop string ends it any more
        self.ids: list[int] = []
        self.sent = 0  # characters already yielded
        self.anchor, self.kept, self.window = (
            0,
            "",
            "",
        )  # ids[:anchor] decode to kept; window: ids[w:anchor]'s

    def stop_check(self, new_ids: list[int]) -> int | None:
        """How many of ``new_ids`` to keep when a stop string appears in their text, else None."""
        if self.opened:
            return None
        reach = STOP_REACH + max(len(s) for s in self.stop_strings)
        last = self.tokenizer.decode(new_ids[-reach:])
        if not any(s in self._free(last) for s in self.stop_strings):
            self.opened = self.calls is not None and self.calls in last  # kept: committed, not cut
            return None
        return self._stop_keep(new_ids)

    def _stop_keep(self, new_ids: list[int]) -> int | None:
        """:meth:`stop_check` from the text of all of ``new_ids``."""
        if not any(s in self._free(self.tokenizer.decode(new_ids)) for s in self.stop_strings):
            return None
        keep = len(new_ids)
        while keep > 0 and any(
            s in self._free(self.tokenizer.decode(new_ids[: keep - 1])) for s in self.stop_strings
        ):
            keep -= 1
        return keep

    def _free(self, text: str) -> str:
        """The part of ``text`` stop strings are searched in: all of it, or what comes before a call opens."""
        return text if self.calls is None else text.split(self.calls, 1)[0]

    def _decoded(self, end: int) -> str:
        """The text of ``ids[:end]`` (end ≥ anchor), from the kept text and a decode of the window onwards."""
        whole = self.tokenizer.decode(self.ids[max(0, self.anchor - TEXT_WINDOW) : end])
        if whole.startswith(self.window):
            return self.kept + whole[len(self.window) :]
        return self.tokenizer.decode(self.ids[:end])

    def _text(self) -> str:
        text = self._decoded(len(self.ids))
        # keep the text of all but the newest tokens, up to the last of a few places where a character ends
        for anchor in range(
            len(self.ids) - TEXT_WINDOW, max(self.anchor, len(self.ids) - 2 * TEXT_WINDOW), -1
        ):
            kept = self._decoded(anchor)
            if text.startswith(kept) and not kept.endswith("\ufffd"):
                window = self.tokenizer.decode(self.ids[max(0, anchor - TEXT_WINDOW) : anchor])
                self.anchor, self.kept, self.window = anchor, kept, window
                break
        free = self._free(text)
        cuts = [free.find(s) for s in self.stop_strings if s in free]
        return text[: min(cuts)] if cuts else text

    def add(self, tokens: list[int]) -> str:
        self.ids += tokens
        text = self._text()
        final = len(text.rstrip("\ufffd"))
        calling = len(self._free(text[:final])) < final  # a call opened: no stop string cuts it
        for s in () if calling else self.stop_strings:  # hold back a tail that may grow into a stop string
            for n in range(min(len(s) - 1, final), 0, -1):
                if text[final - n : final] == s[:n]:
                    final -= n
                    break
        piece, self.sent = text[self.sent : max(final, self.sent)], max(final, self.sent)
        return piece

    def finish(self) -> str:
        text = self._text()
        piece, self.sent = text[self.sent :], len(text)
        return piece

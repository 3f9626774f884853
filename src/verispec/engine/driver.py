"""The one loop that runs the engine for every caller — a stream of one, a batch of prompts, the scheduler's
thread: admit → step → chunk.

A :class:`Driver` holds a :class:`~verispec.engine.engine.SpeculativeEngine` and, per admitted request, its
text assembler and its :class:`Sink`. Each :meth:`Driver.step` runs one engine step and hands every sequence's
committed tokens to its sink as a :class:`~verispec.text.Chunk`; a sequence that stops gets its last text and
then ``end(None)``. A failure is contained where it happens: a request that cannot be admitted, or whose own
part of a step (its proposal, verification, commit, text) raises, ends its sink with the error (logged too
with ``log_failures``: a server's) and the batch goes on; a failure the rows
share (the target's forward) ends the sinks of the batch, is logged here (a bug), and the engine is made
afresh for the next requests. Only what is not an ``Exception`` passes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from verispec.engine.engine import SpeculativeEngine
from verispec.engine.sequence import Request, Running, TokenLogprob
from verispec.errors import UsageError
from verispec.models.base import LanguageModel
from verispec.text import Chunk, TextAssembler

__all__ = ["Collected", "Driver", "Sink"]

_log = logging.getLogger("verispec.engine.driver")


class Sink(Protocol):
    """Where one request's output goes: its chunks in order, then ``end`` once (None, or the error)."""

    def chunk(self, chunk: Chunk) -> None: ...

    def end(self, error: BaseException | None) -> None: ...


@dataclass
class Collected:
    """A sink that keeps what it is given: the chunks not yet taken, the whole output, the error."""

    chunks: list[Chunk] = field(default_factory=list)  # not yet taken
    text: list[str] = field(default_factory=list)  # every chunk's text
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    ended: bool = False
    error: BaseException | None = None

    def chunk(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)
        self.text.append(chunk.text)
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs

    def end(self, error: BaseException | None) -> None:
        self.ended, self.error = True, error

    def take(self) -> Iterator[Chunk]:
        """The chunks given since the last take."""
        chunks, self.chunks = self.chunks, []
        yield from chunks


@dataclass
class _Live:
    running: Running
    text: TextAssembler
    sink: Sink


class Driver:
    """Runs an engine over ``model`` with ``slots`` sequences at once for requests that each have a sink."""

    def __init__(self, model: LanguageModel, slots: int = 1, log_failures: bool = False) -> None:
        self.model = model
        self.log_failures = log_failures  # a request's own internal error logged too (a server's)
        self.engine = SpeculativeEngine(model, slots=slots)
        self._live: dict[int, _Live] = {}  # id(Running) → its request's text and sink

    @property
    def free_slots(self) -> int:
        return self.engine.free_slots

    @property
    def live(self) -> int:
        """How many admitted requests have not ended."""
        return len(self._live)

    def admitted(self) -> list[tuple[Running, Sink]]:
        """Each admitted request that has not ended, with its sink."""
        return [(live.running, live.sink) for live in self._live.values()]

    def admit(self, request: Request, text: TextAssembler, sink: Sink) -> Running | None:
        """``request`` into a free slot, its output to ``sink``; None (the sink ended with the error) when it
        cannot be admitted."""
        try:
            running = self.engine.submit(request)
        except Exception as err:  # this request alone
            self._failed(sink, err)
            return None
        self._live[id(running)] = _Live(running, text, sink)
        return running

    def cancel(self, running: Running) -> None:
        """Stop ``running`` now (its stop reason "cancelled"): its sink gets the text so far and ends."""
        self.engine.cancel(running)
        live = self._live.pop(id(running), None)
        if live is not None:
            self._finish(live)

    def close(self) -> None:
        """Cancel every request still running."""
        for live in list(self._live.values()):
            self.cancel(live.running)

    def step(self) -> None:
        """One engine step for every admitted request, its tokens to its sink (nothing when none is)."""
        if not self._live:
            return
        try:
            stepped = self.engine.step()
        except Exception as err:  # what the rows share failed: those in the batch fail, the next ones run
            _log.error("an engine step failed, and its %d requests", len(self._live), exc_info=err)
            lives = list(self._live.values())
            self._live.clear()
            self.engine = SpeculativeEngine(self.model, slots=self.engine.slots)
            for live in lives:
                live.sink.end(err)
            return
        for running, tokens in stepped:
            found = self._live.get(id(running))
            if found is None:
                continue
            live = found
            try:
                if running.error is not None:
                    raise running.error
                if tokens:
                    chunk = Chunk(live.text.add(tokens), tokens, running.last_logprobs(len(tokens)))
                    live.sink.chunk(chunk)
            except Exception as err:  # this request alone
                self.engine.cancel(running)
                del self._live[id(running)]
                self._failed(live.sink, err)
                continue
            if running.done:
                del self._live[id(running)]
                self._finish(live)

    def _finish(self, live: _Live) -> None:
        try:
            tail = live.text.finish()
            if tail:
                live.sink.chunk(Chunk(tail, []))
        except Exception as err:  # this request alone
            self._failed(live.sink, err)
            return
        live.sink.end(None)

    def _failed(self, sink: Sink, error: Exception) -> None:
        if self.log_failures and not isinstance(error, UsageError):
            _log.error("a request failed: %s", type(error).__name__, exc_info=error)
        sink.end(error)

"""Continuous batching for many threads: a :class:`Scheduler` runs a speculator's engine in a thread of its
own; any thread submits requests and reads each one's committed tokens as they come.

Requests wait in a bounded queue (``max_queue``; a full queue refuses at once with :class:`QueueFull`) and
join the batch between steps as slots free; a request leaves as soon as it stops, or at the next step after
:meth:`Handle.cancel`, and its slot takes the next waiting request. Only the scheduler's thread touches the
engine; the others exchange requests and tokens with it through locks and queues, so a caller never blocks
another's step. What a request gets is what :meth:`verispec.api.Speculator.generate` gives it alone.

A failure while serving one request fails that request alone: its handle ends with the error (re-raised to
its reader) and the batch goes on. A failure the requests share (the target's forward) fails the requests in
the batch, and the engine is made afresh for the next ones. Should the worker itself ever die, it says so: the
failure is logged with its traceback, every request waiting or running ends with it, :attr:`Scheduler.failure`
holds it (a server's /health answers 503) and :meth:`Scheduler.submit` refuses at once with
:class:`SchedulerFailed`, never queueing a request that nobody would serve.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, cast

from verispec.engine.driver import Driver
from verispec.engine.sequence import GenerationStats, Request
from verispec.errors import UsageError
from verispec.inputs import check_int

if TYPE_CHECKING:
    from verispec.api import Speculator
    from verispec.drafting.suffix_cache import SuffixCache
    from verispec.options import GenerationOptions
    from verispec.text import Chunk, TextAssembler

__all__ = ["Handle", "QueueFull", "Scheduler", "SchedulerFailed"]

_log = logging.getLogger("verispec.engine.scheduler")


class QueueFull(UsageError):
    """Every slot is busy and the queue is full: try again later (a server's 429)."""


class SchedulerFailed(RuntimeError):
    """The scheduler's worker has died (a bug, logged with its traceback): nothing more can be served (a
    server's 503)."""


class Handle:
    """One submitted request, and the :class:`~verispec.engine.driver.Sink` of its output. Iterating it yields
    its :class:`~verispec.text.Chunk`\\ s as they are committed (blocking), ending when it stops; ``stats``
    fills in as it goes; :meth:`cancel` stops it. With a ``listener``, each chunk is handed to it instead, in
    the scheduler's thread, and then None at the end (an event loop's reader: ``loop.call_soon_threadsafe``);
    such a handle is not iterated."""

    def __init__(
        self,
        stats: GenerationStats,
        listener: Callable[[Chunk | None], object] | None = None,
        prompt_tokens: int = 0,
    ) -> None:
        self.stats = stats
        self.prompt_tokens = prompt_tokens
        self._listener = listener
        self._chunks: queue.Queue[Chunk | None] = queue.Queue()  # None: the end
        self._cancelled = threading.Event()
        self.error: BaseException | None = None  # why it failed, re-raised to the reader
        self.finished = threading.Event()

    def __iter__(self) -> Iterator[Chunk]:
        if self._listener is not None:
            raise UsageError("this handle hands its chunks to its listener")
        while (item := self._chunks.get()) is not None:
            yield item
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """Stop this request: it leaves the batch at the next step (its stop reason "cancelled")."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def chunk(self, chunk: Chunk) -> None:
        self._put(chunk)

    def end(self, error: BaseException | None) -> None:
        self.error = error
        self.finished.set()
        self._put(None)

    def _put(self, item: Chunk | None) -> None:
        if self._listener is None:
            self._chunks.put(item)
        else:
            self._listener(item)


class Scheduler:
    """Serves ``speculator`` to many threads: up to ``slots`` sequences decoded together, up to
    ``max_queue`` more waiting. Use as a context manager, or :meth:`close` it."""

    def __init__(self, speculator: Speculator, slots: int = 8, max_queue: int = 64) -> None:
        check_int(slots, "slots", 1)
        check_int(max_queue, "max_queue", 0)
        self.speculator = speculator
        self.driver = Driver(speculator.model, slots=slots, log_failures=True)
        self.max_queue = max_queue
        self._waiting: deque[tuple[Handle, Request, TextAssembler]] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self.failure: BaseException | None = None  # what killed the worker, if anything did
        self._thread = threading.Thread(target=self._loop, name="verispec-scheduler", daemon=True)
        self._thread.start()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return self.driver.live

    def submit(
        self,
        prompt: str | Sequence[Mapping[str, str]],
        options: GenerationOptions,
        *,
        speculator: Speculator | None = None,
        listener: Callable[[Chunk | None], object] | None = None,
        suffix_cache: SuffixCache | None = None,
        within_context: bool = False,
    ) -> Handle:
        """Queue a generation of ``prompt`` with ``options`` and return its handle at once: by
        ``speculator`` (another drafter over this scheduler's target; default the scheduler's own), its
        chunks to ``listener`` if given (see :class:`Handle`), a suffix drafter drafting from
        ``suffix_cache`` (a server tenant's; default the speculator's own). UsageError for a bad request (with
        ``within_context``, also for ``max_new_tokens`` beyond what the context leaves after the prompt,
        as OpenAI's API refuses such a ``max_tokens``; else generation stops at the context),
        :class:`QueueFull` when every slot is busy and ``max_queue`` requests already wait,
        :class:`SchedulerFailed` once the worker has died."""
        speculator = speculator or self.speculator
        if speculator.model is not self.speculator.model:
            raise UsageError("a request's speculator must share the scheduler's target model")
        request, text = speculator.request(prompt, options, suffix_cache=suffix_cache)  # a bad one fails here
        context, length = speculator.model.max_context, len(request.prompt)
        if length >= context:
            raise UsageError(f"the prompt has {length} tokens; the context holds {context}")
        if within_context and options.max_new_tokens > context - length:
            raise UsageError(
                f"{options.max_new_tokens} new tokens do not fit: the context holds {context} tokens and the "
                f"prompt has {length}, leaving {context - length}"
            )
        handle = Handle(request.stats, listener, len(request.prompt))
        with self._wake:
            if self.failure is not None:
                raise SchedulerFailed(f"the scheduler has failed ({type(self.failure).__name__}): restart it")
            if self._closed:
                raise UsageError("the scheduler is closed")
            if self.driver.live + len(self._waiting) >= self.driver.engine.slots + self.max_queue:
                slots = self.driver.engine.slots
                raise QueueFull(f"{slots} requests running and {self.max_queue} waiting: try again later")
            self._waiting.append((handle, request, text))
            self._wake.notify()
        return handle

    def close(self) -> None:
        """Stop the worker: running and waiting requests end as cancelled."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    # ------------------------------------------------------------------ the worker

    def _loop(self) -> None:
        try:
            while self._serve_once():
                pass
        except BaseException as err:  # a bug in the worker itself: said, and every request learns of it
            with self._wake:
                self.failure = err
                running = [cast(Handle, sink) for _, sink in self.driver.admitted()]
                handles = [*running, *(h for h, _, _ in self._waiting)]
                self._waiting.clear()
            _log.critical("the scheduler's worker died: nothing more is served", exc_info=err)
            for handle in handles:
                if not handle.finished.is_set():
                    handle.end(err)
            return
        self.driver.close()
        for handle, _, _ in self._waiting:
            handle.stats.stop_reason = "cancelled"
            handle.end(None)
        self._waiting.clear()

    def _serve_once(self) -> bool:
        """Admit what waits, run one engine step and hand out its tokens; False once closed."""
        with self._wake:
            while not self._closed and not self._waiting and not self.driver.live:
                self._wake.wait()
            if self._closed:
                return False
            admitted: list[tuple[Handle, Request, TextAssembler]] = []
            while self._waiting and len(admitted) < self.driver.free_slots:
                admitted.append(self._waiting.popleft())
        for handle, request, text in admitted:
            if handle.cancelled:
                handle.stats.stop_reason = "cancelled"
                handle.end(None)
                continue
            self.driver.admit(request, text, handle)
        for running, sink in self.driver.admitted():
            if cast(Handle, sink).cancelled:
                self.driver.cancel(running)
        self.driver.step()
        return True

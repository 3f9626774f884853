"""``verispec serve``: the OpenAI API over the batched engine (Starlette, uvicorn, server-sent events).

One :class:`Server` holds the loaded target, a :class:`~verispec.api.Speculator` per drafter asked for (all
over that one target), the :class:`~verispec.engine.scheduler.Scheduler` whose thread runs the engine, and the
metrics. The event loop never waits on the engine: a request is submitted from a worker thread (its prompt
is tokenized there) and its chunks come back through ``loop.call_soon_threadsafe``. A client that goes away
cancels its request, which leaves the batch at the next step. Every refusal is OpenAI's error object with
one message; an unexpected failure is a 500 whose traceback goes to the log, the client sees one line. With
tools, the calls are read from the text as it comes (:class:`~verispec.grammar.tools.CallReader`): a whole
answer's ``message.tool_calls``, or streamed as OpenAI streams them (a call's id, type and name with empty
arguments, then deltas of its arguments).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics``. With an API key, the ``/v1`` routes need ``Authorization: Bearer KEY``
(the scheme in any case, as HTTP has it).

Bounded by design: a request's failure is its own (a 400 for the caller's mistake, a 500 naming an internal
error, the batch going on; /health says 503 if the scheduler ever dies); a body must be JSON by Content-Type
(415), arrive within ``body_timeout`` (408) and weigh at most ``max_body`` bytes (413); a client that hangs up
while sending it is a 499. Connections are capped at ``max_connections`` (an idle one gives way to a new one),
a request's headers must arrive within ``header_timeout`` of the connection opening or the previous answer,
an idle keep-alive connection closes after ``keep_alive`` seconds; /metrics' label sets are bounded by
configuration (:mod:`verispec.server.metrics`); a repeated log line is written once per :data:`LOG_INTERVAL`
(:class:`OncePerInterval`). No request makes the server load anything: the drafters requests may choose
are the server's own and those ``allow_drafters`` names, each loaded and calibrated at start. What a request
asks for is bounded before it reaches the engine: ``k`` by :data:`~verispec.options.MAX_K`, ``top_k`` by
the vocabulary, a prompt by its bytes before it is tokenized (:meth:`Server.check_prompt_bytes`), a
``response_format`` by its grammar's start, checked when its state is made (a 400 naming it, before a
stream begins); a round scores at most :data:`~verispec.engine.engine.ROUND_TOKENS` of a sequence's tokens,
however long its grammar's forced run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import anyio.to_thread
import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from verispec.api import Speculator, failure_message
from verispec.drafting.registry import AUTO as AUTO_DRAFTER
from verispec.drafting.registry import DRAFTERS
from verispec.drafting.suffix_cache import tokenizer_identity
from verispec.engine.scheduler import Handle, QueueFull, Scheduler, SchedulerFailed
from verispec.engine.sequence import TokenLogprob
from verispec.errors import UsageError
from verispec.grammar.constraint import InvalidConstraint
from verispec.grammar.tools import CallReader, ToolCall, read_calls
from verispec.inputs import parse_json
from verispec.models.base import LanguageModel, SpelledTokenizer, Tokenizer
from verispec.options import DraftLength, GenerationOptions
from verispec.resolve import Target
from verispec.server.config import ServerConfig, listen, return_large_frees
from verispec.server.metrics import ServerMetrics
from verispec.server.schema import (
    ApiError,
    ApiRequest,
    ChatRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    error_body,
    finish_reason,
    new_id,
    parse_request,
    refused_format,
    speculation,
    spelling,
    usage,
)
from verispec.text import Chunk

__all__ = ["OncePerInterval", "Server", "ServerConfig", "create_app", "listen", "run", "serving"]

_log = logging.getLogger("verispec.server")
LOG_INTERVAL = 60.0  # seconds: a repeated log line is written once per interval
UNKNOWN_ROUTE = "other"  # /metrics' label of every path that is not a route
SHRINK = 4  # the most a tokenizer's normalization shortens text's UTF-8 (a 4-byte letter to 1 byte: NFKC)


class OncePerInterval(logging.Filter):
    """A logging filter that lets a repeated record through once per ``interval`` seconds (repeated: the
    same logger, message and exception type), the next one through saying how many were held back; added to
    the loggers a flood can fill (accept errors when file descriptors run out, failing requests)."""

    LOGGERS = ("asyncio", "uvicorn.error", "verispec.server", "verispec.engine.scheduler")
    KEYS = 1024  # distinct messages remembered (forgotten all at once beyond)

    def __init__(self, interval: float = LOG_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval, self.clock = interval, clock
        self._held: dict[
            tuple[object, ...], list[Any]
        ] = {}  # key → [when it may pass again, records held back since]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = record.exc_info[0] if record.exc_info else None
        key = (record.name, str(record.msg), kind)
        now = self.clock()
        with self._lock:
            entry = self._held.get(key)
            if entry is not None and now < entry[0]:
                entry[1] += 1
                return False
            if len(self._held) >= self.KEYS:
                self._held.clear()
            self._held[key] = [now + self.interval, 0]
        if entry is not None and entry[1]:
            record.msg = f"{record.msg} [{entry[1]} more like it held back in {self.interval:g} s]"
        return True

    @classmethod
    def install(cls) -> None:
        """One filter on each of :attr:`LOGGERS` (once per process)."""
        for name in cls.LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, cls) for f in logger.filters):
                logger.addFilter(cls())


class Server:
    """The state behind the app. ``loaded``: a target already in memory (model, tokenizer) to serve instead
    of loading ``config.target``. Every drafter requests may choose is loaded (and, with ``--k auto``,
    calibrated) here, before the first request."""

    def __init__(self, config: ServerConfig, loaded: tuple[LanguageModel, Tokenizer] | None = None) -> None:
        return_large_frees()  # one request's transient buffers not kept by the process
        self.config = config
        self.name = config.served_name
        choice = dataclasses.replace(config, suffix_cache_file=None)  # the tenants' caches instead
        target = Target.load(choice) if loaded is None else Target(*loaded, choice, config.target)
        self.default = Speculator.on(target)
        self.tenants = config.tenants()
        self.tenants.open(tokenizer_identity(self.default.tokenizer))
        self.default.k_policy(config.k)  # calibrates now (with --k auto), not in a client's request
        self._speculators = {self.default.drafter_name: self.default}
        for name in config.allow_drafters:
            if name not in self._speculators:
                self._speculators[name] = made = Speculator.on(
                    target, drafter=name, drafter_path=config.drafter_path if DRAFTERS[name].learned else None
                )
                made.k_policy(config.k)
        self.spell = spelling(self.default.tokenizer)  # each token's bytes, for log-probabilities
        self.default.prepare_constraints()  # not in the first constrained request (its memory and wait)
        self.prompt_bytes = self._prompt_bytes()
        self.scheduler = Scheduler(self.default, slots=config.max_batch, max_queue=config.max_queue)
        self.metrics = ServerMetrics(
            lambda: self.scheduler.running,
            lambda: self.scheduler.queue_depth,
            None if config.api_keys else self.tenants.stats,  # the tenants' figures: told to nobody
        )

    def speculator(self, drafter: str | None) -> Speculator:
        """The speculator of a request's drafter: the server's own by default, else one ``allow_drafters``
        names (loaded at start); ApiError 400 naming those for any other."""
        name = self.default.drafter_name if drafter in (None, AUTO_DRAFTER) else drafter
        if name not in self._speculators:
            allowed = ", ".join([AUTO_DRAFTER, *self._speculators])
            raise ApiError(
                400,
                f"drafter {name[:40]!r} is not served here; choose from {allowed} (the server's operator "
                "allows more with --allow-drafters)",
                param="drafter",
            )
        return self._speculators[name]

    def _prompt_bytes(self) -> int | None:
        """The most UTF-8 bytes of prompt text that can fit the context (None: no bound known): a token
        spells at most the tokenizer's longest token's bytes of its normalized text, and normalization
        shortens text at most :data:`SHRINK` times, so a text of more bytes than the context's tokens can
        spell that way is certainly too long. A tokenizer that deletes text as it normalizes (some collapse
        runs of spaces) is beyond this bound: byte-level BPE (GGUF files, SmolLM2, Llama 3), llama2.c's and
        the SentencePiece tokenizers of Llama and Gemma delete nothing."""
        tokenizer = self.default.tokenizer
        if not isinstance(tokenizer, SpelledTokenizer):
            return None
        longest = max(map(len, tokenizer.token_bytes()))
        return self.default.model.max_context * longest * SHRINK

    def check_prompt_bytes(self, prompt: str | list[int] | list[dict[str, Any]]) -> None:
        """ApiError 400 for a prompt (text, or a conversation's messages) of more bytes than the context can
        hold whatever its tokens (:meth:`_prompt_bytes`), before it is tokenized (a 3.9 MB prompt took
        3.5-6 s of CPU to tokenize, then was refused); token ids are counted as they are, later."""
        if self.prompt_bytes is None or not prompt or isinstance(prompt[0], int):
            return
        texts = [prompt] if isinstance(prompt, str) else [t for m in prompt for t in _texts(m)]  # type: ignore[arg-type]
        size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
        if size > self.prompt_bytes:
            context = self.default.model.max_context
            raise ApiError(400, f"the prompt has {size} bytes, more than {context} tokens can spell: the "
                                f"context holds {context} tokens")  # fmt: skip

    def close(self) -> None:
        """Stop the scheduler, then save the tenants' suffix caches."""
        self.scheduler.close()
        self.tenants.save()


def create_app(server: Server) -> Starlette:
    """The ASGI app of ``server`` (closed with the app's lifespan)."""
    api = _Api(server)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        server.close()

    routes = [
        Route(path, api.guarded(endpoint), methods=methods)
        for path, endpoint, methods in (
            ("/health", api.health, None),
            ("/metrics", api.metrics_page, None),
            ("/v1/models", api.models, None),
            ("/v1/completions", api.completions, ["POST"]),
            ("/v1/chat/completions", api.chat, ["POST"]),
        )
    ]
    api.known = {route.path for route in routes}
    handlers = {ApiError: api.refused, HTTPException: api.http_error}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


class _Api:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.metrics = server.metrics
        self.known: set[str] = set()  # the routes' paths: /metrics' labels

    def route(self, request: Request) -> str:
        """/metrics' label of a request: its route, or one label for every other path."""
        path = request.url.path
        return path if path in self.known else UNKNOWN_ROUTE

    def guarded(
        self, endpoint: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """``endpoint``, its unexpected failures a 500 naming an internal error (logged once per interval),
        not Starlette's error page and a second traceback from the server."""

        async def run(request: Request) -> Response:
            try:
                return await endpoint(request)
            except (ApiError, HTTPException):
                raise
            except Exception as err:
                _log.error("internal error serving %s", self.route(request), exc_info=err)
                raise ApiError(500, failure_message(err), "server_error") from None

        return run

    # ------------------------------------------------------------------ plain routes

    async def health(self, request: Request) -> Response:
        failure = self.server.scheduler.failure
        if failure is not None:  # the worker died: nothing is served, and a balancer should know
            message = f"the scheduler has failed ({type(failure).__name__}): restart the server"
            return JSONResponse({"status": "failed", "error": message}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.server.name})

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        model = {"id": self.server.name, "object": "model", "created": 0, "owned_by": "verispec"}
        return JSONResponse({"object": "list", "data": [model]})

    # ------------------------------------------------------------------ errors

    async def refused(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, ApiError)
        self.metrics.requests.labels(self.route(request), str(error.status)).inc()
        # ASCII JSON: a message may quote a caller's string, lone surrogates and all
        body = json.dumps(error_body(error))
        return Response(body, status_code=error.status, media_type="application/json")

    async def http_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        return await self.refused(
            request, ApiError(error.status_code, str(error.detail), "invalid_request_error")
        )

    def _authorize(self, request: Request) -> str | None:
        """The key the request gave (its tenant), None on a server without keys; 401 otherwise."""
        keys = self.server.config.api_keys
        if not keys:
            return None
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        given = credentials.lstrip(" ").encode() if scheme.lower() == "bearer" else b""  # RFC 9110: any case
        matched = [key for key in keys if hmac.compare_digest(given, key.encode())]  # every key compared
        if not matched:
            raise ApiError(
                401, "a missing or wrong API key (Authorization: Bearer KEY)", "authentication_error"
            )
        return matched[0]

    # ------------------------------------------------------------------ generation

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _body(self, request: Request) -> object:
        """The request's JSON body: 415 when not JSON by its Content-Type, 413 beyond ``max_body`` bytes, 408
        when slower than ``body_timeout``, 499 when the client hangs up first, 400 when not valid JSON."""
        config = self.server.config
        kind = request.headers.get("content-type", "")
        media = kind.split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise ApiError(415, f"the body must be JSON (Content-Type: application/json), not {kind[:60]!r}")
        declared = request.headers.get("content-length", "")
        too_big = ApiError(413, f"the body is larger than {config.max_body} bytes")
        if declared.isascii() and declared.isdigit() and int(declared[:20]) > config.max_body:
            raise too_big
        parts, size = [], 0
        try:
            async with asyncio.timeout(config.body_timeout):
                async for part in request.stream():
                    size += len(part)
                    if size > config.max_body:
                        raise too_big
                    parts.append(part)
        except TimeoutError:
            raise ApiError(408, f"the body took longer than {config.body_timeout:g} s to arrive") from None
        except ClientDisconnect:
            raise ApiError(499, "the client hung up while sending the body") from None
        try:
            return parse_json(b"".join(parts))
        except UsageError as err:
            raise ApiError(400, f"the body is {err}") from None

    async def _generate(self, request: Request, chat: bool) -> Response:
        key = self._authorize(request)
        body = await self._body(request)
        parsed = parse_request(ChatRequest if chat else CompletionRequest, body)
        if parsed.model != self.server.name:
            raise ApiError(
                404,
                f"the model {parsed.model!r} does not exist here: this server serves {self.server.name!r}",
                "not_found_error",
                "model",
            )
        limit = parsed.limit
        prompt = parsed.conversation if isinstance(parsed, ChatRequest) else parsed.one_prompt  # type: ignore[attr-defined]
        self.server.check_prompt_bytes(prompt)
        options = self._options(parsed, chat)
        tools = options.tools
        loop, chunks = asyncio.get_running_loop(), asyncio.Queue[Chunk | None]()

        speculator = self.server.speculator(parsed.drafter)

        def submit() -> Handle:
            listener = lambda item: loop.call_soon_threadsafe(chunks.put_nowait, item)  # noqa: E731
            cache = self.server.tenants.cache(key) if speculator.kind.shared_cache else None  # the tenant's
            try:
                return self.server.scheduler.submit(
                    prompt,
                    options,
                    speculator=speculator,
                    listener=listener,
                    suffix_cache=cache,
                    within_context=limit is not None,  # a client's max_tokens must fit; none: to the end
                )
            except QueueFull as err:
                raise ApiError(429, str(err), "rate_limit_error") from None
            except SchedulerFailed as err:
                raise ApiError(503, str(err), "server_error") from None
            except InvalidConstraint as err:  # its grammar cannot start: before anything streams
                if tools is not None:
                    raise ApiError(400, f"tools: {err}", param="tools") from None
                raise refused_format(err) from None
            except UsageError as err:
                raise ApiError(400, str(err)) from None

        started = time.perf_counter()
        handle = await anyio.to_thread.run_sync(submit)
        reading = tools is not None and tools.constraint is not None  # calls to read from the text
        reply = _Reply(self.server, chat, handle, started, parsed.alternatives is not None, reading)
        if parsed.stream:
            return StreamingResponse(
                self._stream(request, reply, chunks, parsed.include_usage), media_type="text/event-stream"
            )
        return await self._whole(request, reply, chunks)

    def _options(self, parsed: ApiRequest, chat: bool) -> GenerationOptions:
        """What a parsed request asks for (its k at most :data:`~verispec.options.MAX_K`, its top_k at most
        the vocabulary, its schema and tools compiled); ApiError 400 naming what is wrong."""
        try:
            k = self.server.config.k if parsed.k is None else DraftLength.parse(parsed.k)  # parsed once, here
        except UsageError as err:
            raise ApiError(400, str(err), param="k") from None
        vocabulary = self.server.default.model.vocab_size
        if parsed.top_k > vocabulary:
            raise ApiError(400, f"top_k must be at most {vocabulary}, the vocabulary's size (0 keeps all)",
                           param="top_k")  # fmt: skip
        structure = parsed.response_format
        constraint = None if structure is None else structure.constraint()  # a bad schema: 400
        tools = parsed.tool_spec() if isinstance(parsed, ChatRequest) else None  # bad tools: 400
        try:
            return GenerationOptions(
                k=k,
                max_new_tokens=parsed.limit or (self.server.default.model.max_context if chat else 16),
                sampling=parsed.sampling(),
                chat=chat,
                stop=parsed.stops,
                logprobs=parsed.alternatives,
                constraint=constraint,
                tools=tools,
            )
        except UsageError as err:
            raise ApiError(400, str(err)) from None

    async def _whole(self, request: Request, reply: _Reply, chunks: asyncio.Queue[Chunk | None]) -> Response:
        """The non-streamed answer; cancelled if the client goes away first."""
        collector = asyncio.ensure_future(self._collect(reply, chunks))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if collector not in done:  # the client left: nobody reads the answer
            reply.handle.cancel()
            collector.cancel()
            self._finished(request, reply, 499)
            return Response(status_code=499)
        text, logprobs = collector.result()
        self._finished(request, reply, 200)
        return JSONResponse(reply.whole(text, logprobs))

    async def _collect(
        self, reply: _Reply, chunks: asyncio.Queue[Chunk | None]
    ) -> tuple[str, list[TokenLogprob]]:
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        while (chunk := await chunks.get()) is not None:
            reply.arrived(chunk, self.metrics)
            parts.append(chunk.text)
            logprobs += chunk.logprobs
        reply.check()
        return "".join(parts), logprobs

    async def _stream(
        self, request: Request, reply: _Reply, chunks: asyncio.Queue[Chunk | None], include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: OpenAI's chunks, then ``[DONE]``; a client that leaves cancels the request."""
        status = 499
        try:
            if reply.chat:
                yield _event(reply.chunk({"role": "assistant", "content": ""}))
            while (chunk := await chunks.get()) is not None:
                reply.arrived(chunk, self.metrics)
                for piece in reply.pieces(chunk.text, chunk.logprobs):
                    yield _event(piece)
            reply.check()
            for piece in reply.pieces(None):
                yield _event(piece)
            yield _event(reply.chunk(None, final=True))
            if include_usage:  # the last chunk carries usage and the verispec object, as a whole answer
                yield _event({**reply.head("chunk"), "choices": [], "usage": reply.usage(),
                              "verispec": speculation(reply.handle.stats)})  # fmt: skip
            yield "data: [DONE]\n\n"
            status = 200
        except ApiError as err:  # the request failed after its headers went out: an error event ends it
            status = err.status
            yield _event(error_body(err))
        finally:
            if not reply.handle.finished.is_set():
                reply.handle.cancel()
            self._finished(request, reply, status)

    def _finished(self, request: Request, reply: _Reply, status: int) -> None:
        self.metrics.requests.labels(self.route(request), str(status)).inc()
        self.metrics.finished(reply.handle.prompt_tokens, reply.handle.stats)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _texts(message: dict[str, Any]) -> list[str]:
    """A chat message's texts: its content and its calls' arguments."""
    return [
        message["content"] or "",
        *(call["function"]["arguments"] for call in message.get("tool_calls", ())),
    ]


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Reply:
    """One answer's ids and timing, and its OpenAI objects (with ``logprobs``: each token's)."""

    def __init__(
        self, server: Server, chat: bool, handle: Handle, started: float, logprobs: bool, calls: bool = False
    ) -> None:
        self.model, self.chat, self.handle, self.logprobs = server.name, chat, handle, logprobs
        self.reader = CallReader() if calls else None  # the calls read from the text as it streams
        self.calls: list[ToolCall] = []  # the calls made
        self.spell = server.spell
        self.id, self.created = new_id("chatcmpl" if chat else "cmpl")
        self.started = self.last = started
        self.tokens = 0
        self.offset = 0  # characters of the tokens' texts already answered: the next text_offset

    def arrived(self, chunk: Chunk, metrics: ServerMetrics) -> None:
        """Time a chunk: the first token's latency, then the gap per token."""
        n = len(chunk.token_ids)
        if not n:
            return
        now = time.perf_counter()
        if self.tokens == 0:
            metrics.ttft.observe(now - self.started)
        else:
            for _ in range(n):
                metrics.itl.observe((now - self.last) / n)
        self.tokens, self.last = self.tokens + n, now

    def check(self) -> None:
        """ApiError when the request failed: a 400 for a caller's mistake, else a 500 naming the internal
        error (logged by the scheduler)."""
        error = self.handle.error
        if error is not None:
            status, kind = (
                (400, "invalid_request_error") if isinstance(error, UsageError) else (500, "server_error")
            )
            raise ApiError(status, failure_message(error), kind)

    def head(self, what: str) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": f"{kind}.{what}" if self.chat and what else kind,
            "created": self.created,
            "model": self.model,
        }

    def usage(self) -> dict[str, Any]:
        return usage(self.handle.prompt_tokens, self.handle.stats)

    def logprob_object(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` of these tokens (the next ones answered), None when not asked for."""
        if not self.logprobs or not entries:
            return None
        if self.chat:
            return chat_logprobs(entries, self.spell)
        out = completion_logprobs(entries, self.spell, self.offset)
        self.offset += sum(len(token) for token in out["tokens"])
        return out

    def pieces(self, text: str | None, logprobs: Sequence[TokenLogprob] = ()) -> list[dict[str, Any]]:
        """The streamed chunks of more text (None: the text's end) and its tokens' logprobs: the text, or
        with calls to read, the content and the calls' deltas read from it so far (the logprobs with the
        first, or alone)."""
        if self.reader is None:
            return [self.chunk(text, logprobs=logprobs)] if text or logprobs else []
        read = self.reader.feed(text) if text is not None else self.reader.close()
        self.calls = self.reader.calls
        deltas = [{"content": p} if isinstance(p, str) else {"tool_calls": [p.as_dict()]} for p in read]
        if logprobs and not deltas:
            deltas = [{}]
        return [self.chunk(d, logprobs=logprobs if i == 0 else ()) for i, d in enumerate(deltas)]

    def chunk(
        self, content: str | dict[str, Any] | None, final: bool = False, logprobs: Sequence[TokenLogprob] = ()
    ) -> dict[str, Any]:
        """A streamed chunk: text (or a chat's delta) and its tokens' logprobs, or the last one with its
        finish reason."""
        reason = finish_reason(self.handle.stats, self.calls) if final else None
        lp = self.logprob_object(logprobs)
        if self.chat:
            delta = content if isinstance(content, dict) else {} if content is None else {"content": content}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": content or "", "logprobs": lp, "finish_reason": reason}
        out = {**self.head("chunk"), "choices": [choice]}
        return {**out, "verispec": speculation(self.handle.stats)} if final else out

    def whole(self, text: str, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        content: str | None = text
        if self.reader is not None:
            content, self.calls = read_calls(text)
        reason = finish_reason(self.handle.stats, self.calls)
        lp = self.logprob_object(logprobs)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self.calls:
                message["tool_calls"] = [call.as_dict() for call in self.calls]
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}
        return {
            **self.head(""),
            "choices": [choice],
            "usage": self.usage(),
            "verispec": speculation(self.handle.stats),
        }


# ---------------------------------------------------------------------------------------------- running it


def _protocol(limits: ServerConfig) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with what it lacks: at most ``max_connections`` open (at the cap, a new
    connection closes the oldest one still waiting for a request's headers, else itself) and a request's
    headers due within ``header_timeout`` seconds of the connection opening or of the previous answer."""

    class Bounded(H11Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            if len(self.connections) > limits.max_connections:
                oldest = next(iter(waiting), self)
                oldest._drop()
                if oldest is self:
                    return
            self._await_headers()

        def _await_headers(self) -> None:
            self._stop_waiting()
            waiting[self] = self.loop.call_later(limits.header_timeout, self._drop)

        def _stop_waiting(self) -> None:
            timer = waiting.pop(self, None)
            if timer is not None:
                timer.cancel()

        def _drop(self) -> None:
            self._stop_waiting()
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in
                self._stop_waiting()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

    waiting: dict[Bounded, asyncio.TimerHandle] = {}  # the connections waiting for headers, oldest first
    return Bounded


def _uvicorn(server: Server) -> uvicorn.Server:
    limits = server.config
    OncePerInterval.install()
    config = uvicorn.Config(
        create_app(server),
        http=_protocol(limits),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=limits.keep_alive,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=64 << 10,  # bytes of a request line and headers
    )
    return uvicorn.Server(config)


def run(server: Server, sock: socket.socket) -> None:
    """Serve on ``sock`` until Ctrl-C or SIGTERM (``verispec serve``), then shut down gracefully."""
    try:
        _uvicorn(server).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down for, once it has
        pass


@contextlib.contextmanager
def serving(server: Server, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> Iterator[str]:
    """Serve in a background thread while the block runs: yields the base URL (``http://host:port``); the
    server stops (and closes ``server``) on leaving the block, within ``timeout`` seconds."""
    sock = listen(host, port)
    runner = _uvicorn(server)
    thread = threading.Thread(
        target=runner.run, kwargs={"sockets": [sock]}, name="verispec-serve", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + timeout
    while not runner.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    address = sock.getsockname()
    try:
        yield f"http://{address[0]}:{address[1]}"
    finally:
        runner.should_exit = True
        thread.join(timeout)
        sock.close()

"""``verispec serve --ray``: N replicas of the server behind Ray Serve's HTTP proxy, on one machine or many.

Two deployments. Each :class:`Replica` holds one :class:`~verispec.server.app.Server` and runs its Starlette
app (:func:`~verispec.server.app.create_app`) on the requests handed to it, as ASGI (:func:`_asgi`): one
request path, the single server's, whatever serves it. The :class:`Ingress` (one, no model, no CPU reserved)
takes every HTTP request from Ray Serve's proxy, reads its body, names its affinity key
(:func:`affinity_key`: the API key's tenant, else the body's ``user`` or the ``X-Session-Id`` header, else a
hash of the conversation's first messages or of a prompt's start) and hands the request to a replica chosen
by :class:`AffinityRouter`: the replica that the key's rendezvous hash ranks first over the replicas alive
(so a conversation or a tenant comes back to the replica holding its prefix and suffix caches, and only the
keys of a replica that goes are moved), unless every slot of that replica is taken (its ``--max-batch``)
while another has one free, then the least loaded; a request without a key goes to the least loaded. The
answer streams back through the ingress with the replica's id in the ``X-Verispec-Replica`` header.

A replica that dies is replaced by Ray Serve (its model loaded again); the requests it was serving fail at
once with one message: a 503 where no byte was answered yet, else an error event ending the stream (the way
the single server ends a stream that fails). ``/metrics`` is every replica's, aggregated: each series with a
``replica`` label. The port is Ray Serve's proxy's (on every node with a replica: ``proxy_location``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from verispec.cores import use_threads
from verispec.errors import UsageError
from verispec.inputs import parse_json
from verispec.server.config import RayDeployment, ServerConfig
from verispec.server.schema import ApiError, error_body

__all__ = [
    "REPLICA_HEADER",
    "SESSION_HEADER",
    "AffinityRouter",
    "Ingress",
    "Replica",
    "affinity_key",
    "connect",
    "deploy",
    "kill_replica",
    "merge_metrics",
    "serve_on_ray",
]

_log = logging.getLogger("verispec.server")
APP = "verispec"  # the Serve application's name
REPLICA_HEADER = "x-verispec-replica"  # the id of the replica that answered
SESSION_HEADER = "x-session-id"  # a client's session: its requests' affinity key (after a tenant, a user)
PROMPT_START = 512  # characters (or token ids) of a completion's prompt that key it
FIRST_MESSAGES = 2  # messages of a conversation that key it (a system prompt and the first turn)
METRICS_TIMEOUT = 5.0  # seconds a replica has to answer /metrics before the page goes without it
HEADROOM = 8  # requests a replica takes beyond its batch and queue (/metrics, /health while it is full)
PIN = "replica:"  # a key naming one replica by its id (the ingress asking each for its /metrics)
Headers = list[tuple[bytes, bytes]]  # ASGI's: (name, value), the names lower case
DIED = "the replica serving this request died (Ray Serve is replacing it); send the request again"


def affinity_key(tenanted: bool, headers: Mapping[str, str], body: bytes) -> str | None:
    """The key that sends a request to the replica holding its caches (a digest; None: any replica, by load):
    the API key's (``tenanted``: the server has keys, each a tenant with its own suffix cache), else the
    body's ``user``, else the session header's, else the conversation's first :data:`FIRST_MESSAGES` messages
    or a completion prompt's first :data:`PROMPT_START` characters (a body that is not JSON: None)."""
    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    if tenanted and scheme.lower() == "bearer" and credentials.strip():
        return _digest("tenant", credentials.strip())
    try:
        parsed = parse_json(body) if body else None
    except UsageError:
        parsed = None
    fields = parsed if isinstance(parsed, dict) else {}
    if isinstance(fields.get("user"), str) and fields["user"]:
        return _digest("user", fields["user"])
    if headers.get(SESSION_HEADER):
        return _digest("session", headers[SESSION_HEADER])
    if isinstance(fields.get("messages"), list):
        return _digest("messages", fields["messages"][:FIRST_MESSAGES])
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: its first
    if isinstance(prompt, (str, list)) and prompt:
        return _digest("prompt", prompt[:PROMPT_START])
    return None


def _digest(kind: str, value: object) -> str:
    text = json.dumps([kind, value], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _rank(key: str, replica: str) -> bytes:
    """The rendezvous hash of a key on a replica: the replica of the highest rank serves the key."""
    return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()


# ---------------------------------------------------------------------------------------------- routing

ROUTERS: dict[str, AffinityRouter] = {}  # each application's router of its replicas, in the ingress's process


class AffinityRouter(RequestRouter):
    """Ray Serve's request router of the replicas (it runs in the ingress's process): a request's affinity key
    (its first argument) to the replica its rendezvous hash ranks first, unless all of that one's ``slots``
    are taken while another replica has one free (then by load, as keyless requests go); :data:`PIN` and a
    replica's id to that replica alone. Ray Serve copies this module into the ingress with the class (pickled
    by value): the functions and constants it uses are copies, this module's state is reached through an
    import at run time."""

    slots = 1  # requests a replica decodes at once (its --max-batch)

    def initialize_state(self, **kwargs: Any) -> None:
        import verispec.server.ray_serve as home  # this module itself, not the copy

        self.slots = int(kwargs.get("slots", 1))
        home.ROUTERS[self._deployment_id.app_name] = self  # the ingress lists the replicas through it

    def replica_ids(self) -> list[str]:
        return [replica.unique_id for replica in self.curr_replicas]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # none chosen: wait before trying again
        if isinstance(key, str) and key.startswith(PIN):
            return [[r for r in candidate_replicas if PIN + r.replica_id.unique_id == key]]
        if not isinstance(key, str) or len(candidate_replicas) < 2:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: _rank(key, r.replica_id.unique_id), reverse=True)
        loads = [self._replica_queue_len_cache.get(r.replica_id) or 0 for r in ranked]
        if loads[0] >= self.slots > min(loads):  # it would queue the request, another would decode it now
            return [candidate_replicas]
        return [ranked[:1], ranked[1:]]  # the second rank: its replica full (at max_ongoing_requests)


# ---------------------------------------------------------------------------------------------- replicas


class Replica:
    """A Ray Serve replica: one :class:`~verispec.server.app.Server` (its model loaded here, ``threads``
    threads) and its app, answering the requests the ingress hands it."""

    def __init__(self, config: ServerConfig, threads: int) -> None:
        use_threads(threads)
        from verispec.server.app import Server, create_app  # loads torch: in the replica's process only

        self.server = Server(config)
        self.app = create_app(self.server)
        self.id: str = serve.get_replica_context().replica_id.unique_id

    async def serve(
        self, key: str | None, method: str, path: str, query: bytes, headers: Headers,
        body: bytes,
    ) -> AsyncIterator[tuple[str, int, Headers, bytes] | bytes]:  # fmt: skip
        """The app's answer to a request: first (this replica's id, the status, the headers, the body's first
        part: a whole answer's all), then the body's other parts. ``key`` is the router's (unused here)."""
        start: tuple[str, int, Headers] | None = None
        async for message in _asgi(self.app, method, path, query, headers, body):
            if message["type"] == "http.response.start":
                start = self.id, int(message["status"]), list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                part = bytes(message.get("body", b""))
                if start is not None:
                    yield *start, part
                    start = None
                elif part:
                    yield part

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose scheduler has died (every request it would take
        refused) is unhealthy, and Ray Serve replaces it."""
        failure = self.server.scheduler.failure
        if failure is not None:
            raise RuntimeError(f"the scheduler has failed ({type(failure).__name__})")

    async def metrics(self, pin: str) -> str:
        """This replica's Prometheus exposition (``pin``: the router's)."""
        return self.server.metrics.exposition().decode()

    def __del__(self) -> None:  # Ray Serve's graceful stop of a replica
        server = getattr(self, "server", None)
        if server is not None:
            server.close()


async def _asgi(
    app: Callable[..., Awaitable[None]], method: str, path: str, query: bytes, headers: Headers, body: bytes
) -> AsyncIterator[MutableMapping[str, Any]]:
    """The ASGI messages ``app`` sends answering one HTTP request (its body whole); the request's client
    leaves (``http.disconnect``) when the answer is over or the caller stops reading it."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
        "root_path": "", "headers": headers, "client": None, "server": None,
    }  # fmt: skip
    sent: asyncio.Queue[MutableMapping[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
        await task  # its failure, if any, is the caller's
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 5.0)  # the app's own cleanup (a cancelled request) first
            except TimeoutError:
                task.cancel()


# ---------------------------------------------------------------------------------------------- ingress


class Ingress:
    """Ray Serve's ingress deployment: every HTTP request, its affinity key named, to a replica (through
    :class:`AffinityRouter`), the answer streamed back with the replica's id; ``/metrics`` aggregated."""

    def __init__(self, replicas: Any, config: ServerConfig) -> None:
        self.replicas, self.config = replicas, config

    async def __call__(self, request: Request) -> Response:
        try:
            if request.url.path == "/metrics":
                return await self._metrics()
            return await self._forward(request)
        except ApiError as err:
            return JSONResponse(error_body(err), status_code=err.status)

    async def _forward(self, request: Request) -> Response:
        body = await self._body(request)
        key = affinity_key(bool(self.config.api_keys), request.headers, body)
        headers = [(name.lower(), value) for name, value in request.headers.raw]
        stream = self.replicas.options(stream=True).serve.remote(
            key, request.method, request.url.path, request.url.query.encode(), headers, body
        )
        try:
            replica, status, answer_headers, first = await stream.__anext__()
        except Exception as err:
            stream.cancel()
            raise _failure(err) from None
        kept = {name.decode("latin-1"): value.decode("latin-1") for name, value in answer_headers
                if name.lower() not in (b"content-length", b"transfer-encoding")}  # fmt: skip
        events = kept.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(
            _rest(first, stream, events), status_code=status, headers={**kept, REPLICA_HEADER: replica}
        )

    async def _body(self, request: Request) -> bytes:
        """The request's body, at most ``max_body`` bytes within ``body_timeout`` seconds (as the single
        server reads it: 413, 408, 499)."""
        limit = self.config.max_body
        parts, size = [], 0
        try:
            async with asyncio.timeout(self.config.body_timeout):
                async for part in request.stream():
                    size += len(part)
                    if size > limit:
                        raise ApiError(413, f"the body is larger than {limit} bytes")
                    parts.append(part)
        except TimeoutError:
            raise ApiError(
                408, f"the body took longer than {self.config.body_timeout:g} s to arrive"
            ) from None
        except ClientDisconnect:
            raise ApiError(499, "the client hung up while sending the body") from None
        return b"".join(parts)

    async def _metrics(self) -> Response:
        router = ROUTERS.get(APP)
        replicas = router.replica_ids() if router is not None else []

        texts = {}
        for replica in replicas:  # one after the other: Ray Serve's router tells a request's calls apart by
            # the request's id, which they share
            answer = self.replicas.metrics.remote(PIN + replica)
            try:
                texts[replica] = await asyncio.wait_for(answer, METRICS_TIMEOUT)
            except Exception:  # gone or stuck: the page goes without it
                answer.cancel()
        page = merge_metrics(texts)
        return Response(page, media_type="text/plain; version=0.0.4; charset=utf-8")


async def _rest(first: bytes, stream: Any, events: bool) -> AsyncIterator[bytes]:
    """A replica's answer from its first part (a whole answer's all: nothing can cut it short); a replica
    that dies during a stream ends it with an error event."""
    try:
        yield first
        async for part in stream:
            yield part
    except Exception as err:
        if events:
            yield f"data: {json.dumps(error_body(_failure(err)))}\n\n".encode()
    finally:
        stream.cancel()


def _failure(err: Exception) -> ApiError:
    """A replica's failure as the client's one line: a replica dead or gone, a 503; Serve's queue full, a
    429; anything else a 500 (logged)."""
    from ray.serve.exceptions import BackPressureError, RequestCancelledError

    if isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return ApiError(503, DIED, "server_error")
    if isinstance(err, BackPressureError):
        return ApiError(429, "every replica's queue is full: retry later", "rate_limit_error")
    if isinstance(err, (RequestCancelledError, asyncio.CancelledError)):
        return ApiError(503, "the request was cancelled", "server_error")
    _log.error("internal error forwarding a request", exc_info=err)
    return ApiError(500, f"internal error ({type(err).__name__}); see the server's log", "server_error")


def kill_replica(replica: str) -> None:
    """Kill the replica of id ``replica`` (``X-Verispec-Replica``) of the application on the Ray cluster this
    process is in, else this machine's (:func:`connect`, ``auto``): what a replica's crash does, which Ray
    Serve answers by starting another (``bench-serve --kill-replica-at``)."""
    connect("auto")
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#Replica#{replica}", namespace="serve"))


def merge_metrics(texts: Mapping[str, str]) -> str:
    """The Prometheus expositions of replicas (by id) as one: each series labelled with its ``replica``."""
    from prometheus_client import generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            merged.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]

    class Merged:
        def collect(self) -> Sequence[Metric]:
            return list(families.values())

    return generate_latest(Merged()).decode()


# ---------------------------------------------------------------------------------------------- running it


def connect(address: str | None) -> bool:
    """Ray at ``address`` (None: a local Ray started here, unless one is already connected); whether it was
    started here. UsageError when it cannot be had (the command line has found the head's HOST:PORT
    answering)."""
    if ray.is_initialized():
        return False
    try:
        if address is None:
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise UsageError(f"cannot connect to Ray at {address}: {str(err).splitlines()[0]}") from None
    logging.getLogger("ray").setLevel(logging.WARNING)
    return True


def deploy(config: ServerConfig, deployment: RayDeployment, host: str, port: int) -> str:
    """Run ``deployment.replicas`` replicas of ``config``'s server and the ingress on the Ray connected,
    Serve's proxy on host:port; returns the base URL once every replica has loaded."""
    cpus = int(ray.cluster_resources().get("CPU", 1))  # type: ignore[no-untyped-call]
    threads = deployment.threads or max(1, cpus // deployment.replicas)
    serve.start(http_options={"host": host, "port": port, "keep_alive_timeout_s": config.keep_alive})
    replicas = serve.deployment(
        name="Replica",
        num_replicas=deployment.replicas,
        max_ongoing_requests=config.max_batch + config.max_queue + HEADROOM,
        ray_actor_options={
            "num_cpus": threads,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
        request_router_config=RequestRouterConfig(
            request_router_class=f"{__name__}.AffinityRouter",  # type: ignore[arg-type]
            request_router_kwargs={"slots": config.max_batch},
        ),
        health_check_period_s=2,
        health_check_timeout_s=10,
    )(Replica).bind(config, threads)
    ingress = serve.deployment(
        name="Ingress", num_replicas=1, max_ongoing_requests=1 << 16, ray_actor_options={"num_cpus": 0}
    )(Ingress).bind(replicas, config)
    serve.run(ingress, name=APP, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def serve_on_ray(config: ServerConfig, deployment: RayDeployment, host: str, port: int) -> int:
    """``verispec serve --ray``: deployed, then served until Ctrl-C (Serve shut down, and Ray where it was
    started here)."""
    started = connect(deployment.address)
    try:
        url = deploy(config, deployment, host, port)
        replicas = f"{deployment.replicas} replica{'s' if deployment.replicas > 1 else ''} on Ray Serve"
        print(f"verispec: serving {config.served_name} ({replicas}) on {url}/v1", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        if started:
            ray.shutdown()
    print("verispec: stopped", file=sys.stderr)
    return 0

"""``verispec bench-serve``: the server under load on loopback, then the batched engine alone on that work.

``verispec serve`` is started as a child process on a free port of 127.0.0.1. N clients, each in a thread of
this process, keep one streaming request each in flight for T seconds (the bench's task prompts that leave
room for ``max_tokens`` in the context, chats where the model has a template, greedy); every
``disconnect_every``-th request hangs up after its first token. Reported: completed requests, failures (a
status other than 200, a broken or unfinished stream: must be 0), deliberate disconnects and whether the
server freed every one (its batch empty at the end, and no more 499s counted than hang-ups: one that raced
its request's last token was answered whole), served tokens/s, time to first token and inter-token latency
p50/p99 (a chunk's gap shared by its tokens: a request's tokens over its chunks), and the server's resident
memory after its first request and at the end. The server is
then stopped, and the engine runs the same number of requests at the same concurrency in this process
(:mod:`verispec.bench.load`): the served tokens/s over that is what the HTTP layer costs.

With ``replicas`` (``--replicas N``), the server is ``verispec serve --ray --replicas N`` (a local Ray
started by it, each replica with ``threads`` threads): each client is a conversation of its own (its
``X-Session-Id``), so that affinity sends it to one replica; the answers' replica ids are counted, and the
memory sampled is the Ray driver's alone (the replicas are Ray's workers). Every run reports the share of
prompt tokens whose keys and values a slot still held (``cached_tokens``), which affinity is to keep. With
``kill_replica_at`` (``--kill-replica-at S``) the replica that answered most is killed S seconds into the run
(from this process, joined to the server's local Ray): the requests that fail with its death's one message
(a 503, or an error event ending a stream) are counted apart from failures, which must stay 0, and each
replica's answers after the kill are reported (a new id: Ray Serve's replacement).

A drafter with a cache shared across requests (``--drafter suffix``) is timed from the server's cache as the
one request that readied it left it; ``suffix-warm`` serves ``suffix`` and runs every prompt once through the
server before timing (and once through the engine before its run).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from verispec.bench.load import (
    LoadConfig,
    Prompt,
    _load_prompts,
    _percentile,
    _summary,
    _verispec_cell,
    ready_cache,
    run_clients,
)
from verispec.bench.workloads import WARM
from verispec.choice import DEFAULT_PRECISION
from verispec.errors import UsageError
from verispec.files import atomic_write
from verispec.inputs import check_int
from verispec.models.names import DEFAULT_MODEL

__all__ = ["ServeLoadConfig", "run_serve_load", "write_serve_report"]

_STARTUP = 600.0  # seconds a server may take to load its model and calibrate
_HANG_UPS = 10.0  # seconds the run's last hang-ups may take to free their slots, on a busy machine
_WARM_UP = 0.1  # the share of the run after which the server's memory counts as warmed up
_LISTENING = re.compile(r"on http://([^:]+):(\d+)/v1")


@dataclass(frozen=True)
class ServeLoadConfig:
    """What ``verispec bench-serve`` runs; validated with UsageError."""

    target: str = DEFAULT_MODEL
    tokenizer: str | None = None
    precision: str = DEFAULT_PRECISION
    drafter: str = "auto"
    k: str = "auto"
    clients: int = 8
    seconds: float = 30.0
    max_tokens: int = 64
    disconnect_every: int = 10  # every N-th request hangs up after its first token (0: none does)
    replicas: int = 0  # 0: verispec serve alone; N: verispec serve --ray --replicas N (docs/serve-ray.md)
    threads: int | None = None  # each replica's threads, with replicas (None: the machine's CPUs shared out)
    kill_replica_at: float | None = None  # seconds into the run when the busiest replica is killed
    engine: bool = True  # then the engine alone on the same work
    prompts: tuple[Prompt, ...] = ()  # default: the bench's task prompts
    out: str = ""

    def __post_init__(self) -> None:
        for name in ("clients", "max_tokens", "disconnect_every", "replicas"):
            value, low = getattr(self, name), 0 if name in ("disconnect_every", "replicas") else 1
            check_int(value, name.replace("_", "-"), low)
        seconds = self.seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
            raise UsageError(f"seconds must be a finite number > 0, got {self.seconds!r}")
        kill = self.kill_replica_at
        if kill is not None:
            if self.replicas < 2:
                raise UsageError("--kill-replica-at needs --replicas 2 or more: the others answer meanwhile")
            if isinstance(kill, bool) or not isinstance(kill, (int, float)) or not 0 < kill < seconds:
                within = f"a number of seconds in (0, {seconds:g})"
                raise UsageError(f"--kill-replica-at must be {within}, got {kill!r}")


class _Child:
    """``verispec serve`` in a child process on a free loopback port."""

    def __init__(self, config: ServeLoadConfig) -> None:
        argv = [sys.executable, "-m", "verispec", "serve", "--port", "0", "--target", config.target,
                "--precision", config.precision, "--drafter", config.drafter.removesuffix(WARM),
                "--k", config.k, "--max-batch", str(config.clients),
                "--max-queue", str(config.clients)]  # fmt: skip
        if config.tokenizer:
            argv += ["--tokenizer", config.tokenizer]
        if config.replicas:
            argv += ["--ray", "--replicas", str(config.replicas)]
            argv += ["--threads", str(config.threads)] if config.threads else []
        # a session of its own: a Ctrl-C at the terminal interrupts this process, which stops the server
        # (stop), instead of stopping the server under the clients' feet
        self.process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.log: list[str] = []
        self.host, self.port = self._wait_listening()
        self.name = json.loads(self.get("/health"))["model"]

    def _wait_listening(self) -> tuple[str, int]:
        assert self.process.stderr is not None
        deadline = time.monotonic() + _STARTUP
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                break
            self.log.append(line.rstrip())
            if match := _LISTENING.search(line):
                threading.Thread(target=self._drain, daemon=True).start()
                for _ in range(500):  # the port is bound before the model loads; the app starts after it
                    try:
                        self.host, self.port = match.group(1), int(match.group(2))
                        self.get("/health")
                        return self.host, self.port
                    except OSError:
                        time.sleep(0.02)
        self.stop()
        raise UsageError("the server did not start: " + " | ".join(self.log[-3:]))

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line.rstrip())

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=120)

    def get(self, path: str) -> str:
        connection = self.connection()
        try:
            connection.request("GET", path)
            return connection.getresponse().read().decode()
        finally:
            connection.close()

    @property
    def running(self) -> bool:
        """Whether the server process is still running."""
        return self.process.poll() is None

    def rss_mib(self) -> float:
        """Resident memory of the server, MiB."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class _Tally:
    completed: int = 0
    failures: int = 0
    died: int = 0  # requests that failed with the killed replica's death, said in one message (503, an event)
    disconnects: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values a slot still held
    failure_examples: list[str] | None = None


@dataclass
class _Answer:
    """One streamed request's outcome: "completed", "disconnected" or a failure's description."""

    outcome: str
    tokens: int = 0  # completion tokens
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str | None = None  # the replica that answered (X-Verispec-Replica), on Ray Serve


def _one_request(
    child: _Child, body: dict, hang_up: bool, ttft: list[float], itl: list[float], session: str | None = None
) -> _Answer:
    """One streamed request (``session``: its X-Session-Id)."""
    connection = child.connection()
    start = time.perf_counter()
    try:
        path, headers = body.pop("_path"), {"content-type": "application/json"}
        connection.request("POST", path, body=json.dumps(body), headers=headers | _session(session))
        response = connection.getresponse()
        if response.status != 200:
            return _Answer(f"status {response.status}: {response.read()[:200]!r}")
        answer = _Answer("completed", replica=response.getheader("x-verispec-replica"))
        arrivals, tokens, done = [], 0, False
        while line := response.readline():
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:  # a stream's failure, in one event
                return _Answer(f"error event: {event['error'].get('message')}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                answer.prompt_tokens = event["usage"]["prompt_tokens"]
                answer.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
            choice = event["choices"][0] if event.get("choices") else {}
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                arrivals.append(time.perf_counter())
                if hang_up:
                    return _Answer("disconnected")
        if not done:
            return _Answer("the stream ended without [DONE]")
        if arrivals:
            ttft.append(arrivals[0] - start)
            per_chunk = max(1.0, tokens / len(arrivals))
            for before, after in zip(arrivals, arrivals[1:], strict=False):
                itl.extend([(after - before) / per_chunk] * round(per_chunk))
        answer.tokens = tokens
        return answer
    except (OSError, http.client.HTTPException, json.JSONDecodeError, KeyError) as err:
        return _Answer(f"{type(err).__name__}: {err}")
    finally:
        connection.close()


def _session(session: str | None) -> dict[str, str]:
    return {} if session is None else {"x-session-id": session}


def _load(child: _Child, config: ServeLoadConfig, prompts: Sequence[Prompt], chat: bool) -> dict:
    tally, lock = _Tally(failure_examples=[]), threading.Lock()
    ttft: list[float] = []
    itl: list[float] = []
    counter, clients = iter(range(1 << 62)), iter(range(1 << 62))
    replicas: dict[str, int] = {}  # a replica's id → requests it answered
    deadline = time.perf_counter() + config.seconds

    def client() -> None:
        with lock:
            session = f"client-{next(clients)}" if config.replicas else None  # a conversation each
        while time.perf_counter() < deadline and child.running:
            with lock:
                index = next(counter)
            body = _body(child, prompts[index % len(prompts)], chat, config)
            every = config.disconnect_every
            hang_up = every > 0 and index % every == every - 1
            answer = _one_request(child, body, hang_up, ttft, itl, session)
            outcome = answer.outcome
            with lock:
                if answer.replica is not None:
                    replicas[answer.replica] = replicas.get(answer.replica, 0) + 1
                if outcome == "completed":
                    tally.completed += 1
                    tally.tokens += answer.tokens
                    tally.prompt_tokens += answer.prompt_tokens
                    tally.cached_tokens += answer.cached_tokens
                elif outcome == "disconnected":
                    tally.disconnects += 1
                elif killed and killed["message"] in outcome:  # a request the killed replica was serving
                    tally.died += 1
                else:
                    tally.failures += 1
                    assert tally.failure_examples is not None
                    tally.failure_examples.append(outcome)

    rss: list[tuple[float, float]] = []  # (seconds into the run, the server's RSS in MiB), every second

    def sample_memory() -> None:
        start = time.perf_counter()
        while not stop.wait(1.0) and child.running:
            with contextlib.suppress(OSError):  # the server ended between the check and the read
                rss.append((time.perf_counter() - start, child.rss_mib()))

    killed: dict = {}  # the killed replica's id and when, once killed

    def kill() -> None:
        from verispec.server.ray_serve import DIED, connect, kill_replica

        connect("auto")  # this machine's Ray, joined before the time comes (seconds)
        if stop.wait(max(0.0, config.kill_replica_at or 0.0) - (time.perf_counter() - start)):
            return
        with lock:
            victim = max(replicas, key=lambda replica: replicas[replica], default=None)
            if victim is None:
                return
            at = time.perf_counter() - start
            killed.update(replica=victim, at=at, before=dict(replicas), message=DIED)
        kill_replica(victim)

    stop, start = threading.Event(), deadline - config.seconds
    watchers = [threading.Thread(target=sample_memory, daemon=True)]
    watchers += [threading.Thread(target=kill, daemon=True)] if config.kill_replica_at is not None else []
    for watcher in watchers:
        watcher.start()
    seconds = run_clients(client, config.clients)
    stop.set()
    for watcher in watchers:
        watcher.join()
    if not child.running:
        raise UsageError(f"the server stopped during the run: {' | '.join(child.log[-3:]) or 'no message'}")
    warm = [mib for at, mib in rss if at >= _WARM_UP * seconds] or [child.rss_mib()]
    return {
        "rss_warm_mib": warm[0],
        "rss_max_mib": max([mib for _, mib in rss] or warm),
        "rss_series": [(round(at, 1), round(mib, 1)) for at, mib in rss[:: max(1, len(rss) // 200)]],
        "completed": tally.completed,
        "failures": tally.failures,
        "failure_examples": (tally.failure_examples or [])[:5],
        "killed": _after_kill(killed, replicas, tally.died),
        "disconnects": tally.disconnects,
        "tokens": tally.tokens,
        "seconds": seconds,
        "tokens_per_second": tally.tokens / seconds,
        "cached_prompt_share": tally.cached_tokens / max(1, tally.prompt_tokens),
        "replicas": dict(sorted(replicas.items())),
        "ttft_p50": _percentile(ttft, 0.5),
        "ttft_p99": _percentile(ttft, 0.99),
        "itl_p50": _percentile(itl, 0.5),
        "itl_p99": _percentile(itl, 0.99),
    }


def _after_kill(killed: Mapping, replicas: Mapping[str, int], died: int) -> dict | None:
    """What a replica's death did (None: none was killed): its id and when, the requests that failed with its
    death's message, and the requests each replica answered after it (a new id: Ray Serve's replacement)."""
    if not killed:
        return None
    before = killed["before"]
    after = {replica: n - before.get(replica, 0) for replica, n in replicas.items()}
    return {"replica": killed["replica"], "at": round(killed["at"], 1), "died": died,
            "answered_after": {replica: n for replica, n in sorted(after.items()) if n}}  # fmt: skip


def _metric(exposition: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def run_serve_load(config: ServeLoadConfig, progress: bool = True) -> dict:
    """Start the server, load it, read its metrics and memory, stop it; then the engine alone."""
    from verispec.api import Speculator
    from verispec.models.base import has_chat_template

    spec = Speculator(config.target, drafter=config.drafter.removesuffix(WARM), tokenizer=config.tokenizer,
                      precision=config.precision)  # fmt: skip
    chat = has_chat_template(spec.tokenizer)
    prompts = _load_prompts(config.prompts, spec, chat, config.max_tokens)
    child = _Child(config)
    try:
        warm = _one_request(child, _body(child, prompts[0], chat, config), False, [], [])
        if warm.outcome != "completed":
            raise UsageError(f"the server's first request failed: {warm.outcome}")
        if config.drafter.endswith(WARM):  # every prompt once through the server's cache, untimed
            with ThreadPoolExecutor(config.clients) as pool:
                list(
                    pool.map(
                        lambda p: _one_request(child, _body(child, p, chat, config), False, [], []), prompts
                    )
                )
        rss_start = child.rss_mib()
        if progress:
            say = f"bench-serve: {config.clients} clients for {config.seconds:g} s"
            print(say, file=sys.stderr, flush=True)
        measured = _load(child, config, prompts, chat)
        deadline = time.monotonic() + _HANG_UPS  # the last hang-ups reach the engine within a step
        while True:
            exposition = child.get("/metrics")
            hang_ups = _metric(exposition, "verispec_requests_total", status="499")
            # a hang-up that raced its request's last token was answered whole (a 200, not a 499); a killed
            # replica's counts died with it
            counted = hang_ups <= measured["disconnects"] or measured["killed"] is not None
            freed = _metric(exposition, "verispec_batch_size") == 0 and counted
            if freed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        rss_end = child.rss_mib()
    finally:
        child.stop()
    result = {
        "config": {"target": config.target, "drafter": config.drafter, "k": config.k,
                   "clients": config.clients, "seconds": config.seconds, "max_tokens": config.max_tokens,
                   "disconnect_every": config.disconnect_every, "replicas": config.replicas,
                   "threads": config.threads, "kill_replica_at": config.kill_replica_at},
        "served": {**measured, "disconnects_freed": freed, "rss_start_mib": rss_start, "rss_end_mib": rss_end,
                   "rss_growth": rss_end / rss_start - 1,
                   "rss_growth_warm": rss_end / measured["rss_warm_mib"] - 1},
    }  # fmt: skip
    if config.engine:
        load = LoadConfig(target=config.target, max_new_tokens=config.max_tokens,
                          requests=max(config.clients, measured["completed"]))  # fmt: skip
        _verispec_cell(spec, prompts, 1, config.k, replace(load, requests=1), chat)  # warm-up
        ready_cache(spec, config.drafter, prompts, config.k, load, chat)
        engine = _summary(
            [_verispec_cell(spec, prompts, config.clients, config.k, load, chat)], load.request_count
        )
        result["engine"] = engine
        result["served_over_engine"] = measured["tokens_per_second"] / engine["tokens_per_second"]
    return result


def _body(child: _Child, prompt: Prompt, chat: bool, config: ServeLoadConfig) -> dict:
    body: dict = {"model": child.name, "max_tokens": config.max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return body | {"_path": "/v1/chat/completions", "messages": messages}
    return body | {"_path": "/v1/completions", "prompt": prompt}


def write_serve_report(result: Mapping, out: str | Path) -> Path:
    """results.json and results.md."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "results.json", json.dumps(result, indent=1))
    s = result["served"]

    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value * 1e3:.0f}"

    lines = [
        "# verispec bench-serve",
        "",
        f"Config: `{json.dumps(result['config'])}`",
        "",
        "| completed | failures | disconnects (freed) | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| RSS MiB start → warm → end (max) |",
        "|---|---|---|---|---|---|---|",
        f"| {s['completed']} | {s['failures']} | {s['disconnects']} "
        f"({'all' if s['disconnects_freed'] else 'NOT all'}) "
        f"| {s['tokens_per_second']:.1f} | {ms(s['ttft_p50'])} / {ms(s['ttft_p99'])} | {ms(s['itl_p50'])} / "
        f"{ms(s['itl_p99'])} | {s['rss_start_mib']:.0f} → {s['rss_warm_mib']:.0f} → {s['rss_end_mib']:.0f} "
        f"({s['rss_max_mib']:.0f}) |",
        "",
        f"Server memory: {s['rss_growth']:+.1%} from ready (after one request) to the end; "
        f"{s['rss_growth_warm']:+.1%} from warm ({_WARM_UP:.0%} into the run, all clients at work) "
        "to the end.",
    ]
    lines += ["", f"Prompt tokens whose keys and values a slot still held: {s['cached_prompt_share']:.1%}."]
    if s["replicas"]:
        counts = ", ".join(f"{replica} {n}" for replica, n in s["replicas"].items())
        lines += [
            "",
            f"Requests per replica (Ray Serve): {counts}; the memory above is the Ray driver's alone.",
        ]
    if s.get("killed"):
        k = s["killed"]
        after = ", ".join(f"{replica} {n}" for replica, n in k["answered_after"].items()) or "none"
        lines += [
            "",
            f"Replica {k['replica']} killed {k['at']:g} s into the run: requests that failed with its "
            f"death's one message (a 503 or an error event; the failures above are the others): {k['died']}; "
            f"requests answered after it: {after}. Its hang-ups' counts died with it: freed above means the "
            "batches were empty at the end.",
        ]
    if "engine" in result:
        e = result["engine"]
        lines += ["", f"The engine alone on the same work: {e['tokens_per_second']:.1f} tok/s; "
                  f"served / engine = {result['served_over_engine']:.2f}."]  # fmt: skip
    if s["failure_examples"]:
        lines += ["", "Failures, first few: " + "; ".join(s["failure_examples"])]
    atomic_write(out / "results.md", "\n".join(lines) + "\n")
    return out

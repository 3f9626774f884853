"""The server's Prometheus metrics, in a registry of its own (one per app: two servers in one process never
share counters).

Per request: requests by endpoint and status, prompt and generated tokens, target calls, draft tokens drafted
and accepted at each draft position (acceptance by position = accepted / drafted), tokens per target call,
time to first token and inter-token latency. Of the engine, read at each scrape: the sequences decoding (the
batch) and the requests waiting (the queue); and, on a server without API keys, its suffix cache's stats
(with keys, the caches are the tenants' and /metrics, open to all, shows nothing of them).

Every label set is bounded by configuration, never by what requests send: routes are the app's own (every
other path one label), statuses the few the server answers, and draft positions 1 to :data:`POSITIONS` − 1
each with their own series, every later one counted under ``"{POSITIONS}+"`` (a grammar's forced run drafts
many positions in a round: a series per position once took /metrics to 1.9 MB).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from verispec.engine.sequence import GenerationStats

__all__ = ["POSITIONS", "ServerMetrics"]

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # seconds
POSITIONS = 16  # draft positions with a series each: 1 .. POSITIONS - 1, then one "16+" for all later ones
SUFFIX_STATS = {  # the suffix cache's stats in /metrics (a server without keys: one cache)
    "caches": "Caches",
    "tokens": "Tokens held",
    "sequences": "Sequences (outputs) held",
    "evictions": "Sequences evicted so far",
    "budget": "Tokens the budgets allow",
}
_TOKENS_PER_CALL = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)


class ServerMetrics:
    """Counters, gauges and histograms of one server."""

    def __init__(
        self,
        running: Callable[[], int],
        waiting: Callable[[], int],
        suffix: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """running, waiting: read at each scrape, the engine's batch size and queue depth; suffix: the suffix
        cache's stats (:meth:`~verispec.server.tenants.SuffixTenants.stats`; None: not shown)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "verispec_requests",
            "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("verispec_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generated_tokens = Counter("verispec_generated_tokens", "Tokens generated", registry=r)
        self.target_calls = Counter(
            "verispec_target_calls", "Verification rounds (target forwards)", registry=r
        )
        self.drafted = Counter(
            "verispec_draft_tokens_drafted",
            f"Draft tokens proposed, by draft position (1 = first; {POSITIONS}+: that one and later)",
            ["position"],
            registry=r,
        )
        self.accepted = Counter(
            "verispec_draft_tokens_accepted",
            f"Draft tokens accepted, by draft position (1 = first; {POSITIONS}+: that one and later)",
            ["position"],
            registry=r,
        )
        self.tokens_per_call = Histogram(
            "verispec_tokens_per_target_call",
            "Tokens per target call of each request",
            buckets=_TOKENS_PER_CALL,
            registry=r,
        )
        self.ttft = Histogram(
            "verispec_time_to_first_token_seconds",
            "From request to its first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "verispec_inter_token_latency_seconds", "Between a request's tokens", buckets=_LATENCY, registry=r
        )
        Gauge("verispec_batch_size", "Sequences decoding together", registry=r).set_function(running)
        Gauge("verispec_queue_depth", "Requests waiting for a slot", registry=r).set_function(waiting)
        for stat, text in () if suffix is None else SUFFIX_STATS.items():
            gauge = Gauge(f"verispec_suffix_cache_{stat}", f"{text}, the suffix cache", registry=r)
            gauge.set_function(lambda stat=stat: suffix()[stat])  # type: ignore[misc]

    def finished(self, prompt_tokens: int, stats: GenerationStats) -> None:
        """Count a request that generated (completed, or stopped by its client)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.target_calls.inc(stats.target_calls)
        for position, (drafted, accepted) in enumerate(
            zip(stats.drafted_per_position, stats.accepted_per_position, strict=True), 1
        ):
            label = str(position) if position < POSITIONS else f"{POSITIONS}+"
            self.drafted.labels(label).inc(drafted)
            self.accepted.labels(label).inc(accepted)
        if stats.target_calls:
            self.tokens_per_call.observe(stats.tokens_per_target_call)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

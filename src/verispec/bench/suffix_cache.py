"""``verispec bench-suffix-cache``: the shared suffix cache at its budget, measured in one run.

``requests`` synthetic outputs go into a :class:`~verispec.drafting.suffix_cache.SuffixCache` of ``budget``
tokens, one request at a time, with the tokens held, the sequences evicted and the process's memory growth
recorded every tenth of the way (before the target loads: memory a model's load freed would hide the
cache's). The outputs have the repetitiveness of text without being any: phrases of 4–20 token ids drawn
from a Zipf law below :data:`VOCABULARY`, each output 5–40 phrases of a book of 3,000, its first third the
prompt (the ids are only looked up, never given to the target). Then the suffix drafter's proposal (the
request's own index and the full cache; a chain of ``k`` tokens, and a tree of ``tree``'s shape) is timed on
``lookups`` new requests of the same kind (their first half committed), against the target's decoding step
(one plain round: its forward, sampling and bookkeeping) timed in turns with them, so that a busy spell of
the machine weighs on both. The ratio is what a suffix round pays for its lookup, as a fraction of the step
it saves.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verispec.api import Speculator
from verispec.bench.suite import memory_mib
from verispec.drafting.registry import PLAIN
from verispec.drafting.suffix import SuffixDrafter, SuffixTreeDrafter
from verispec.drafting.suffix_cache import DEFAULT_BUDGET, SuffixCache
from verispec.drafting.tree import TreeShape
from verispec.files import atomic_write
from verispec.inputs import check_int
from verispec.models.names import DEFAULT_MODEL

__all__ = ["SuffixCacheBenchConfig", "run_suffix_cache_bench", "write_suffix_cache_report"]

VOCABULARY = 32_000  # the synthetic token ids lie below it
TURNS = 4  # the lookups and the target's steps are timed in this many alternating turns


@dataclass(frozen=True)
class SuffixCacheBenchConfig:
    """What ``verispec bench-suffix-cache`` measures."""

    target: str = DEFAULT_MODEL
    tokenizer: str | None = None
    requests: int = 10_000
    budget: int = DEFAULT_BUDGET
    lookups: int = 400
    k: int = 8
    tree: str = "2x4"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "budget", "lookups", "k"):
            value = getattr(self, name)
            check_int(value, f"--{name}", 1)
        TreeShape.parse(self.tree)


class _Workload:
    """Synthetic requests with the repetitiveness of text (module docstring)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.phrases = [
            self.rng.zipf(1.3, size=int(self.rng.integers(4, 21))) % vocab_size for _ in range(3000)
        ]  # each [4..20] int64

    def output(self) -> list[int]:
        picks = self.rng.integers(0, len(self.phrases), size=int(self.rng.integers(5, 41)))  # [P]
        return np.concatenate([self.phrases[i] for i in picks]).tolist()


def _fill(cache: SuffixCache, workload: _Workload, requests: int) -> list[dict[str, float]]:
    """Add ``requests`` outputs (their first third as the prompt); the cache's size and the memory grown
    since the start, every tenth."""
    start, every, record = memory_mib()[0], max(1, requests // 10), []
    for i in range(requests):
        output = workload.output()
        cache.add(output[: len(output) // 3], output)
        if (i + 1) % every == 0 or i + 1 == requests:
            stats = cache.stats()
            record.append({"requests": i + 1, **stats, "rss_growth_mib": memory_mib()[0] - start})
    return record


def _lookups(
    cache: SuffixCache, contexts: list[list[int]], k: int, shape: TreeShape
) -> dict[str, list[float]]:
    """Seconds of each context's chain and tree proposals; the drafter's own index holds the context but
    its last token before it proposes (as after a round), which is not timed."""
    chain = SuffixDrafter(cache)
    tree = SuffixTreeDrafter(shape, chain)
    generator = torch.Generator()
    seconds: dict[str, list[float]] = {"chain": [], "tree": []}  # kind -> [contexts]
    for context in contexts:
        chain.begin(context[: len(context) // 2])
        chain.read(context[:-1])
        start = time.perf_counter()
        chain.propose(context, k, generator)
        middle = time.perf_counter()
        tree.propose_tree(context, shape, generator)
        seconds["chain"].append(middle - start)
        seconds["tree"].append(time.perf_counter() - middle)
    return seconds


def _target_steps(speculator: Speculator, tokens: int) -> float:
    """Seconds per plain decoding round of the target (after the prompt's prefill)."""
    stats = speculator.generate("Once upon a time", max_new_tokens=tokens, k=0).stats
    return (stats["total_seconds"] - stats["prefill_seconds"]) / max(1, stats["target_calls"])


def run_suffix_cache_bench(config: SuffixCacheBenchConfig) -> dict[str, Any]:
    cache = SuffixCache(config.budget)
    workload = _Workload(VOCABULARY, config.seed)
    record = _fill(cache, workload, config.requests)
    speculator = Speculator(target=config.target, tokenizer=config.tokenizer, drafter=PLAIN)
    shape = TreeShape.parse(config.tree)
    contexts = [workload.output() for _ in range(config.lookups)]
    _target_steps(speculator, 16)  # first calls build and warm up
    lookups: dict[str, list[float]] = {"chain": [], "tree": []}
    steps = []
    for turn in range(TURNS):
        steps.append(_target_steps(speculator, 64))
        for kind, seconds in _lookups(cache, contexts[turn::TURNS], config.k, shape).items():
            lookups[kind] += seconds
    step = statistics.median(steps)
    summary = {
        kind: {
            "median_ms": 1e3 * float(np.median(seconds)),
            "p99_ms": 1e3 * float(np.percentile(seconds, 99)),
            "median_over_step": float(np.median(seconds)) / step,
        }
        for kind, seconds in lookups.items()
    }
    return {"config": asdict(config), "fill": record, "target_step_ms": 1e3 * step, "lookups": summary}


def write_suffix_cache_report(results: dict[str, Any], out: str | Path) -> Path:
    """results.md in ``out`` (and results.json beside it); returns the markdown's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = results["config"]
    lines = [
        "# verispec bench-suffix-cache",
        "",
        f"Target `{config['target']}`; {config['requests']:,} synthetic requests into a cache of "
        f"{config['budget']:,} tokens (module docstring of verispec.bench.suffix_cache); lookups timed on "
        f"{config['lookups']} new requests, in turns with the target's plain decoding step "
        f"({results['target_step_ms']:.2f} ms, median of {TURNS} runs).",
        "",
        "| requests | tokens held | sequences | evicted | memory growth (MiB) |",
        "|---|---|---|---|---|",
    ]
    for row in results["fill"]:
        lines.append(
            f"| {row['requests']:,} | {row['tokens']:,} | {row['sequences']:,} | {row['evictions']:,} "
            f"| {row['rss_growth_mib']:.1f} |"
        )
    lines += ["", "| proposal | median (ms) | p99 (ms) | median / target step |", "|---|---|---|---|"]
    labels = {"chain": f"chain, k={config['k']}", "tree": f"tree {config['tree']}"}
    for kind, row in results["lookups"].items():
        lines.append(
            f"| {labels[kind]} | {row['median_ms']:.3f} | {row['p99_ms']:.3f} "
            f"| {100 * row['median_over_step']:.1f} % |"
        )
    atomic_write(out / "results.json", json.dumps(results, indent=2) + "\n")
    path = out / "results.md"
    atomic_write(path, "\n".join(lines) + "\n")
    return path

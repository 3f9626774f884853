"""A bench cell's metrics from its samples (:func:`cell_metrics`): tokens/s end to end and decoding, the
speedups over the baselines, τ, acceptance by position, the split of time, and the analytic model's
prediction (:func:`predicted_speedup`) with the efficiency measured against it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np

from verispec.bench.methods import PEERS
from verispec.bench.records import Cell, Metrics, Sample, Spread
from verispec.costs.analytic import CostModel, expected_tokens_per_call

__all__ = ["add_samples", "cell_metrics", "predicted_speedup"]

# a tool task's counts in its samples (:class:`~verispec.bench.records.Sample`)
_LOOP_COUNTS: tuple[Literal["turns", "tool_calls", "valid_tool_calls", "cut_tool_calls"], ...] = (
    "turns",
    "tool_calls",
    "valid_tool_calls",
    "cut_tool_calls",
)


def predicted_speedup(
    target_calls: int,
    drafted_per_position: Sequence[int],
    accepted_per_position: Sequence[int],
    cost: CostModel,
) -> float | None:
    """The analytic model's decoding speedup over plain decoding for a run's rounds, from its measured
    acceptance and the calibrated costs:

        Σ_d n_d · E[L](α_1..α_d) / Σ_d n_d · (v(d+1) + d·c)

    where n_d is the number of rounds that drafted d tokens (rounds may draft fewer than K: an n-gram lookup
    without a match, ``--k auto``, the last tokens of a generation) and α_i the measured acceptance at
    position i given that every earlier position was accepted. With a constant K and every round drafting
    K this is E[L](α, K) / (v(K+1) + K·c), :func:`verispec.costs.analytic.expected_speedup`.
    ``drafted_per_position
    [i]`` counts the rounds that drafted position i, ``accepted_per_position[i]`` those that accepted it (as
    :class:`~verispec.engine.sequence.GenerationStats` keeps them). None when nothing ran or K exceeds the
    curve."""
    depth = len(drafted_per_position)
    if target_calls <= 0 or (cost.max_k is not None and depth > cost.max_k):
        return None
    at_least = [target_calls, *drafted_per_position, 0]  # [depth + 2]: rounds that drafted ≥ d tokens
    alphas, reached = [], 1.0  # reached: the fraction of rounds that accepted every position so far
    for accepted, drafted in zip(accepted_per_position, drafted_per_position, strict=True):
        rate = accepted / drafted if drafted else 0.0  # P(positions 1..i all accepted | i drafted)
        alphas.append(rate / reached if reached > 0 else 0.0)
        reached = rate
    tokens = cost_units = 0.0
    for d in range(depth + 1):
        rounds = at_least[d] - at_least[d + 1]
        tokens += rounds * expected_tokens_per_call(np.clip(alphas[:d], 0.0, 1.0))
        cost_units += rounds * cost.round_cost(d)
    return tokens / cost_units


def _spread(values: Sequence[float]) -> Spread:
    """The median, extremes and number of a non-empty list of values."""
    return {"median": float(np.median(values)), "min": min(values), "max": max(values), "n": len(values)}


def _positionwise(counts: Iterable[list[int]]) -> list[int]:
    """Per-position counts summed position by position (the shorter lists padded with zeros)."""
    total: list[int] = []
    for row in counts:
        total += [0] * (len(row) - len(total))
        for i, count in enumerate(row):
            total[i] += count
    return total


def add_samples(samples: Sequence[Sample]) -> Sample:
    """One record for several: counters and per-position counts summed, memory peaks their maximum."""
    total: Sample = {
        "tokens": sum(s["tokens"] for s in samples),
        "decode_tokens": sum(s["decode_tokens"] for s in samples),
        "seconds": sum(s["seconds"] for s in samples),
        "prefill": sum(s["prefill"] for s in samples),
        "draft": sum(s["draft"] for s in samples),
        "target": sum(s["target"] for s in samples),
        "calls": sum(s["calls"] for s in samples),
        "drafted": sum(s["drafted"] for s in samples),
        "accepted": sum(s["accepted"] for s in samples),
        "drafted_per_position": _positionwise(s["drafted_per_position"] for s in samples),
        "accepted_per_position": _positionwise(s["accepted_per_position"] for s in samples),
        "tree_nodes": sum(s["tree_nodes"] for s in samples),
        "forced": sum(s["forced"] for s in samples),
        "cached_prompt_tokens": sum(s.get("cached_prompt_tokens", 0) for s in samples),  # older files: none
        "prompt_tokens": sum(s.get("prompt_tokens", 0) for s in samples),
        "peak_rss_mib": max(s["peak_rss_mib"] for s in samples),
        "rss_growth_mib": max(s["rss_growth_mib"] for s in samples),
        "prompts": sum(s["prompts"] for s in samples),
    }
    for key in _LOOP_COUNTS:
        if any(key in s for s in samples):
            total[key] = sum(s.get(key, 0) for s in samples)
    return total


def cell_metrics(
    cell: Cell, none: Cell | None, peer: Cell | None, llamacpp: Cell | None, cost: CostModel | None
) -> Metrics | None:
    """The metrics of one cell (see the module doc) from its samples (None before the first); ``none``,
    ``peer`` and ``llamacpp`` are the cells of verispec ``none``, transformers plain and llama.cpp plain for
    the same task and temperature (None: not run), ``cost`` the calibrated cost model of the cell's verispec
    drafter (None for peers)."""
    samples = cell["samples"]
    if not samples:
        return None
    total = add_samples(samples)
    calls, drafted, seconds = total["calls"], total["drafted"], total["seconds"]
    scored = total["tree_nodes"] or drafted  # tree rounds score nodes, not depth
    speed = _spread([s["tokens"] / s["seconds"] for s in samples])
    decode = _spread([s["decode_tokens"] / max(s["seconds"] - s["prefill"], 1e-9) for s in samples])
    accepted_at, drafted_at = total["accepted_per_position"], total["drafted_per_position"]
    decode_speedup = _ratio(decode, none, decode=True)
    predicted = None if cost is None else predicted_speedup(calls, drafted_at, accepted_at, cost)
    return {
        "tokens_per_second": speed,
        "decode_tokens_per_second": decode,
        "tokens_per_target_call": total["tokens"] / calls if calls else None,
        "forward_size": 1 + scored / calls if calls and cell["method"] not in PEERS else None,
        "acceptance_rate": total["accepted"] / drafted
        if drafted and not cell.get("peer_acceptance_unknown")
        else None,
        "acceptance_per_position": [a / d for a, d in zip(accepted_at, drafted_at, strict=True)],
        "time_split": {
            "prefill": total["prefill"] / seconds,
            "draft": total["draft"] / seconds,
            "target": total["target"] / seconds,
            "other": 1 - (total["prefill"] + total["draft"] + total["target"]) / seconds,
        },
        "peak_rss_mib": total["peak_rss_mib"],
        "rss_growth_mib": total["rss_growth_mib"],
        "speedup_vs_transformers": _ratio(speed, peer),
        "speedup_vs_llamacpp": _ratio(speed, llamacpp),
        "speedup_vs_none": _ratio(speed, none),
        "decode_speedup_vs_none": decode_speedup,
        "predicted_speedup": predicted,
        "efficiency": decode_speedup / predicted if predicted and decode_speedup else None,
        "forced_share": total["forced"] / total["tokens"] if total["forced"] and total["tokens"] else None,
        "prompt_scored": _prompt_scored(total, len(samples)),
    }


def _prompt_scored(total: Sample, samples: int) -> list[float] | None:
    """A sample's prompt tokens scored (not kept from a slot) and all its prompt tokens, the mean of
    ``samples`` summed in ``total`` (None for files written before prompts were counted)."""
    prompt = total.get("prompt_tokens", 0)
    return [(prompt - total["cached_prompt_tokens"]) / samples, prompt / samples] if prompt else None


def _ratio(spread: Spread, other: Cell | None, decode: bool = False) -> float | None:
    """The median of ``spread`` over the median tokens/s (``decode``: decoding tokens/s) of the cell
    ``other`` (None where it is absent or not measured)."""
    measured = other.get("metrics") if other else None
    if not measured:
        return None
    base = measured["decode_tokens_per_second" if decode else "tokens_per_second"]
    return spread["median"] / base["median"]

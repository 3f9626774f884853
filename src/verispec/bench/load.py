"""``verispec bench-load``: many requests at once — aggregate throughput, time to first token and inter-token
latency per method and concurrency, beside transformers' batched ``generate`` on the same weights.

At each concurrency C, C client threads share a list of requests (the bench's task prompts in the chat
template, cycled; the same list at every C), each submitting its next request to a
:class:`~verispec.engine.scheduler.Scheduler` of C slots as soon as its last one ended, until every request
has run: a closed loop that keeps C requests in flight.
Measured per cell: generated tokens over wall time (aggregate tokens/s), time to first token (submission →
the first committed token), inter-token latency (the time between committed chunks, spread over the tokens
of each: what a streaming client sees), their p50 and p99, tokens per target forward, the draft tokens
per sequence and step, and the prompt tokens (with those a slot kept from its last sequence, not scored
again); and every ``--k auto`` cell's speed against the best of ``none`` and its method's fixed Ks, paired by
turn (:func:`auto_against_best`). The peer, transformers, generates the same requests greedily in batches of
C (left-padded), timed whole. ``results.json``, ``results.md`` and a chart (tokens/s against concurrency)
are written to ``--out``.

A drafter with a cache shared across requests (``suffix``) starts every timed cell from an empty cache; as
``suffix-warm``, from the cache one untimed pass of every prompt through the same speculator left
(:func:`ready_cache`). Each is its own row. ``model`` drafts with the draft model of ``--draft``: beside the
engine's slots on the native kernels, the batch's rows draft together (one draft forward a position).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verispec.api import Speculator
from verispec.bench.methods import LOAD_METHODS
from verispec.bench.prompts import builtin_tasks
from verispec.bench.workloads import WARM
from verispec.choice import DEFAULT_PRECISION, ModelChoice
from verispec.drafting.registry import DRAFT_MODEL, PLAIN
from verispec.drafting.suffix_cache import SuffixCache
from verispec.engine.scheduler import Scheduler
from verispec.errors import UsageError
from verispec.files import atomic_write
from verispec.inputs import check_int, is_int
from verispec.models.base import has_chat_template
from verispec.models.names import DEFAULT_MODEL
from verispec.options import DraftLength, GenerationOptions
from verispec.resolve import Target

Prompt = str | Sequence[Mapping[str, str]]  # a prompt, or a conversation

__all__ = ["LOAD_METHODS", "LoadConfig", "auto_against_best", "run_load", "write_load_report"]


@dataclass(frozen=True)
class LoadConfig:
    """What ``verispec bench-load`` runs; validated with UsageError. ``ks``: the K of the drafting methods
    (N or "auto"); ``requests``: how many run at every concurrency, the same ones at each, so that the levels
    compare the same work (default: 4 × the highest concurrency, at least 8); ``repetitions``: how many times
    every verispec cell runs, the methods taking turns at each concurrency so that a machine's drift falls
    on all of them alike (tokens/s: the median run, of two the slower; latencies: pooled). ``draft``: the
    draft model of the method ``model`` (with its tokenizer, or across tokenizers by ``cross_tokenizer``),
    given exactly when that method runs."""

    target: str = DEFAULT_MODEL
    tokenizer: str | None = None
    draft: str | None = None  # the draft model of the method model (a SPEC, or layers:N)
    draft_tokenizer: str | None = None
    cross_tokenizer: str = "auto"
    precision: str = DEFAULT_PRECISION
    methods: tuple[str, ...] = ("none", "ngram", "auto", "transformers")
    ks: tuple[str, ...] = ("auto",)
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    requests: int | None = None
    repetitions: int = 1
    max_new_tokens: int = 64
    threads: int | None = None
    out: str = ""
    prompts: tuple[Prompt, ...] = field(default=())  # default: the bench's task prompts

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in LOAD_METHODS]
        if unknown or not self.methods:
            raise UsageError(
                f"unknown method {unknown[0] if unknown else ''!r}; choose from {', '.join(LOAD_METHODS)}"
            )
        if (self.draft is None) == (DRAFT_MODEL in self.methods):
            raise UsageError(
                f"the method {DRAFT_MODEL} drafts with --draft SPEC"
                if self.draft is None
                else f"--draft is the draft model of the method {DRAFT_MODEL}: add it to --methods"
            )
        if self.draft is None and (self.draft_tokenizer is not None or self.cross_tokenizer != "auto"):
            raise UsageError("--draft-tokenizer and --cross-tokenizer go with --draft (the method model)")
        if not self.concurrency or any(not is_int(c) or c < 1 for c in self.concurrency):
            raise UsageError(f"concurrency levels must be integers >= 1, got {list(self.concurrency)}")
        for k in self.ks:
            if k != "auto" and not (k.isdigit() and int(k) >= 1):
                raise UsageError(f"k must be N >= 1 or auto, got {k!r}")
        numbers = (
            ("requests", self.requests),
            ("repetitions", self.repetitions),
            ("max_new_tokens", self.max_new_tokens),
        )
        for name, value in numbers:
            if value is not None:
                check_int(value, name, 1)

    @property
    def request_count(self) -> int:
        return self.requests if self.requests is not None else max(8, 4 * max(self.concurrency))


def run_clients(client: Callable[[], None], count: int) -> float:
    """Run ``count`` threads of ``client`` at once; the seconds until the last one ends. Daemon threads: an
    interrupt (Ctrl-C) ends the process at once, not when the clients' loops run out."""
    threads = [threading.Thread(target=client, daemon=True) for _ in range(count)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def rotated(count: int, turn: int) -> list[int]:
    """The order of ``count`` cells in the given turn: turn t starts at cell t mod count, so that over as many
    turns as cells each takes every place once and a drift within a turn (the machine warming, a neighbour
    starting) weighs on all alike instead of always on the last."""
    return [(turn + i) % count for i in range(count)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _load_prompts(
    prompts: Sequence[Prompt], spec: Speculator, chat: bool, max_new_tokens: int
) -> list[Prompt]:
    """The requests' prompts: ``prompts``, else every bench task's (conversations where the model has a
    chat template; an agent loop's items aside: their tools are not rendered here), those that leave
    ``max_new_tokens`` of room in the target's context; UsageError when none does."""
    if not prompts:
        every = (p for task_prompts in builtin_tasks().values() for p in task_prompts if p.agent is None)
        prompts = [p.for_model(chat) for p in every]
    room = spec.model.max_context - max_new_tokens
    fit = [p for p in prompts if len(spec.encode_prompt(p, chat)) < room]
    if not fit:
        raise UsageError(f"no prompt leaves room for {max_new_tokens} new tokens in the model's context")
    return fit


def ready_cache(
    spec: Speculator, method: str, prompts: list[Prompt], k: str, config: LoadConfig, chat: bool
) -> None:
    """Before a timed cell of a drafter with a shared cache: the cache emptied, then, for a ``-warm`` method,
    filled by every prompt run once through ``spec`` (untimed)."""
    if spec.suffix_cache is None:
        return
    spec.suffix_cache = SuffixCache(spec.suffix_cache.budget, vocabulary=spec.suffix_cache.vocabulary)
    if method.endswith(WARM):
        _verispec_cell(
            spec, prompts, len(prompts), k, dataclasses.replace(config, requests=len(prompts)), chat
        )


def _verispec_cell(
    spec: Speculator, prompts: list[Prompt], concurrency: int, k: str, config: LoadConfig, chat: bool
) -> dict:
    """C clients in a closed loop through a scheduler of C slots."""
    queue = list(range(config.request_count))
    lock = threading.Lock()
    ttft: list[float] = []
    itl: list[float] = []
    tokens, calls, drafted, failures, prompt, cached = [0], [0], [0], [0], [0], [0]
    options = GenerationOptions(  # greedy
        k=DraftLength.parse(k), max_new_tokens=config.max_new_tokens, chat=chat
    )

    def client(scheduler: Scheduler) -> None:
        while True:
            with lock:
                if not queue:
                    return
                index = queue.pop(0)
            start = time.perf_counter()
            try:
                handle = scheduler.submit(prompts[index % len(prompts)], options)
                last, count, mine = start, 0, []
                for chunk in handle:
                    now = time.perf_counter()
                    n = len(chunk.token_ids)
                    if n and count == 0:
                        with lock:
                            ttft.append(now - start)
                    elif n:
                        mine += [(now - last) / n] * n
                    if n:
                        last, count = now, count + n
                with lock:
                    itl.extend(mine)
                    tokens[0] += count
                    calls[0] += handle.stats.target_calls
                    drafted[0] += handle.stats.drafted
                    prompt[0] += handle.prompt_tokens
                    cached[0] += handle.stats.cached_prompt_tokens
            except Exception:  # counted: a load test reports failures, it does not stop at one
                with lock:
                    failures[0] += 1

    with Scheduler(spec, slots=concurrency, max_queue=concurrency) as scheduler:
        seconds = run_clients(lambda: client(scheduler), concurrency)
    forwards = scheduler.driver.engine.forwards
    return {"seconds": seconds, "tokens": tokens[0], "calls": calls[0], "drafted": drafted[0],
            "failures": failures[0], "ttft": ttft, "itl": itl, "prompt_tokens": prompt[0],
            "cached_prompt_tokens": cached[0], "forward_seconds": forwards.seconds,
            "prompt_forward_seconds": forwards.prompt_seconds}  # fmt: skip


def _summary(runs: list[dict], requests: int) -> dict:
    """One cell from its runs: tokens/s of the median run (of an even number, the slower middle one),
    latencies pooled over all, τ and drafts per round over all; the shares of the runs' time spent in target
    forwards that score prompt tokens (beside decoding rows or not) and in the others."""
    speeds = sorted(run["tokens"] / run["seconds"] for run in runs)
    ttft = [t for run in runs for t in run["ttft"]]
    itl = [t for run in runs for t in run["itl"]]
    tokens, calls, drafted = (sum(run[key] for run in runs) for key in ("tokens", "calls", "drafted"))
    seconds, forwards, prompt = (sum(r[key] for r in runs) for key in
                                 ("seconds", "forward_seconds", "prompt_forward_seconds"))  # fmt: skip
    return {
        "tokens_per_second": speeds[(len(speeds) - 1) // 2],
        "tokens_per_second_runs": speeds,
        "tokens_per_second_turns": [run["tokens"] / run["seconds"] for run in runs],  # in the turns' order
        "tokens": runs[0]["tokens"],
        "seconds": sum(run["seconds"] for run in runs) / len(runs),
        "requests": requests,
        "prompt_tokens": runs[0]["prompt_tokens"],
        "cached_prompt_tokens": sum(run["cached_prompt_tokens"] for run in runs) / len(runs),
        "failures": sum(run["failures"] for run in runs),
        "ttft_p50": _percentile(ttft, 0.5),
        "ttft_p99": _percentile(ttft, 0.99),
        "itl_p50": _percentile(itl, 0.5),
        "itl_p99": _percentile(itl, 0.99),
        "tokens_per_target_call": tokens / calls if calls else None,
        "drafted_per_round": drafted / calls if calls else None,
        "prompt_forward_share": prompt / seconds,
        "decode_forward_share": (forwards - prompt) / seconds,
    }


def auto_against_best(cells: Sequence[dict]) -> None:
    """Adds to every ``--k auto`` cell its speed against the best of ``none`` and its method's fixed Ks at the
    same concurrency, paired by turn (each run against the others' runs of the same turn, so that a machine's
    drift between turns cancels): ``auto_vs_best_turns`` and their median (of an even number, the lower
    middle one) ``auto_vs_best``: the goal's ``--k auto`` ≥ 0.95 × max(none, best fixed K). A cell without
    ``none`` beside it gets neither."""
    turns = {(c["method"], c.get("k", ""), c["concurrency"]): c["tokens_per_second_turns"]
             for c in cells if "tokens_per_second_turns" in c}  # fmt: skip
    for cell in cells:
        level = cell["concurrency"]
        if cell.get("k") != "auto" or ("none", "", level) not in turns:
            continue
        rivals = [speeds for (method, k, at), speeds in turns.items() if at == level
                  and (method == "none" or (method == cell["method"] and k != "auto"))]  # fmt: skip
        mine = turns[(cell["method"], "auto", level)]
        ratios = [speed / max(rival[i] for rival in rivals) for i, speed in enumerate(mine)]
        cell["auto_vs_best_turns"] = ratios
        cell["auto_vs_best"] = sorted(ratios)[(len(ratios) - 1) // 2]


def _transformers_cell(
    model, tokenizer, prompts: list[Prompt], concurrency: int, config: LoadConfig, chat: bool
) -> dict:
    """transformers' greedy ``generate`` over the same requests in left-padded batches of C."""
    ids = [tokenizer.encode(tokenizer.chat_prompt(p) if chat else p) for p in prompts]
    count = config.request_count
    eos = sorted(tokenizer.eos_token_ids)
    pad = eos[0] if eos else 0
    generated = 0
    start = time.perf_counter()
    for first in range(0, count, concurrency):
        batch = [ids[i % len(ids)] for i in range(first, min(count, first + concurrency))]
        width = max(map(len, batch))
        inputs = torch.tensor([[pad] * (width - len(b)) + b for b in batch])  # [C, L] left-padded
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])  # [C, L]
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=mask, max_new_tokens=config.max_new_tokens,
                                 do_sample=False, eos_token_id=eos or None, pad_token_id=pad)  # fmt: skip
        for row in out[:, width:].tolist():
            stop = next((i for i, t in enumerate(row) if t in eos), None)
            generated += len(row) if stop is None else stop + 1
    seconds = time.perf_counter() - start
    return {"tokens_per_second": generated / seconds, "tokens": generated, "seconds": seconds,
            "requests": count, "failures": 0}  # fmt: skip


def run_load(config: LoadConfig, progress: bool = True) -> dict:
    """Every method at every concurrency; the results as ``results.json`` records them."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    choice = ModelChoice(
        target=str(config.target), tokenizer=config.tokenizer, precision=config.precision, drafter=PLAIN
    )
    target = Target.load(choice)  # once, every method's drafter beside it
    base = Speculator.on(target)
    chat = has_chat_template(base.tokenizer)
    prompts = _load_prompts(config.prompts, base, chat, config.max_new_tokens)
    turns = []  # (method, k, speculator): the verispec cells, which take turns at each concurrency
    for method in config.methods:
        if method != "transformers":
            spec = base if method == "none" else Speculator.on(target, **_drafter(method, config))
            turns += [(method, k, spec) for k in (("0",) if method == "none" else config.ks)]
    for _, k, spec in turns:
        _verispec_cell(spec, prompts, 1, k, dataclasses.replace(config, requests=1), chat)  # warm-up
    runs: dict[tuple[int, int], list[dict]] = {}
    for repetition in range(config.repetitions):
        for c in config.concurrency:
            for index in rotated(len(turns), repetition):
                method, k, spec = turns[index]
                ready_cache(spec, method, prompts, k, config, chat)
                runs.setdefault((index, c), []).append(_verispec_cell(spec, prompts, c, k, config, chat))
                run = runs[(index, c)][-1]
                _say(progress, method, k, c, run["tokens"] / run["seconds"], repetition)
    cells = []
    for index, (method, k, spec) in enumerate(turns):
        label = spec.drafter_name if method == "auto" else method
        for c in config.concurrency:
            cells.append({"method": method, "drafter": label, "k": "" if method == "none" else k,
                          "concurrency": c, **_summary(runs[(index, c)], config.request_count)})  # fmt: skip
    auto_against_best(cells)
    if "transformers" in config.methods:
        from verispec.bench.peers import load_transformers

        peer = load_transformers(config.target, config.tokenizer)
        for c in config.concurrency:
            measured = _transformers_cell(peer, base.tokenizer, prompts, c, config, chat)
            cells.append({"method": "transformers", "k": "", "concurrency": c, **measured})
            _say(progress, "transformers", "", c, measured["tokens_per_second"], 0)
    return {
        "config": {"target": config.target, "draft": config.draft, "precision": config.precision,
                   "methods": list(config.methods),
                   "ks": list(config.ks), "concurrency": list(config.concurrency),
                   "requests": config.request_count, "repetitions": config.repetitions,
                   "max_new_tokens": config.max_new_tokens, "threads": torch.get_num_threads()},
        "cells": cells,
    }  # fmt: skip


def _drafter(method: str, config: LoadConfig) -> dict:
    """``Speculator.on``'s drafter arguments for ``method``: its drafter, and for ``model`` its draft."""
    if method != DRAFT_MODEL:
        return {"drafter": method.removesuffix(WARM)}
    fields = {"draft_tokenizer": config.draft_tokenizer, "cross_tokenizer": config.cross_tokenizer}
    return {"drafter": DRAFT_MODEL, "draft": config.draft, **fields}


def _say(progress: bool, method: str, k: str, concurrency: int, speed: float, repetition: int) -> None:
    if progress:
        label = method + (f" k={k}" if method not in ("none", "transformers") else "")
        print(f"bench-load: {label} at {concurrency} (run {repetition + 1}): {speed:.1f} tok/s", flush=True)


def _ratio(value: float, base: float | None) -> str:
    return "—" if not base else f"{value / base:.2f}×"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e3:.0f}"


def write_load_report(results: dict, out: str | Path) -> Path:
    """results.json, results.md (a table per concurrency, the crossover) and tokens_per_second.png/svg."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=1)
    atomic_write(out / "results.json", text)
    cells = results["cells"]
    plain = {c["concurrency"]: c["tokens_per_second"] for c in cells if c["method"] == "none"}
    alone = plain[min(plain)] if plain else None  # none at the lowest concurrency: batch 1 when it ran
    header = (
        f"| method | C | tok/s (runs) | × none | × none at C = {min(plain) if plain else '—'} "
        "| TTFT p50 / p99 ms | ITL p50 / p99 ms | τ | drafts/round | prompt tokens (kept) "
        "| time in forwards with prompt / without | failures |"
    )
    lines = ["# verispec bench-load", "", f"Config: `{json.dumps(results['config'])}`", "", header,
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in cells:
        label = (
            c["method"]
            + (f" k={c['k']}" if c.get("k") else "")
            + (f" ({c['drafter']})" if c["method"] == "auto" else "")
        )
        base = plain.get(c["concurrency"])
        tau = c.get("tokens_per_target_call")
        drafts = c.get("drafted_per_round")
        runs = c.get("tokens_per_second_runs", [])
        spread = f" ({runs[0]:.0f}–{runs[-1]:.0f})" if len(runs) > 1 else ""
        prompt = f"{c['prompt_tokens']} ({c['cached_prompt_tokens']:.0f})" if "prompt_tokens" in c else "—"
        shares = "—"
        if "prompt_forward_share" in c:
            shares = f"{c['prompt_forward_share']:.0%} / {c['decode_forward_share']:.0%}"
        lines.append(
            f"| {label} | {c['concurrency']} | {c['tokens_per_second']:.1f}{spread} | "
            f"{_ratio(c['tokens_per_second'], base)} | {_ratio(c['tokens_per_second'], alone)} | "
            f"{_ms(c.get('ttft_p50'))} / {_ms(c.get('ttft_p99'))} | "
            f"{_ms(c.get('itl_p50'))} / {_ms(c.get('itl_p99'))} | {'—' if tau is None else f'{tau:.2f}'} | "
            f"{'—' if drafts is None else f'{drafts:.2f}'} | {prompt} | {shares} | {c['failures']} |"
        )
    paired = [c for c in cells if "auto_vs_best" in c]
    if paired:
        lines += [
            "",
            "`--k auto` against the best of none and the method's fixed Ks at the same concurrency, "
            "paired by turn (the goal: ≥ 0.95×):",
            "",
            "| method | C | median | turns |",
            "|---|---|---|---|",
        ]
        for c in paired:
            turns = ", ".join(f"{r:.2f}" for r in c["auto_vs_best_turns"])
            lines.append(
                f"| {c['method']} k=auto | {c['concurrency']} | {c['auto_vs_best']:.2f}× | {turns} |"
            )
    atomic_write(out / "results.md", "\n".join(lines) + "\n")
    _chart(cells, out / "tokens_per_second")
    return out


def _chart(cells: list[dict], path: Path) -> None:
    from verispec.viz.figures import figure_style, new_figure, save_figure

    with figure_style():
        fig = new_figure(7, 4)
        ax = fig.add_subplot()
        labels = dict.fromkeys(c["method"] + (f" k={c['k']}" if c.get("k") else "") for c in cells)
        for label in labels:
            mine = [c for c in cells if c["method"] + (f" k={c['k']}" if c.get("k") else "") == label]
            ax.plot(
                [c["concurrency"] for c in mine],
                [c["tokens_per_second"] for c in mine],
                marker="o",
                label=label,
            )
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_xscale("log", base=2)
        ax.legend()
    save_figure(fig, path)

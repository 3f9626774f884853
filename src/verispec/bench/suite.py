"""``verispec bench``: one task suite run by every method side by side — verispec's drafters and transformers'
own generation on the same weights — written as ``results.json``, ``results.md`` and PNG charts.

Tasks (Spec-Bench style, ``verispec/data/tasks/*.jsonl``): multi-turn chat, summarization of a passage,
question answering over a passage (RAG), math word problems, code completion, code editing, translation;
and agentic sequences of requests, each fed the earlier outputs (:mod:`verispec.bench.workloads`): a
tool-calling agent loop, a code-editing loop, a chat quoting itself; and an agent loop of real tool calls,
each turn under the tools' grammar and the calls answered by fake tools (``agent_calls``:
:mod:`verispec.bench.agent`; its unconstrained baseline ``none-unconstrained``, tool_choice none on ``none``'s
conversations). ``--prompts FILE`` adds a JSONL file of
one's own (see :func:`load_prompts`). A drafter with a cache shared across requests (``suffix``) runs cold
and, as ``suffix-warm``, from the cache the workload's first pass left.

Methods (:func:`plan_methods`): verispec ``none`` (plain decoding in the engine: the baseline of every
speedup), then every other drafter of :data:`verispec.drafting.registry.DRAFTERS` (those that need a draft
model only with ``--draft``, ``eagle`` only with a learned drafter for the target: ``--drafter-path`` or the
one verispec ships), once per ``--k``; and the peers of :mod:`verispec.bench.peers`: transformers' plain
``generate``, assisted generation with the same draft and each numeric K, prompt lookup with each numeric K;
llama.cpp on the target's GGUF file (where llama-cpp-python is installed and the target came from a GGUF),
plain and with its prompt lookup at each numeric K.
With ``--trees``, the tree methods ``ngram-tree`` and ``model-tree`` run once per tree shape, each beside its
chain method at K = N − 1 for a tree of N nodes: the same target-forward size, compared in the report.

Timing: the same prompts and max_new_tokens for every method; each method runs once untimed first; then
``repetitions`` rounds in which every method runs every prompt of the task in turn (method-major, and the
method order rotates from one repetition to the next, so that a slow spell of the machine is shared out).
One *sample* is one method over all of a task's prompts; tokens/s is its tokens over its wall time, and the
table shows the median over repetitions with the min–max spread. Sampled runs (``--temperature T > 0``) use
the same seed for every method at a given (repetition, prompt).

Metrics per method × task (:func:`cell_metrics`): tokens/s end to end (prompt prefill included) and decoding
tokens/s (prefill excluded); speedups vs transformers plain ``generate``, llama.cpp plain and verispec
``none``; tokens per
target call τ and the mean positions per verification forward (verispec); acceptance rate and per-position
acceptance; the split of wall time into prefill, draft, target (verification forwards) and other; peak RSS;
the speedup the analytic model predicts from the measured acceptance and the calibrated costs
(:func:`predicted_speedup`; chains only), and efficiency = measured decoding speedup vs ``none`` /
predicted. Every greedy output is compared token for token with ``none``'s, a peer's speculative output with
its own plain output.

``results.json`` is rewritten atomically after every sample, so an interrupted bench keeps every finished
cell; the report (:mod:`verispec.bench.report`) is drawn from it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import re
import resource
import shlex
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm

from verispec import __version__
from verispec.api import Speculator
from verispec.bench.agent import Agent, read_reply, run_loop
from verispec.bench.goals import load_goals
from verispec.bench.methods import (
    CONSTRAINED,
    CROSS_METHODS,
    LLAMACPP_PEERS,
    METHODS,
    PEERS,
    TASKS,
    TOOLS_FREE,
    TRANSFORMERS_PEERS,
    TREE_METHODS,
    results_dir,
)
from verispec.bench.metrics import add_samples, cell_metrics
from verispec.bench.peers import (
    LlamaCppPeer,
    PeerRequest,
    TransformersPeer,
    llamacpp_missing,
    load_transformers,
)
from verispec.bench.prompts import Prompt, builtin_tasks, load_prompts
from verispec.bench.records import Calibration as CalibrationRecord
from verispec.bench.records import Cell, Identity, Machine, Results, Sample, Validity
from verispec.bench.report import write_report
from verispec.bench.schemas import valid_json
from verispec.bench.workloads import WARM, CacheSnapshots
from verispec.choice import DEFAULT_PRECISION, ModelChoice
from verispec.costs.analytic import CostModel
from verispec.costs.calibrate import Calibration, cpu_name
from verispec.drafting.learned.head import read_drafter_file
from verispec.drafting.learned.kinds import shipped_drafter
from verispec.drafting.registry import DRAFT_MODEL, DRAFTERS, PLAIN, early_exit_layers
from verispec.drafting.suffix_cache import SuffixCache
from verispec.drafting.tree import AUTO, TreeShape
from verispec.engine.sequence import GenerationStats
from verispec.errors import UsageError
from verispec.files import atomic_write
from verispec.grammar.tools import Tools
from verispec.inputs import check_int, check_seed
from verispec.models.base import LanguageModel, Tokenizer, has_chat_template
from verispec.models.gguf import source_gguf
from verispec.models.names import DEFAULT_MODEL
from verispec.models.registry import gguf_file, model_dir
from verispec.options import DraftLength, GenerationOptions, SamplingParams
from verispec.resolve import Target
from verispec.viz.charts import chart_directory

__all__ = [
    "METHODS",
    "TASKS",
    "Bench",
    "BenchConfig",
    "Method",
    "memory_mib",
    "plan_methods",
]

BASELINE, PEER_BASELINE, LLAMACPP_BASELINE = "none", TRANSFORMERS_PEERS[0], LLAMACPP_PEERS[0]
# a constrained cell's baselines: the same constraint without speculation, in verispec and in llama.cpp
JSON_BASELINE, LLAMACPP_JSON = f"{BASELINE}{CONSTRAINED}", f"{LLAMACPP_BASELINE}{CONSTRAINED}"
K_FREE = (BASELINE, PEER_BASELINE, LLAMACPP_BASELINE, JSON_BASELINE, LLAMACPP_JSON, TOOLS_FREE)
# the plain run each speculative peer's greedy output must equal
PLAIN_PEER = {
    "transformers-assisted": PEER_BASELINE,
    "transformers-lookup": PEER_BASELINE,
    "llamacpp-lookup": LLAMACPP_BASELINE,
}
_RECALIBRATION = 10  # repetitions of a calibration the bench measures


# ---------------------------------------------------------------------------------------------- config


def _split(text: str | Sequence[str]) -> tuple[str, ...]:
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(item.strip() for item in items if item.strip())


@dataclass(frozen=True)
class BenchConfig:
    """What a bench run measures; validated with one-line UsageErrors before any model is loaded.

    tasks: built-in task names (None: all of them); the tasks of ``prompts_file`` are always added.
    methods: names from :data:`METHODS` (None: all that apply; those needing a draft only with ``draft``).
    drafter_path: a learned drafter for the method of its kind (a ``learned`` kind of the registry; the
    others, and every kind when None: the files shipped for the target, if any).
    ks: draft lengths, each an integer or "auto" (and "additive"); K-free methods run once.
    trees: token-tree shapes ("WxD" or a JSON shape file) for the tree methods (``ngram-tree``,
    ``model-tree``), which run only with them; each tree of N nodes also brings its chain method at
    K = N − 1, the same target-forward size.
    temperatures: 0 is greedy; each one is a separate table.
    prompts_per_task: the first N prompts of each task (None: all).
    threads: torch threads for every method (None: torch's current setting).
    recalibrate: measure the costs again before the run (else the cached calibration, measured if absent).
    goals: a TOML file of speed goals to judge (:mod:`verispec.bench.goals`), recorded with the results.
    precision: the weights of verispec's target and draft (fp32, fp16, auto: see
    :class:`~verispec.api.Speculator`); the transformers peers run in float32.
    out: the output directory (created).
    """

    target: str = DEFAULT_MODEL
    tokenizer: str | None = None
    draft: str | None = None
    draft_tokenizer: str | None = None
    drafter_path: str | None = None
    tasks: tuple[str, ...] | None = None
    prompts_file: str | None = None
    methods: tuple[str, ...] | None = None
    ks: tuple[str, ...] = ("4", "auto")
    trees: tuple[str, ...] = ()
    max_new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0,)
    repetitions: int = 3
    prompts_per_task: int | None = None
    threads: int | None = None
    seed: int = 0
    recalibrate: bool = False
    goals: str | None = None
    precision: str = DEFAULT_PRECISION
    out: str = ""

    def __post_init__(self) -> None:
        check_int(self.max_new_tokens, "max_new_tokens", 1)
        check_int(self.repetitions, "repetitions", 1)
        for name, value in (("prompts per task", self.prompts_per_task), ("threads", self.threads)):
            if value is not None:
                check_int(value, name, 1)
        # each (repetition, prompt) draws with seed + 1000 · repetition + index: room above the seed
        check_seed(self.seed, below=2**62)
        if not self.ks:
            raise UsageError("give at least one K")
        object.__setattr__(self, "ks", tuple(dict.fromkeys(str(DraftLength.parse(k)) for k in self.ks)))
        object.__setattr__(self, "trees", tuple(dict.fromkeys(self.trees)))
        for spec in self.trees:
            TreeShape.parse(spec)  # UsageError for a malformed shape
        asked = [m for m in self.methods or () if m in TREE_METHODS]
        if asked and not self.trees:
            raise UsageError(f"method {asked[0]!r} needs tree shapes (--trees WxD or a shape file)")
        if not self.temperatures or not all(
            isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 for t in self.temperatures
        ):
            raise UsageError(f"temperatures must be finite numbers >= 0, got {self.temperatures!r}")
        if self.methods is not None:
            unknown = [m for m in self.methods if m not in METHODS]
            if unknown or not self.methods:
                raise UsageError(
                    f"unknown method {unknown[0] if unknown else ''!r}; choose from {', '.join(METHODS)}"
                )
        if self.goals is not None:
            load_goals(self.goals)  # UsageError for a missing or malformed file, before any model loads
        if not self.out:
            object.__setattr__(self, "out", results_dir("bench"))

    def command_line(self) -> str:
        """The ``verispec bench`` command that runs this configuration (the output directory aside)."""
        parts = ["verispec", "bench"]
        options = {
            "--target": None if self.target == DEFAULT_MODEL else self.target,
            "--tokenizer": self.tokenizer,
            "--draft": self.draft,
            "--draft-tokenizer": self.draft_tokenizer,
            "--drafter-path": self.drafter_path,
            "--tasks": None if self.tasks is None else ",".join(self.tasks),
            "--prompts": self.prompts_file,
            "--methods": None if self.methods is None else ",".join(self.methods),
            "--k": ",".join(self.ks),
            "--trees": ",".join(self.trees) or None,
            "--max-new-tokens": str(self.max_new_tokens),
            "--temperature": ",".join(f"{t:g}" for t in self.temperatures),
            "--repetitions": str(self.repetitions),
            "--prompts-per-task": None if self.prompts_per_task is None else str(self.prompts_per_task),
            "--threads": None if self.threads is None else str(self.threads),
            "--seed": str(self.seed) if self.seed else None,
            "--goals": self.goals,
            "--precision": None if self.precision == DEFAULT_PRECISION else self.precision,
        }
        for flag, value in options.items():
            if value is not None:
                parts += [flag, value]
        if self.recalibrate:
            parts.append("--recalibrate")
        return shlex.join(parts)


def select_tasks(config: BenchConfig) -> dict[str, list[Prompt]]:
    """The tasks to run → their prompts: the chosen built-in tasks, plus every task of the prompts file."""
    builtin = builtin_tasks()
    extra: dict[str, list[Prompt]] = {}
    if config.prompts_file is not None:
        for prompt in load_prompts(config.prompts_file):
            extra.setdefault(prompt.task, []).append(prompt)
    known = {**builtin, **extra}
    names = list(TASKS) if config.tasks is None else list(config.tasks)
    unknown = [t for t in names if t not in known]
    if unknown:
        raise UsageError(f"unknown task {unknown[0]!r}; choose from {', '.join(known)}")
    names += [t for t in extra if t not in names]
    return {name: known[name][: config.prompts_per_task] for name in dict.fromkeys(names)}


@dataclass(frozen=True)
class Method:
    """One row of the table: a method and its K ("" where K does not apply)."""

    name: str
    k: str = ""

    @property
    def label(self) -> str:
        return f"{self.name} k={self.k}" if self.k else self.name

    @property
    def is_peer(self) -> bool:
        return self.name in PEERS

    @property
    def constrained(self) -> bool:
        """Whether each output is held to its prompt's schema (run on tasks whose prompts bring one)."""
        return self.name.endswith(CONSTRAINED)

    @property
    def base(self) -> str:
        """The method without its constraint: the speculator or peer that runs it."""
        return BASELINE if self.name == TOOLS_FREE else self.name.removesuffix(CONSTRAINED)

    def runs_on(self, prompts: Sequence[Prompt]) -> bool:
        """Whether this method runs on a task of ``prompts``: a constrained one where a prompt brings a
        schema, the unconstrained baseline of tool calls where one calls tools, a peer where none does."""
        tools = any(p.agent for p in prompts)
        if self.constrained:
            return any(p.constraint for p in prompts)
        return tools if self.name == TOOLS_FREE else not (tools and self.is_peer)


def learned_drafter(config: BenchConfig, kind: str) -> str | None:
    """The learned drafter of the method ``kind`` (a ``learned`` kind of the registry): ``drafter_path`` when
    the file is of that kind, else the file of that kind shipped for the target."""
    if (
        config.drafter_path is not None
        and read_drafter_file(config.drafter_path, tensors=False)[0].get("kind") == kind
    ):
        return config.drafter_path
    shipped = shipped_drafter(config.target, kind)
    return None if shipped is None else str(shipped)


def llamacpp_gguf(config: BenchConfig) -> Path | None:
    """The GGUF file llama.cpp runs for the target: the SPEC itself, or the file a converted model came from
    (kept in the cache for the short names). None for targets of other formats."""
    gguf = gguf_file(config.target)  # a short name's is downloaded, not converted
    if gguf is not None or Path(str(config.target)).suffix in (".gguf", ".bin"):
        return gguf
    return source_gguf(model_dir(config.target))


def chain_k(shape: TreeShape) -> str:
    """The K of the chain method a tree method runs beside: the same most positions per forward (a dynamic
    tree sized by the costs: K auto, sized by them too)."""
    return AUTO if shape.budget == AUTO else str(shape.max_forward - 1)


def plan_methods(config: BenchConfig) -> tuple[list[Method], list[str]]:
    """The methods to run, and notes on those left out (and why). UsageError when an explicitly chosen
    method cannot run (a draft-model method without ``--draft``)."""
    chosen = METHODS if config.methods is None else config.methods
    model_drafters = [name for name, kind in DRAFTERS.items() if kind.needs_draft_model]
    needs_draft = {*model_drafters, *(f"{name}-tree" for name in model_drafters), *CROSS_METHODS}
    needs_draft |= {f"{name}{CONSTRAINED}" for name in model_drafters}
    needs_draft.add("transformers-assisted")
    numeric = [k for k in config.ks if k.isdigit()]
    methods, notes = [], []
    for name in METHODS:
        if name not in chosen or (name in TREE_METHODS and not config.trees):
            continue
        if name in needs_draft and config.draft is None:
            if config.methods is not None:
                raise UsageError(f"method {name!r} needs a draft model (--draft SPEC)")
            notes.append(f"{name}: no --draft given")
            continue
        if name in CROSS_METHODS and config.methods is None:
            notes.append(f"{name}: runs when --methods names it, with a draft of another tokenizer")
            continue
        if name == "transformers-assisted" and config.draft_tokenizer is not None:
            uag = "universal assisted generation needs both tokenizers in transformers' format"
            if config.methods is not None:
                raise UsageError(f"method {name!r} cannot run with --draft-tokenizer: {uag}")
            notes.append(f"{name}: {uag}")
            continue
        kind = DRAFTERS.get(name.removesuffix("-tree").removesuffix(CONSTRAINED))
        if kind is not None and kind.learned and learned_drafter(config, kind.head_kind) is None:
            if config.methods is not None:
                raise UsageError(f"method {name!r} needs a learned drafter (--drafter-path FILE)")
            notes.append(f"{name}: no learned drafter for this target (--drafter-path FILE)")
            continue
        if name in LLAMACPP_PEERS:
            why = llamacpp_missing() or (None if llamacpp_gguf(config) else "the target is not from a GGUF")
            if why is not None:
                if config.methods is not None:
                    raise UsageError(f"method {name!r} cannot run: {why}")
                notes.append(f"{name}: {why}")
                continue
        if name in K_FREE:
            methods.append(Method(name))
        elif name in PEERS:
            methods += [Method(name, k) for k in numeric]
            if not numeric:
                notes.append(f"{name}: runs only at numeric K (--k gave {', '.join(config.ks)})")
        elif name in TREE_METHODS:
            for spec in config.trees:  # the tree, then its chain at the same forward size
                shape = TreeShape.parse(spec)
                if shape.budget is not None and not (kind is not None and kind.dynamic_trees):
                    notes.append(f"{name} {spec}: dynamic trees need the eagle drafter")
                    continue
                chain = Method(name.removesuffix("-tree"), chain_k(shape))
                methods += [Method(name, spec)] + ([chain] if chain not in methods else [])
        else:
            methods += [Method(name, k) for k in config.ks]
    return methods, notes


# ---------------------------------------------------------------------------------------------- memory


def memory_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB: VmRSS and VmHWM, or getrusage's peak."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    found = [re.search(rf"{k}:\s+(\d+)", status) for k in ("VmRSS", "VmHWM")]
    if found[0] and found[1]:
        return float(found[0].group(1)) / 1024, float(found[1].group(1)) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak, peak


def _reset_peak_memory() -> bool:
    """Reset the process's peak RSS (Linux ≥ 4.0, ``/proc/self/clear_refs``); False where impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------- the run


@dataclass
class _Cell:
    """The samples of one method on one task at one temperature, and its greedy outputs."""

    task: str
    temperature: float
    method: Method
    samples: list[Sample] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # prompt id → generated ids (first sample)
    invalid: dict[str, int] = field(default_factory=dict)  # prompt id → its outputs not valid for its schema
    checked: int = 0  # outputs checked against their prompt's schema (every sample's); a tool task's calls
    cut: int = 0  # a tool task's calls cut off by the token limit (not checked)


class Bench:
    """Loads the target, the draft and the transformers peers; :meth:`run` measures every cell."""

    def __init__(
        self,
        config: BenchConfig,
        tasks: dict[str, list[Prompt]],
        methods: list[Method],
        notes: Sequence[str] = (),
    ) -> None:
        """``tasks``, ``methods``: from :func:`select_tasks` and :func:`plan_methods`; ``notes``: the methods
        left out, and why (recorded in the results). A method runs on the tasks :meth:`Method.runs_on`
        allows, and is left out (noted) where there is none; a task of tool calls needs a chat template (the
        default tasks' is left out without one, noted; one asked for is refused)."""
        self.notes = list(notes)
        self.config = config
        self.goals = [] if config.goals is None else load_goals(config.goals)
        self.out = chart_directory(config.out)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        choice = ModelChoice(
            target=str(config.target), tokenizer=config.tokenizer, precision=config.precision, drafter=PLAIN
        )
        self.target = Target.load(choice)  # once, every method's drafter beside it
        base = Speculator.on(self.target)
        self.tokenizer = base.tokenizer
        self.chat = has_chat_template(self.tokenizer)
        self.tasks = self._chat_tasks(tasks)
        self.methods = self._applicable(methods)
        methods = self.methods
        self.speculators = {BASELINE: base}
        chains = (m.base for m in methods if not m.is_peer and m.base not in (BASELINE, *TREE_METHODS))
        for name in dict.fromkeys(chains):
            kind = DRAFTERS[DRAFT_MODEL if name in CROSS_METHODS else name.removesuffix(WARM)]
            path = learned_drafter(config, kind.head_kind) if kind.learned else None
            self.speculators[name] = Speculator.on(
                self.target,
                drafter=kind.name,
                draft=config.draft if kind.needs_draft_model else None,
                drafter_path=path,
                draft_tokenizer=config.draft_tokenizer if kind.needs_draft_model else None,
                cross_tokenizer=CROSS_METHODS.get(name, "auto"),
            )
        self.trees = {m.label: self._tree_speculator(m) for m in methods if m.name in TREE_METHODS}
        self.snapshots = CacheSnapshots()  # the warm caches of the shared-cache methods
        # a tool task's conversations before each turn, by none's loop: what its unconstrained baseline runs
        self.conversations: dict[tuple[str, str, SamplingParams], list[list[dict[str, Any]]]] = {}
        self.prompt_ids = {
            (p.task, p.id): base.encode_prompt(
                p.for_model(self.chat), self.chat, p.agent.tools if p.agent else None
            )
            for prompts in self.tasks.values()
            for p in prompts
        }
        room = base.model.max_context - config.max_new_tokens
        for (task, prompt_id), ids in self.prompt_ids.items():
            if len(ids) > room:
                raise UsageError(
                    f"prompt {prompt_id} of task {task} has {len(ids)} tokens: with {config.max_new_tokens} "
                    f"new tokens it overflows the target's context of {base.model.max_context}"
                )
        self.llamacpp: LlamaCppPeer | None = None
        if any(m.name in LLAMACPP_PEERS for m in methods):
            gguf = llamacpp_gguf(config)
            assert gguf is not None  # planned only then
            context = max(len(ids) for ids in self.prompt_ids.values()) + config.max_new_tokens + 16
            self.llamacpp = LlamaCppPeer(gguf, torch.get_num_threads(), context)
        self.peer: TransformersPeer | None = None
        if any(m.name in TRANSFORMERS_PEERS for m in methods):
            assistant = None
            if any(m.name == "transformers-assisted" for m in methods):
                assistant = _load_assistant(config)
            self.peer = TransformersPeer(load_transformers(config.target, config.tokenizer), assistant)
        self.calibrations: dict[str, Calibration] = {
            name: speculator.calibration(
                force=config.recalibrate and name == BASELINE, repetitions=_RECALIBRATION
            )
            for name, speculator in self.speculators.items()  # the baseline first: it clears the cache
        }
        self.cells = [
            _Cell(task, t, m)
            for task, prompts in self.tasks.items()
            for t in config.temperatures
            for m in methods
            if m.runs_on(prompts)
        ]
        self.started_at = _now()
        self.load_at_start = os.getloadavg()
        self.exact_peaks = _reset_peak_memory()

    def _chat_tasks(self, tasks: dict[str, list[Prompt]]) -> dict[str, list[Prompt]]:
        """``tasks`` but those that call tools where the target has no chat template to render them in:
        left out (noted) when the tasks are the default ones, else a UsageError."""
        calling = [task for task, prompts in tasks.items() if any(p.agent for p in prompts)]
        if self.chat or not calling:
            return tasks
        if self.config.tasks is not None:
            raise UsageError(
                f"task {calling[0]} calls tools, rendered in the chat template: the target has none"
            )
        self.notes += [f"task {task}: calls tools, and the target has no chat template" for task in calling]
        return {task: prompts for task, prompts in tasks.items() if task not in calling}

    def _applicable(self, methods: list[Method]) -> list[Method]:
        """``methods`` but those that run on none of the tasks (noted, and why)."""
        kept = []
        for m in methods:
            if any(m.runs_on(prompts) for prompts in self.tasks.values()):
                kept.append(m)
            elif m.constrained:
                self.notes.append(f"{m.label}: no task with schemas (json)")
            else:
                self.notes.append(f"{m.label}: no task with tool calls" if m.name == TOOLS_FREE
                                  else f"{m.label}: tool tasks only, where peers do not run")  # fmt: skip
        calling = [task for task, prompts in self.tasks.items() if any(p.agent for p in prompts)]
        if calling and any(m.is_peer for m in kept):
            self.notes.append(f"the peers: not on {', '.join(calling)} (tool calls)")
        return kept

    def _tree_speculator(self, method: Method) -> Speculator:
        """A tree method's speculator: its chain method's models (already loaded), drafting the tree."""
        chain = self.speculators[method.name.removesuffix("-tree")]  # planned with every tree method
        draft: str | tuple[LanguageModel, Tokenizer] | None = None
        if chain.parts.early_exit:  # layers:N reads the target's cache: named again, nothing to load
            draft = self.config.draft
        elif chain.draft is not None:
            draft = (chain.draft, self.tokenizer)
        return Speculator.on(
            self.target,
            drafter=chain.drafter_name,
            draft=draft,
            drafter_path=learned_drafter(self.config, chain.kind.head_kind) if chain.kind.learned else None,
            tree=TreeShape.parse(method.k),
        )

    # ------------------------------------------------------------------ generation

    def _sampling(self, temperature: float, repetition: int, index: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=self.config.seed + 1000 * repetition + index)

    def _generate(
        self, method: Method, prompt: Prompt, sampling: SamplingParams, cache: SuffixCache | None = None
    ) -> tuple[list[int], Sample]:
        """One prompt's generations, a sequence's in order, each fed the replies before it: their token ids
        and counters and timings, added up. ``cache``: what a shared-cache method drafts from (None:
        empty)."""
        cache = SuffixCache() if cache is None else cache
        ids: list[int] = []
        records: list[Sample] = []
        replies: list[str] = []
        if not method.is_peer:  # an empty cache, as the peers start from: no cell skips a prefill paid before
            self._speculator(method).forget()
        if prompt.agent is not None:
            return self._agent_loop(method, prompt, prompt.agent, sampling, cache)
        for _ in range(len(prompt.follow_ups) + 1):  # later turns keep the conversation, as a user's would
            out, record = self._generate_one(method, prompt.turn(replies), sampling, cache)
            ids += out
            records.append(record)
            replies.append(self.tokenizer.decode(out))
        return ids, add_samples(records)

    def _agent_loop(
        self, method: Method, prompt: Prompt, agent: Agent, sampling: SamplingParams, cache: SuffixCache
    ) -> tuple[list[int], Sample]:
        """An agent item's loop (:func:`~verispec.bench.agent.run_loop`), each turn one generation with its
        tools; the unconstrained baseline (tool_choice none) generates from the conversations ``none``'s loop
        generated from, each turn's (that loop run first, untimed, where it has not run yet). A conversation
        that outgrows the context ends the loop."""
        ids: list[int] = []
        records: list[Sample] = []
        tools = agent.tools if method.name != TOOLS_FREE else dataclasses.replace(agent.tools, choice="none")
        room = self.speculators[BASELINE].model.max_context - self.config.max_new_tokens

        def reply(conversation: list[dict[str, Any]]) -> str | None:
            if len(self.speculators[BASELINE].encode_prompt(conversation, True, tools)) > room:
                return None
            out, record = self._generate_one(method, prompt, sampling, cache, (conversation, tools))
            ids.extend(out)
            records.append(record)
            return self.tokenizer.decode(out)

        key = (prompt.task, prompt.id, sampling)
        if method.name == TOOLS_FREE:
            if key not in self.conversations:
                self._generate(Method(BASELINE), prompt, sampling)
                self._speculator(method).forget()  # none's last turn: not this run's to keep
            for conversation in self.conversations[key]:
                reply(conversation)
            calls, valid, cut = 0, 0, 0
        else:
            messages = cast(list[dict[str, Any]], prompt.for_model(True))
            loop = run_loop(tools, agent.turns, messages, reply, read_reply)
            if method.name == BASELINE:
                self.conversations[key] = loop.conversations
            calls, valid, cut = len(loop.calls), loop.valid, loop.cut
        record = add_samples(records)
        record["turns"], record["tool_calls"] = len(records), calls
        record["valid_tool_calls"], record["cut_tool_calls"] = valid, cut
        return ids, record

    def _generate_one(
        self,
        method: Method,
        prompt: Prompt,
        sampling: SamplingParams,
        cache: SuffixCache,
        turn: tuple[list[dict[str, Any]], Tools] | None = None,
    ) -> tuple[list[int], Sample]:
        """One generation: its token ids and its counters and timings; ``turn``: an agent loop's (the
        conversation so far and the tools), instead of ``prompt``'s messages."""
        _reset_peak_memory()
        rss_before, _ = memory_mib()
        if method.is_peer:
            ids, record = self._generate_peer(method, prompt, sampling)
        else:
            ids, record = self._generate_verispec(method, prompt, sampling, cache, turn)
        _, peak = memory_mib()
        record["peak_rss_mib"], record["rss_growth_mib"] = peak, max(0.0, peak - rss_before)
        return ids, record

    def _speculator(self, method: Method) -> Speculator:
        return self.trees.get(method.label) or self.speculators[method.base]

    def _generate_verispec(
        self,
        method: Method,
        prompt: Prompt,
        sampling: SamplingParams,
        cache: SuffixCache,
        turn: tuple[list[dict[str, Any]], Tools] | None,
    ) -> tuple[list[int], Sample]:
        speculator = self._speculator(method)
        k = method.k or 0
        stats = GenerationStats(method.name, str(k))
        options = GenerationOptions(
            k=DraftLength.parse(k) if speculator.tree is None else DraftLength(fixed=0),  # a tree: no K
            max_new_tokens=self.config.max_new_tokens,
            sampling=sampling,
            chat=self.chat,
            constraint=prompt.constraint if method.constrained else None,
            tools=None if turn is None else turn[1],
        )
        start = time.perf_counter()
        text = prompt.for_model(self.chat) if turn is None else turn[0]
        if speculator.kind.shared_cache:
            speculator.suffix_cache = cache  # this sample's: empty, or warm from the workload's first pass
        ids = [t for chunk in speculator.stream(text, options, stats=stats) for t in chunk.token_ids]
        seconds = time.perf_counter() - start
        return ids, {
            "tokens": len(ids),
            "decode_tokens": len(ids),
            "seconds": seconds,
            "prefill": stats.prefill_seconds,
            "draft": stats.draft_seconds,
            "target": stats.target_seconds,
            "calls": stats.target_calls,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "drafted_per_position": list(stats.drafted_per_position),
            "accepted_per_position": list(stats.accepted_per_position),
            "tree_nodes": stats.tree_nodes,
            "forced": stats.forced,
            "cached_prompt_tokens": stats.cached_prompt_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "peak_rss_mib": 0.0,  # measured by _generate
            "rss_growth_mib": 0.0,
            "prompts": 1,
        }

    def _generate_peer(
        self, method: Method, prompt: Prompt, sampling: SamplingParams
    ) -> tuple[list[int], Sample]:
        peer = self.llamacpp if method.name in LLAMACPP_PEERS else self.peer
        assert peer is not None, "peers are loaded with the methods that need them"
        key = (prompt.task, prompt.id)
        ids = self.prompt_ids.get(key) or self.speculators[BASELINE].encode_prompt(
            prompt.for_model(self.chat), self.chat
        )  # a sequence's later requests: encoded as they come
        request = PeerRequest(
            prompt_ids=ids,
            method=method.name,
            k=int(method.k or 0),
            max_new_tokens=self.config.max_new_tokens,
            eos_token_ids=self.tokenizer.eos_token_ids,
            temperature=sampling.temperature,
            seed=sampling.seed,
            json_schema=prompt.constraint.text if method.constrained and prompt.constraint else None,
        )
        run = peer.generate(request)
        tokens = len(run.token_ids)
        accepted = tokens - run.target_calls  # each round emits its accepted tokens and one more
        return run.token_ids, {
            "tokens": tokens,
            "decode_tokens": max(tokens - 1, 0),  # the prefill yields the first token (both peers)
            "seconds": run.total_seconds,
            "prefill": run.prefill_seconds,
            "draft": run.draft_seconds,
            "target": run.target_seconds - run.prefill_seconds,
            "calls": run.target_calls,
            "drafted": run.draft_calls,  # one assistant forward per drafted token (0 for the others)
            "accepted": accepted if run.draft_calls else 0,
            "drafted_per_position": [],
            "accepted_per_position": [],
            "tree_nodes": 0,
            "forced": 0,
            "cached_prompt_tokens": 0,
            "prompt_tokens": len(ids),
            "peak_rss_mib": 0.0,  # measured by _generate
            "rss_growth_mib": 0.0,
            "prompts": 1,
        }

    def _sample(self, cell: _Cell, repetition: int, tick: Callable[[], None]) -> None:
        """One sample: the cell's method over every prompt of its task (a shared-cache method from an empty
        cache, or a warm one: :class:`~verispec.bench.workloads.CacheSnapshots`)."""
        records = []
        prompts = self.tasks[cell.task]

        def first_pass(cache: SuffixCache) -> None:
            for index, prompt in enumerate(prompts):
                self._generate(cell.method, prompt, self._sampling(cell.temperature, 0, index), cache)

        cache = self.snapshots.cache_for(cell.method.name, cell.task, first_pass)
        for index, prompt in enumerate(prompts):
            ids, record = self._generate(
                cell.method, prompt, self._sampling(cell.temperature, repetition, index), cache
            )
            cell.outputs.setdefault(prompt.id, ids)
            if prompt.constraint is not None:
                cell.checked += 1
                if not valid_json(self.tokenizer.decode(ids), prompt.constraint.text):
                    cell.invalid[prompt.id] = cell.invalid.get(prompt.id, 0) + 1
            if prompt.agent is not None and cell.method.name != TOOLS_FREE:  # its calls, checked by the loop
                calls, valid = record.get("tool_calls", 0), record.get("valid_tool_calls", 0)
                cell.checked += calls
                cell.cut += record.get("cut_tool_calls", 0)
                if valid < calls:
                    cell.invalid[prompt.id] = cell.invalid.get(prompt.id, 0) + calls - valid
            records.append(record)
            tick()
        cell.samples.append(add_samples(records))

    # ------------------------------------------------------------------ the loop

    def run(self, progress: bool = True) -> Results:
        """Warm every method up, then measure every cell; returns the results (also in results.json, with
        the report beside it). On KeyboardInterrupt (Ctrl-C, or a SIGTERM, which is turned into one while the
        bench runs in the main thread) the finished cells are written with their report, then it
        propagates."""
        with _terminate_as_interrupt():
            return self._run(progress)

    def _run(self, progress: bool) -> Results:
        config = self.config
        per_rep = sum(len(p) for p in self.tasks.values()) * len(config.temperatures) * len(self.methods)
        bar = tqdm(
            total=per_rep * config.repetitions + len(self.methods),
            desc="bench",
            unit="gen",
            file=sys.stderr,
            disable=not progress,  # shown in logs too: a bench runs for minutes
        )
        try:
            for method in self.methods:  # warm-up: first calls build kernels and caches
                bar.set_postfix_str(f"warm-up {method.label}")
                cell = next(c for c in self.cells if c.method == method)  # a task it runs on
                first = self.tasks[cell.task][0]
                self._generate(method, first, self._sampling(config.temperatures[0], 0, 0))
                bar.update()
            for task in self.tasks:
                for temperature in config.temperatures:
                    cells = [c for c in self.cells if c.task == task and c.temperature == temperature]
                    for repetition in range(config.repetitions):
                        shift = repetition % len(cells)
                        for cell in cells[shift:] + cells[:shift]:
                            where = f"{task} T={temperature:g} rep {repetition + 1}/{config.repetitions}"
                            bar.set_postfix_str(f"{where} {cell.method.label}")
                            self._sample(cell, repetition, bar.update)
                            self.write()
        except KeyboardInterrupt:
            bar.close()
            self._finish(interrupted=True)
            raise
        bar.close()
        return self._finish(interrupted=False)

    def _finish(self, interrupted: bool) -> Results:
        results = self.write(finished=True, interrupted=interrupted)
        write_report(results, self.out)
        return results

    # ------------------------------------------------------------------ results

    def results(self, finished: bool = False, interrupted: bool = False) -> Results:
        """Everything measured so far, with the metrics of every cell."""
        config = self.config
        cells: list[Cell] = []
        for cell in self.cells:
            tree = TreeShape.parse(cell.method.k) if cell.method.name in TREE_METHODS else None
            record: Cell = {
                "task": cell.task,
                "temperature": cell.temperature,
                "method": cell.method.name,
                "k": cell.method.k,
                "label": cell.method.label,
                "complete": len(cell.samples) == config.repetitions,
                "samples": cell.samples,
                "peer_acceptance_unknown": cell.method.name in ("transformers-lookup", "llamacpp-lookup"),
                "tree_nodes": None if tree is None or tree.budget == AUTO else tree.max_forward,
                "outputs": cell.outputs,
                "schema_valid": _validity(cell),
            }
            if tree is not None:
                record["chain_k"] = chain_k(tree)
            cells.append(record)
        by_key = {(c["task"], c["temperature"], c["label"]): c for c in cells}
        for c in cells:  # the baselines first: the other cells' speedups divide by theirs
            if c["label"] in K_FREE:
                c["metrics"] = cell_metrics(c, None, None, None, self._cost(c))
        for c in cells:
            constrained = c["method"].endswith(CONSTRAINED)  # against the same constraint's baselines
            none_name, llamacpp_name = (
                (JSON_BASELINE, LLAMACPP_JSON) if constrained else (BASELINE, LLAMACPP_BASELINE)
            )
            none, peer, llamacpp = (
                by_key.get((c["task"], c["temperature"], name))
                for name in (none_name, PEER_BASELINE, llamacpp_name)
            )
            c["metrics"] = cell_metrics(c, none, peer, llamacpp, self._cost(c))
            plain_name = PLAIN_PEER.get(c["method"], none_name)
            plain = by_key.get((c["task"], c["temperature"], plain_name))
            c["greedy_identity"] = None if c["method"] == TOOLS_FREE else _identity(c, plain)
        return {
            "version": 1,
            "verispec": __version__,
            "command": config.command_line(),
            "config": {
                "target": config.target,
                "draft": config.draft,
                "tasks": list(self.tasks),
                "prompts": {task: len(prompts) for task, prompts in self.tasks.items()},
                "methods": [m.label for m in self.methods],
                "ks": list(config.ks),
                "max_new_tokens": config.max_new_tokens,
                "temperatures": list(config.temperatures),
                "repetitions": config.repetitions,
                "seed": config.seed,
                "chat_template": self.chat,
            },
            "machine": self._machine(),
            "calibration": {
                name: cast(CalibrationRecord, c.to_dict()) for name, c in self.calibrations.items()
            },
            "goals": self.goals,
            "notes": self.notes,
            "started_at": self.started_at,
            "finished_at": _now() if finished else None,
            "complete": finished and not interrupted,
            "interrupted": interrupted,
            "cells": cells,
        }

    def write(self, finished: bool = False, interrupted: bool = False) -> Results:
        """Write results.json atomically; returns what was written."""
        results = self.results(finished, interrupted)
        text = json.dumps(results, indent=1)
        atomic_write(self.out / "results.json", text)
        return results

    def _cost(self, record: Cell) -> CostModel | None:
        """The calibrated cost model of a verispec cell's drafter at its task's typical context (the mean
        prompt plus half the new tokens); None for peers."""
        name = record["method"].removesuffix(CONSTRAINED)
        calibration = self.calibrations.get(name) if name in self.speculators else None
        if calibration is None:
            return None
        prompts = [len(ids) for (task, _), ids in self.prompt_ids.items() if task == record["task"]]
        context = statistics.mean(prompts) + self.config.max_new_tokens / 2 if prompts else 0
        return calibration.cost_model_at(round(context))

    def _machine(self) -> Machine:
        import transformers

        return {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_at_start": list(self.load_at_start),
            "load_average_now": list(os.getloadavg()),
            "peak_rss": "per generation (/proc/self/clear_refs)"
            if self.exact_peaks
            else "process peak so far (getrusage)",
        }


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _identity(cell: Cell, plain: Cell | None) -> Identity | None:
    """A greedy cell's outputs against those of ``plain`` (verispec ``none``, or a speculative peer's own
    plain run): the prompts compared, and those that differ."""
    if cell["temperature"] != 0 or plain is None:
        return None
    reference, outputs = plain["outputs"], cell["outputs"]
    compared = [p for p in outputs if p in reference]
    return {"compared": len(compared), "differ": [p for p in compared if outputs[p] != reference[p]]}


def _validity(cell: _Cell) -> Validity | None:
    """A cell's outputs against their prompts' schemas, or its tool calls against their functions' (None
    where nothing was checked)."""
    if not cell.checked and not cell.cut:
        return None
    invalid = sum(cell.invalid.values())
    validity: Validity = {
        "checked": cell.checked,
        "valid": cell.checked - invalid,
        "invalid": sorted(cell.invalid),
    }
    if cell.cut:
        validity["cut"] = cell.cut
    return validity


def _load_assistant(config: BenchConfig):
    """The transformers assistant for the draft: an early exit ``layers:N`` is the target's directory loaded
    with N layers; any other draft SPEC is loaded as it is."""
    draft = config.draft or ""
    layers = early_exit_layers(draft)
    if layers is None:
        return load_transformers(draft, config.tokenizer)
    return load_transformers(config.target, config.tokenizer, num_layers=layers)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

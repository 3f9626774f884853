"""The records the bench writes (``results.json``) and its report reads, as typed dictionaries: JSON in and
out unchanged, checked by the type checker on both sides; :func:`metrics` and
:func:`tokens_per_second` read a measured cell."""

from __future__ import annotations

from typing import NotRequired, TypedDict

__all__ = [
    "Calibration",
    "Cell",
    "DraftCosts",
    "Identity",
    "Machine",
    "Metrics",
    "Results",
    "RunConfig",
    "Sample",
    "Spread",
    "TargetCosts",
    "TimeSplit",
    "Validity",
    "metrics",
    "tokens_per_second",
]


class Sample(TypedDict):
    """One method over every prompt of a task (or one generation: ``prompts`` 1): counters summed over the
    prompts, memory peaks their maximum."""

    tokens: int
    decode_tokens: int  # tokens generated after the prefill (transformers' first forward yields one)
    seconds: float  # wall time, prefill included
    prefill: float  # seconds in the prompt's prefill
    draft: float  # seconds drafting
    target: float  # seconds in the target's verification forwards
    calls: int  # target forwards after the prefill (verispec: verification rounds)
    drafted: int
    accepted: int
    drafted_per_position: list[int]  # rounds that drafted position i
    accepted_per_position: list[int]  # rounds that accepted position i
    tree_nodes: int  # draft nodes the target scored in tree rounds (0 for chains and transformers)
    forced: int  # drafted tokens that were the grammar's forced ones (constrained verispec methods)
    cached_prompt_tokens: int  # prompt tokens not scored again (a sequence's later turns; 0 for a first)
    prompt_tokens: NotRequired[int]  # the prompts' tokens, scored or cached (older files: none)
    # an agent loop's (tool tasks only, :mod:`verispec.bench.agent`): its turns, the calls it made whole,
    # those whose arguments parsed and validated against their function's schema, those a token limit cut
    turns: NotRequired[int]
    tool_calls: NotRequired[int]
    valid_tool_calls: NotRequired[int]
    cut_tool_calls: NotRequired[int]
    peak_rss_mib: float
    rss_growth_mib: float
    prompts: int


class Spread(TypedDict):
    """The median of a cell's samples, with their extremes and number."""

    median: float
    min: float
    max: float
    n: int


class TimeSplit(TypedDict):
    """Shares of wall time, summing to 1."""

    prefill: float
    draft: float
    target: float
    other: float


class Metrics(TypedDict):
    """A cell's metrics (:func:`verispec.bench.metrics.cell_metrics`); None where they do not apply."""

    tokens_per_second: Spread
    decode_tokens_per_second: Spread
    tokens_per_target_call: float | None
    forward_size: float | None  # positions per verification forward (verispec)
    acceptance_rate: float | None
    acceptance_per_position: list[float]  # P(positions 1..i all accepted | position i drafted)
    time_split: TimeSplit
    peak_rss_mib: float
    rss_growth_mib: float
    speedup_vs_transformers: float | None
    speedup_vs_llamacpp: float | None
    speedup_vs_none: float | None
    decode_speedup_vs_none: float | None
    predicted_speedup: float | None
    efficiency: float | None
    forced_share: float | None  # forced tokens / tokens (constrained verispec methods; None: no forced token)
    prompt_scored: list[float] | None  # a sample's prompt tokens scored, and all (mean; older: None)


class Identity(TypedDict):
    """A greedy cell's outputs against ``none``'s: the prompts compared and the ids of those that differ."""

    compared: int
    differ: list[str]


class Validity(TypedDict):
    """A cell's outputs against their prompts' JSON schemas (every sample's): how many were checked, how many
    parsed and validated, and the ids of the prompts with an invalid one. On a tool task, its calls (every
    sample's), each's arguments against its function's schema, and the calls a token limit cut off (not
    checked)."""

    checked: int
    valid: int
    invalid: list[str]
    cut: NotRequired[int]


class Cell(TypedDict, total=False):
    """One method on one task at one temperature: its samples and metrics."""

    task: str
    temperature: float
    method: str
    k: str  # K, or the tree shape of a tree method; "" where it does not apply
    label: str  # "method k=K", or the method alone
    complete: bool
    samples: list[Sample]
    peer_acceptance_unknown: bool
    tree_nodes: int | None  # a tree cell's most positions per forward (None: sized by the costs)
    chain_k: str  # a tree cell's chain method's K
    metrics: Metrics | None  # None before the first sample
    greedy_identity: Identity | None
    schema_valid: Validity | None  # None on a task without schemas
    outputs: dict[str, list[int]]  # prompt id → generated ids (first sample)


class RunConfig(TypedDict):
    target: str
    draft: str | None
    tasks: list[str]
    prompts: dict[str, int]  # task → prompts run
    methods: list[str]  # labels
    ks: list[str]
    max_new_tokens: int
    temperatures: list[float]
    repetitions: int
    seed: int
    chat_template: bool


class Machine(TypedDict):
    cpu: str
    cores: int | None
    threads: int
    torch: str
    transformers: str
    python: str
    platform: str
    load_average_at_start: list[float]
    load_average_now: list[float]
    peak_rss: str  # how peak memory was measured


class TargetCosts(TypedDict):
    """:class:`verispec.costs.calibrate.TargetCosts`."""

    label: str
    seconds: list[float]  # T_target(k) for k = 1.., medians
    repetitions: int
    measured_at: str


class DraftCosts(TypedDict):
    """:class:`verispec.costs.calibrate.DraftCosts`."""

    label: str
    cost_ratio: float
    seconds_per_token: float
    repetitions: int
    measured_at: str
    catch_up_seconds: float
    fixed_seconds: float


class Calibration(TypedDict):
    """:meth:`verispec.costs.calibrate.Calibration.to_dict`."""

    path: str
    target: TargetCosts
    draft: DraftCosts | None
    verify_cost: list[float]  # v(k) for k = 1..
    cost_ratio: float


class Results(TypedDict):
    """``results.json``."""

    version: int
    verispec: str
    command: str
    config: RunConfig
    machine: Machine
    calibration: dict[str, Calibration]  # method → its costs
    goals: list[dict[str, object]]  # the goals to judge (:mod:`verispec.bench.goals`), as written
    notes: list[str]  # methods left out, and why
    started_at: str
    finished_at: str | None
    complete: bool
    interrupted: bool
    cells: list[Cell]


def metrics(cell: Cell) -> Metrics:
    """The metrics of a cell that has samples (AssertionError for one that has none yet)."""
    measured = cell["metrics"]
    assert measured is not None, f"{cell['label']} has no samples"
    return measured


def tokens_per_second(cell: Cell) -> float:
    """The median tokens/s of a cell that has samples."""
    return metrics(cell)["tokens_per_second"]["median"]

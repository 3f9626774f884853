"""Speed goals judged on a bench run: declared in a TOML file (``verispec bench --goals FILE``; this project's
own are ``docs/bench/goals.toml``), recorded in ``results.json`` and judged by the report from the medians.

A goal names the cells it judges, a measure and the least value it needs::

    [[goal]]
    name = "{cell} ≥ 0.95× {over} (best fixed)"  # {cell}, {over}: the labels of the cells compared
    cells = "each speculative"  # LABEL | "best METHOD" | "each METHOD" | "each speculative"
    k = "auto"                  # optional, with "each": only the cells at this K
    measure = "tokens_per_second"  # or a metric of the cell: efficiency, tokens_per_target_call, ...
    over = "best fixed"         # optional, divides the measure: LABEL | "best METHOD" | "METHOD same k"
                                # (the cell of METHOD at the judged cell's K) | "best fixed" (the judged
                                # cell's method at its fastest numeric K)
    at_least = 0.95
    tasks = ["chat", "rag"]     # optional: only these tasks
    temperatures = [0]          # optional: only these temperatures

    [[calibration]]             # a drafter's cost: target step time / draft step time
    name = "eagle: target step / draft step ≥ 10"
    drafter = "eagle"
    at_least = 10

"best" is the fastest cell by median tokens/s; "speculative" is every verispec drafter but ``none``. A goal
without the cells to judge it gives no row.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from verispec.bench.records import Cell, Results, metrics, tokens_per_second
from verispec.drafting.registry import DRAFTERS
from verispec.errors import UsageError

__all__ = ["CalibrationGoal", "Goal", "Judged", "goals_from_records", "judge", "load_goals"]


def _selector(text: object, role: str) -> tuple[str, str]:
    """(kind, method or label) of a cell selector (see the module doc); UsageError for a malformed one."""
    words = text.split() if isinstance(text, str) else []
    if role == "over":
        if words == ["best", "fixed"]:
            return "best_fixed", ""
        if len(words) == 3 and words[1:] == ["same", "k"]:
            return "same_k", words[0]
        if len(words) == 2 and words[0] == "best":
            return "best", words[1]
    elif len(words) == 2 and words[0] in ("best", "each"):
        return words[0], words[1]
    if len(words) == 1 or (len(words) == 2 and words[1].startswith("k=")):
        return "label", " ".join(words)
    forms = "'best METHOD', 'each METHOD'"
    if role == "over":
        forms = "'best METHOD', 'METHOD same k' or 'best fixed'"
    raise UsageError(f"{role} = {text!r}: expected a cell label, {forms}")


def _check(where: str, ok: bool, what: str) -> None:
    if not ok:
        raise UsageError(f"goal {where!r}: {what}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Goal:
    """A goal on bench cells (see the module doc)."""

    name: str
    cells: str
    at_least: float
    measure: str = "tokens_per_second"
    over: str | None = None
    k: str | None = None
    tasks: tuple[str, ...] = ()
    temperatures: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _check(str(self.name), isinstance(self.name, str) and bool(self.name), "name must be a string")
        _check(self.name, _number(self.at_least), "at_least must be a number")
        _check(self.name, isinstance(self.measure, str), "measure must be a metric's name")
        kind, _ = _selector(self.cells, "cells")
        _check(self.name, self.k is None or (isinstance(self.k, str) and kind == "each"), "k filters 'each'")
        _check(self.name, all(isinstance(t, str) for t in self.tasks), "tasks must be task names")
        _check(self.name, all(_number(t) for t in self.temperatures), "temperatures must be numbers")
        if self.over is not None:
            _selector(self.over, "over")
            _check(
                self.name,
                self.measure in ("tokens_per_second", "decode_tokens_per_second"),
                "'over' divides tokens_per_second or decode_tokens_per_second only",
            )

    def judge(self, cells: list[Cell]) -> list[tuple[str, float]]:
        """(row name, measured) for each cell this goal judges among one task's ``cells``."""
        kind, what = _selector(self.cells, "cells")
        by_label = {c["label"]: c for c in cells}
        if kind == "label":
            subjects = [by_label[what]] if what in by_label else []
        elif kind == "best":
            subjects = [c for c in [_best(cells, what)] if c is not None]
        else:
            subjects = [c for c in cells if _is(c, what) and (self.k is None or c["k"] == self.k)]
        rows = []
        for cell in subjects:
            if self.over is None:
                value, over_label = _metric(cell, self.measure), ""
            elif (over := _reference(cells, self.over, cell)) is not None:
                mine, theirs = _metric(cell, self.measure), _metric(over, self.measure)
                value, over_label = (mine / theirs if mine and theirs else None), over["label"]
            else:
                continue
            if value is not None:
                rows.append((self.name.format(cell=cell["label"], over=over_label), value))
        return rows


@dataclass(frozen=True)
class CalibrationGoal:
    """A goal on a drafter's calibrated cost: T_target(1) / T_draft = 1 / c at least ``at_least``."""

    name: str
    drafter: str
    at_least: float

    def __post_init__(self) -> None:
        _check(str(self.name), isinstance(self.name, str) and bool(self.name), "name must be a string")
        _check(self.name, isinstance(self.drafter, str), "drafter must be a drafter's name")
        _check(self.name, _number(self.at_least), "at_least must be a number")


class Judged(NamedTuple):
    """One row of the goals table."""

    goal: str
    where: str  # the task, or "calibration"
    measured: float
    at_least: float

    @property
    def met(self) -> bool:
        return self.measured >= self.at_least


def _metric(cell: Cell, measure: str) -> float | None:
    value = metrics(cell).get(measure)
    if isinstance(value, dict):
        return value["median"]
    return value if isinstance(value, (int, float)) else None


def _is(cell: Cell, method: str) -> bool:
    """Whether ``cell`` runs ``method``; "speculative": any verispec drafter that drafts (chain or tree)."""
    if method == "speculative":
        kind = DRAFTERS.get(cell["method"].removesuffix("-tree"))
        return kind is not None and kind.drafts
    return cell["method"] == method


def _best(cells: list[Cell], method: str, fixed_k: bool = False) -> Cell | None:
    """The fastest cell of ``method`` (only numeric K when ``fixed_k``), or None."""
    mine = [c for c in cells if _is(c, method) and not (fixed_k and not c["k"].isdigit())]
    return max(mine, key=tokens_per_second, default=None)


def _reference(cells: list[Cell], over: str, cell: Cell) -> Cell | None:
    kind, what = _selector(over, "over")
    if kind == "best_fixed":
        return _best(cells, cell["method"], fixed_k=True)
    if kind == "best":
        return _best(cells, what)
    label = f"{what} k={cell['k']}" if kind == "same_k" else what
    return next((c for c in cells if c["label"] == label), None)


def _build(cls: type[Goal] | type[CalibrationGoal], entry: object, where: str) -> Goal | CalibrationGoal:
    """A ``cls`` from one TOML table; UsageError naming ``where`` for an unknown, missing or bad field."""
    if not isinstance(entry, Mapping):
        raise UsageError(f"{where}: expected a table")
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    unknown = sorted(set(entry) - set(names))
    if unknown:
        raise UsageError(f"{where}: unknown field {unknown[0]!r}; fields are {', '.join(names)}")
    missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in entry]
    if missing:
        raise UsageError(f"{where}: missing field {missing[0]!r}")
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()}
    return cls(**values)


def goals_from_records(records: list[dict[str, object]]) -> list[Goal | CalibrationGoal]:
    """The goals a results file records (see :func:`load_goals`)."""
    goals: list[Goal | CalibrationGoal] = []
    for n, record in enumerate(records, 1):
        kind = record.get("kind")
        entry = {k: v for k, v in record.items() if k != "kind"}
        cls = CalibrationGoal if kind == "calibration" else Goal
        goals.append(_build(cls, entry, f"goal {n}"))
    return goals


def load_goals(path: str | Path) -> list[dict[str, object]]:
    """The goals of a TOML file, validated (UsageError naming the file and the goal), as the records
    ``results.json`` keeps: each goal's fields plus ``kind`` ("cells" or "calibration")."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise UsageError(f"cannot read the goals file {path}: {err.strerror or err}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: not valid TOML ({err})") from None
    unknown = sorted(set(data) - {"goal", "calibration"})
    if unknown:
        raise UsageError(f"{path}: unknown table {unknown[0]!r}; expected [[goal]] and [[calibration]]")
    records: list[dict[str, object]] = []
    for table, cls, kind in (("goal", Goal, "cells"), ("calibration", CalibrationGoal, "calibration")):
        entries = data.get(table, [])
        if not isinstance(entries, list):
            raise UsageError(f"{path}: {table} must be an array of tables ([[{table}]])")
        for n, entry in enumerate(entries, 1):
            goal = _build(cls, entry, f"{path}: [[{table}]] {n}")
            fields = dataclasses.asdict(goal).items()
            records.append({"kind": kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in fields}})
    if not records:
        raise UsageError(f"{path} declares no goals")
    return records


def judge(results: Results, temperature: float, cells_of: dict[str, list[Cell]]) -> list[Judged]:
    """The rows of the goals table for one temperature: the recorded goals judged on each task's cells
    (``cells_of``: task → its cells with metrics at this temperature), task by task; the calibration goals
    follow when any cell goal was judged."""
    goals = goals_from_records(results.get("goals", []))
    rows: list[Judged] = []
    for task, cells in cells_of.items():
        for goal in goals:
            if not isinstance(goal, Goal) or (goal.tasks and task not in goal.tasks):
                continue
            if goal.temperatures and temperature not in goal.temperatures:
                continue
            rows += [Judged(name, task, value, goal.at_least) for name, value in goal.judge(cells)]
    for goal in goals:
        if not (rows and isinstance(goal, CalibrationGoal)):
            continue
        calibration = results.get("calibration", {}).get(goal.drafter)
        if calibration and calibration["cost_ratio"] > 0:
            rows.append(Judged(goal.name, "calibration", 1 / calibration["cost_ratio"], goal.at_least))
    return rows

"""The report of ``verispec bench``, drawn from its results alone (the dictionary saved as ``results.json``):

- ``results.md``: the command, the machine, the calibration, then one Markdown table per task and
  temperature, methods as rows and every metric as a column (legend below the tables);
- charts, PNG and SVG: ``tokens_per_second`` (median, min–max bars), ``speedup`` (over transformers' plain
  ``generate``), ``predicted_vs_measured`` (the analytic model's decoding speedup against the measured one)
  and ``time_split`` (prefill / draft / target / other).

Only cells with at least one sample are shown; a cell with fewer samples than asked (an interrupted run) is
marked with †.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from verispec.viz import write_atomic
from verispec.viz.figures import COLOURS, figure_style, new_figure, save_figure

__all__ = ["CHARTS", "COLUMNS", "charts", "goals", "markdown", "summary", "tree_comparison", "write_report"]

CHARTS = ("tokens_per_second", "speedup", "predicted_vs_measured", "time_split")
_SPLIT = ("prefill", "draft", "target", "other")
_SPLIT_COLOURS = {"prefill": COLOURS["neutral"], "draft": COLOURS["bonus"], "target": COLOURS["recovered"]}
_MISSING = "—"


def _number(spec: str, suffix: str = "") -> Callable[[object], str]:
    return lambda x: _MISSING if x is None else f"{x:{spec}}{suffix}"


def _speed(s: dict | None) -> str:
    return _MISSING if not s else f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})"


def _positions(rates: list[float]) -> str:
    shown = " ".join(f"{r:.2f}" for r in rates[:4])
    return (shown + (" …" if len(rates) > 4 else "")) or _MISSING


def _split(split: dict) -> str:
    return "/".join(f"{100 * split[part]:.0f}" for part in _SPLIT)


def _identity(identity: dict | None) -> str:
    if identity is None or not identity["compared"]:
        return _MISSING
    differ, compared = identity["differ"], identity["compared"]
    if not differ:
        return f"✓ {compared}/{compared}"
    return f"✗ {len(differ)}/{compared} differ: {', '.join(differ)}"


# (header, metric key or None for the whole metrics dict, formatter)
COLUMNS: tuple[tuple[str, str, Callable], ...] = (
    ("tok/s (min–max)", "tokens_per_second", _speed),
    ("decode tok/s", "decode_tokens_per_second", lambda s: _MISSING if not s else f"{s['median']:.1f}"),
    ("× transformers", "speedup_vs_transformers", _number(".2f", "×")),
    ("× none", "speedup_vs_none", _number(".2f", "×")),
    ("τ", "tokens_per_target_call", _number(".2f")),
    ("accept", "acceptance_rate", _number(".2f")),
    ("accept by position", "accepted_per_position", _positions),
    ("prefill/draft/target/other %", "time_split", _split),
    ("peak RSS MiB (+growth)", None, lambda m: f"{m['peak_rss_mib']:.0f} (+{m['rss_growth_mib']:.0f})"),
    ("predicted", "predicted_speedup", _number(".2f", "×")),
    ("efficiency", "efficiency", _number(".2f")),
)

LEGEND = """\
- **tok/s**: generated tokens over wall time, the prompt's prefill included; median over repetitions, min–max
  in brackets. **decode tok/s**: the same without the prefill (transformers: without its first forward, which
  also yields the first token).
- **× transformers**, **× none**: tok/s over that of transformers' plain `generate` and of verispec `none`
  (plain decoding in verispec's engine), medians.
- **τ**: tokens per target forward (verispec: per verification round; transformers: per forward, the first
  included). **accept**: accepted / drafted tokens (transformers assisted: (tokens − forwards) / assistant
  forwards; prompt lookup does not expose it). **accept by position**: the fraction of rounds drafting
  position i in which positions 1..i were all accepted.
- **prefill/draft/target/other %**: shares of wall time: the prompt's prefill, drafting, the target's
  verification forwards, and the rest (verification, sampling, bookkeeping, detokenization).
- **peak RSS**: the process's peak resident memory during the cell's generations (every loaded model
  included), and its growth over the memory held when each generation started.
- **predicted**: the analytic model's decoding speedup over plain decoding,
  Σ n_d·E[L](α_1..α_d) / Σ n_d·(v(d+1) + d·c), from this cell's measured per-position acceptance and draft
  lengths and the calibrated v(k), c.
  **efficiency**: the measured decoding speedup over `none` divided by the predicted one.
- **greedy = none**: each prompt's greedy output compared with `none`'s, token for token (✓: identical).
"""


def _cells(results: dict, task: str, temperature: float) -> list[dict]:
    return [
        c
        for c in results["cells"]
        if c["task"] == task and c["temperature"] == temperature and c["samples"] and c["metrics"]
    ]


def _label(cell: dict, repetitions: int) -> str:
    return cell["label"] + ("" if len(cell["samples"]) >= repetitions else " †")


def _mode(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"sampled, temperature {temperature:g}"


def summary(results: dict, temperature: float) -> list[str]:
    """A Markdown table of every task at once: tok/s, its speedup over transformers' plain ``generate`` and
    the efficiency, one row per method (the lines of the table)."""
    tasks = results["config"]["tasks"]
    lines = ["| method | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]
    for label in _labels(results):
        row = [label]
        for task in tasks:
            cell = next((c for c in _cells(results, task, temperature) if c["label"] == label), None)
            m = cell["metrics"] if cell else None
            if not m:
                row.append(_MISSING)
                continue
            parts = [f"{m['tokens_per_second']['median']:.1f}"]
            if m["speedup_vs_transformers"]:
                parts.append(f"{m['speedup_vs_transformers']:.2f}×")
            if m["efficiency"] and m["predicted_speedup"] != 1.0:
                parts.append(f"eff {m['efficiency']:.2f}")
            row.append(" · ".join(parts))
        lines.append("| " + " | ".join(row) + " |")
    return [
        *lines,
        "",
        "Each cell: tok/s · speedup over transformers `generate` · efficiency (measured / predicted).",
    ]


# ---------------------------------------------------------------------------------------------- goals

_COPY_TASKS = ("summarization", "rag", "code_editing")  # where the answer copies its input
_LEARNED_TASKS = ("chat", "rag")  # where the learned drafter's goals are set (open answers, QA)


def _tps(cell: dict) -> float:
    return cell["metrics"]["tokens_per_second"]["median"]


def _best(cells: list[dict], method: str, fixed_k: bool = False) -> dict | None:
    """The fastest cell of ``method`` (only numeric K when ``fixed_k``), or None."""
    mine = [c for c in cells if c["method"] == method and not (fixed_k and not c["k"].isdigit())]
    return max(mine, key=_tps, default=None)


def _goal_rows(results: dict, temperature: float) -> list[tuple[str, str, float, float]]:
    """(goal, where, measured, required) for every goal the run has the cells to judge; a goal is met when
    measured >= required."""
    rows = []
    for task in results["config"]["tasks"]:
        cells = _cells(results, task, temperature)
        by_label = {c["label"]: c for c in cells}
        plain, none = by_label.get("transformers"), by_label.get("none")
        if plain and none:
            rows.append(("none ≥ 1.1× transformers", task, _tps(none) / _tps(plain), 1.1))
        ngram, lookup = _best(cells, "ngram"), _best(cells, "transformers-lookup")
        if task in _COPY_TASKS and ngram and plain:
            rows.append(
                (f"ngram ≥ 2.5× transformers ({ngram['label']})", task, _tps(ngram) / _tps(plain), 2.5)
            )
        if task in _COPY_TASKS and ngram and lookup:
            rows.append(
                (
                    f"ngram ≥ 1.5× transformers lookup ({lookup['label']})",
                    task,
                    _tps(ngram) / _tps(lookup),
                    1.5,
                )
            )
        for cell in cells:
            peer = by_label.get(f"transformers-assisted k={cell['k']}")
            if cell["method"] == "model" and peer:
                rows.append(
                    (f"{cell['label']} ≥ 2× transformers-assisted", task, _tps(cell) / _tps(peer), 2.0)
                )
            if cell["method"] in ("none", "transformers", "transformers-assisted", "transformers-lookup"):
                continue
            efficiency = cell["metrics"]["efficiency"]
            if efficiency is not None:
                rows.append((f"{cell['label']} efficiency ≥ 0.95", task, efficiency, 0.95))
            fixed = _best(cells, cell["method"], fixed_k=True)
            if cell["k"] == "auto" and fixed:
                rows.append(
                    (
                        f"{cell['label']} ≥ 0.95× {fixed['label']} (best fixed)",
                        task,
                        _tps(cell) / _tps(fixed),
                        0.95,
                    )
                )
            if cell["k"] == "auto" and none:
                rows.append((f"{cell['label']} ≥ 0.95× none", task, _tps(cell) / _tps(none), 0.95))
            if cell["method"] == "eagle" and task in _LEARNED_TASKS and temperature == 0 and none:
                rows.append((f"{cell['label']} ≥ 1.8× none", task, _tps(cell) / _tps(none), 1.8))
                if cell["k"] == "4":
                    rows.append(("eagle k=4 τ ≥ 2.5", task, cell["metrics"]["tokens_per_target_call"], 2.5))
    eagle = results.get("calibration", {}).get("eagle")
    if rows and eagle and eagle["cost_ratio"] > 0:  # a draft step ≤ 10 % of a target step
        rows.append(("eagle: target step / draft step ≥ 10", "calibration", 1 / eagle["cost_ratio"], 10.0))
    return rows


def goals(results: dict) -> list[str]:
    """The project's speed goals on its reference machine (README, "Benchmarks"), judged from this run's
    medians: the lines of one Markdown table per temperature, empty when the run has no cells to judge."""
    lines = []
    for temperature in results["config"]["temperatures"]:
        rows = _goal_rows(results, temperature)
        if not rows:
            continue
        lines += [
            "",
            f"## Goals — {_mode(temperature)}",
            "",
            "| goal | task | measured | met |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {g} | {task} | {x:.3f} | {'✓' if x >= need else '✗ missed'} |" for g, task, x, need in rows
        ]
    return lines


def tree_comparison(results: dict) -> list[str]:
    """Chain against tree at equal target-forward sizes: each tree cell of N nodes beside its chain method's
    cell at K = N − 1 (both score at most N positions per forward; a dynamic tree sized by the costs beside
    K auto); the lines of one Markdown table per temperature, empty without tree cells."""
    lines = []
    for temperature in results["config"]["temperatures"]:
        rows = []
        for task in results["config"]["tasks"]:
            cells = _cells(results, task, temperature)
            by_label = {c["label"]: c for c in cells}
            for tree in (c for c in cells if c.get("tree_nodes") or c.get("chain_k")):
                k = tree.get("chain_k") or tree["tree_nodes"] - 1  # results before dynamic trees: no chain_k
                chain = by_label.get(f"{tree['method'].removesuffix('-tree')} k={k}")
                if chain is None:
                    continue
                t, c = tree["metrics"], chain["metrics"]
                rows.append(
                    f"| {task} | {tree['label']} | {chain['label']} | {tree['tree_nodes'] or 'auto'} | "
                    f"{t['forward_size']:.2f} / {c['forward_size']:.2f} | "
                    f"{t['tokens_per_target_call']:.2f} / {c['tokens_per_target_call']:.2f} | "
                    f"{_tps(tree):.1f} / {_tps(chain):.1f} | {_tps(tree) / _tps(chain):.2f}× |"
                )
        if rows:
            lines += [
                "",
                f"## Chain vs tree at equal forward sizes — {_mode(temperature)}",
                "",
                "| task | tree | chain | N | positions per forward | τ | tok/s | tree / chain |",
                "|---|---|---|---|---|---|---|---|",
                *rows,
                "",
                "A tree of N nodes against the chain of K = N − 1 draft tokens: both feed the target at "
                "most N positions per forward (N auto: a dynamic tree sized by the calibrated costs, against "
                "K auto). Pairs of numbers: tree / chain; τ: tokens per forward.",
            ]
    return lines


def markdown(results: dict) -> str:
    """results.md: the run's context, then one table per task and temperature."""
    config, machine = results["config"], results["machine"]
    status = "complete" if results["complete"] else "interrupted: finished cells only"
    lines = [
        "# verispec bench",
        "",
        f"`{results['command']}` ({status}; started {results['started_at']})",
        "",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores, {machine['threads']} torch threads; "
        f"torch {machine['torch']}, transformers {machine['transformers']}, Python {machine['python']}; "
        f"load average at start {' / '.join(f'{x:.2f}' for x in machine['load_average_at_start'])}",
        f"- Target `{config['target']}`, draft `{config['draft'] or _MISSING}`; max_new_tokens "
        f"{config['max_new_tokens']}; {config['repetitions']} repetitions; prompts per task "
        f"{', '.join(f'{t} {n}' for t, n in config['prompts'].items())}; chat template "
        f"{'yes' if config['chat_template'] else 'no (plain text prompts)'}",
    ]
    calibrations = results["calibration"]
    if calibrations:
        first = next(iter(calibrations.values()))
        v = ", ".join(f"{x:.2f}" for x in first["verify_cost"])
        ratios = ", ".join(f"{name} {c['cost_ratio']:.4f}" for name, c in calibrations.items() if c["draft"])
        lines.append(
            f"- Calibration: T_target(1) = {1e3 * first['target']['seconds'][0]:.2f} ms; "
            f"v(k) for k = 1..{len(first['verify_cost'])}: {v}; cost ratio c: {ratios or _MISSING}"
        )
    lines += [f"- Not run: {note}" for note in results["notes"]]
    lines += goals(results)
    lines += tree_comparison(results)
    if len(config["tasks"]) > 1:
        for temperature in config["temperatures"]:
            lines += ["", f"## Summary — {_mode(temperature)}", "", *summary(results, temperature)]
    headers = ["method", *(h for h, _, _ in COLUMNS), "greedy = none"]
    for task in config["tasks"]:
        for temperature in config["temperatures"]:
            cells = _cells(results, task, temperature)
            if not cells:
                continue
            lines += ["", f"## {task} — {_mode(temperature)}", ""]
            lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            for cell in cells:
                m = cell["metrics"]
                row = [_label(cell, config["repetitions"])]
                row += [fmt(m if key is None else m.get(key)) for _, key, fmt in COLUMNS]
                row.append(_identity(cell.get("greedy_identity")))
                lines.append("| " + " | ".join(row) + " |")
    if any(c["samples"] and len(c["samples"]) < config["repetitions"] for c in results["cells"]):
        lines += ["", "† fewer repetitions than asked (the run was interrupted)."]
    lines += ["", LEGEND]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- charts


def _colours(labels: list[str]) -> dict[str, tuple]:
    palette = colormaps["tab10"]
    return {label: palette(i % 10) for i, label in enumerate(labels)}


def _labels(results: dict) -> list[str]:
    return list(dict.fromkeys(c["label"] for c in results["cells"] if c["samples"] and c["metrics"]))


def _grouped_bars(
    results: dict, value: Callable[[dict], tuple[float, float, float] | None], ylabel: str, title: str
) -> Figure:
    """One panel per temperature: tasks along x, one bar per method (value: (height, low, high) or None)."""
    config, labels = results["config"], _labels(results)
    colours = _colours(labels)
    temperatures = config["temperatures"]
    with figure_style():
        fig = new_figure(
            max(6.0, 1.2 * len(config["tasks"]) * max(1, len(labels)) / 3), 3.6 * len(temperatures)
        )
        axes = fig.subplots(len(temperatures), 1, squeeze=False)[:, 0]
        width = 0.8 / max(1, len(labels))
        for ax, temperature in zip(axes, temperatures, strict=True):
            for j, label in enumerate(labels):
                xs, heights, errors = [], [], [[], []]
                for i, task in enumerate(config["tasks"]):
                    cell = next((c for c in _cells(results, task, temperature) if c["label"] == label), None)
                    bar = value(cell["metrics"]) if cell else None
                    if bar is None:
                        continue
                    xs.append(i + (j - (len(labels) - 1) / 2) * width)
                    heights.append(bar[0])
                    errors[0].append(bar[0] - bar[1])
                    errors[1].append(bar[2] - bar[0])
                ax.bar(xs, heights, width, yerr=errors, color=colours[label], label=label, capsize=2)
            ax.set_xticks(range(len(config["tasks"])), config["tasks"], rotation=20)
            ax.set(ylabel=ylabel)
            ax.set_title(f"{title} — {_mode(temperature)}", fontsize=10)
        axes[0].legend(fontsize=7, ncols=min(4, max(1, len(labels))), loc="upper left")
    return fig


def _speedup(results: dict) -> tuple[Callable[[dict], tuple[float, float, float] | None], str]:
    """The speedup bars (over transformers' plain ``generate``, or over ``none`` when it did not run)."""
    key = "speedup_vs_transformers"
    if not any(c["metrics"].get(key) for c in results["cells"] if c["metrics"]):
        key = "speedup_vs_none"
    baseline = "transformers generate" if key == "speedup_vs_transformers" else "verispec none"
    return (lambda m: (m[key], m[key], m[key]) if m.get(key) else None), f"Speedup over {baseline}"


def _predicted_figure(results: dict) -> Figure:
    """Measured decoding speedup over ``none`` against the analytic model's, one point per cell."""
    labels = _labels(results)
    colours = _colours(labels)
    with figure_style():
        fig = new_figure(5.5, 5.0)
        ax = fig.subplots()
        top = 1.0
        for label in labels:
            points = [
                (c["metrics"]["predicted_speedup"], c["metrics"]["decode_speedup_vs_none"])
                for c in results["cells"]
                if c["label"] == label
                and c["metrics"]
                and c["metrics"].get("predicted_speedup")
                and c["metrics"].get("decode_speedup_vs_none")
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.scatter(xs, ys, color=colours[label], label=label, s=25)
                top = max(top, *xs, *ys)
        line = np.array([0.0, top * 1.1])
        ax.plot(line, line, color=COLOURS["neutral"], linewidth=0.8, label="measured = predicted")
        ax.plot(
            line, 0.95 * line, color=COLOURS["neutral"], linewidth=0.8, linestyle=":", label="efficiency 0.95"
        )
        ax.set(
            xlabel="predicted decoding speedup (analytic model)",
            ylabel="measured decoding speedup over none",
            xlim=(0, top * 1.1),
            ylim=(0, top * 1.1),
        )
        ax.set_title("Predicted vs measured speedup (one point per task)", fontsize=10)
        ax.legend(fontsize=7)
    return fig


def _split_figure(results: dict) -> Figure:
    """Shares of wall time per method (summed over tasks), one panel per temperature."""
    labels, temperatures = _labels(results), results["config"]["temperatures"]
    with figure_style():
        fig = new_figure(7.0, 0.35 * len(labels) * len(temperatures) + 1.5)
        axes = fig.subplots(len(temperatures), 1, squeeze=False)[:, 0]
        for ax, temperature in zip(axes, temperatures, strict=True):
            shares = []
            for label in labels:
                cells = [
                    c
                    for c in results["cells"]
                    if c["label"] == label and c["temperature"] == temperature and c["metrics"]
                ]
                shares.append(
                    [
                        np.mean([c["metrics"]["time_split"][p] for c in cells]) if cells else 0.0
                        for p in _SPLIT
                    ]
                )
            left = np.zeros(len(labels))
            for i, part in enumerate(_SPLIT):
                width = np.array([s[i] for s in shares])
                ax.barh(labels, width, left=left, label=part, color=_SPLIT_COLOURS.get(part, "#bbbbbb"))
                left += width
            ax.set(xlim=(0, 1), xlabel="share of wall time")
            ax.invert_yaxis()
            ax.set_title(f"Where the time goes — {_mode(temperature)}", fontsize=10)
        axes[-1].legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    return fig


def charts(results: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Write the charts of the module doc into ``out_dir``; returns the paths written."""
    bar, title = _speedup(results)
    figures = {
        "tokens_per_second": _grouped_bars(
            results,
            lambda m: (
                m["tokens_per_second"]["median"],
                m["tokens_per_second"]["min"],
                m["tokens_per_second"]["max"],
            ),
            "tokens / s",
            "Tokens per second (median, min–max)",
        ),
        "speedup": _grouped_bars(results, bar, "speedup", title),
        "predicted_vs_measured": _predicted_figure(results),
        "time_split": _split_figure(results),
    }
    return [path for name in CHARTS for path in save_figure(figures[name], Path(out_dir) / name)]


def write_report(results: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Write results.md and the charts into ``out_dir``; returns the paths written."""
    text = markdown(results)
    md = write_atomic(Path(out_dir) / "results.md", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return [md, *charts(results, out_dir)]

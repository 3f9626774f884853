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

from verispec.bench.goals import judge
from verispec.bench.methods import TOOLS_FREE
from verispec.bench.records import (
    Calibration,
    Cell,
    Identity,
    Metrics,
    Results,
    Spread,
    TimeSplit,
    Validity,
    metrics,
    tokens_per_second,
)
from verispec.files import atomic_write
from verispec.viz.figures import COLOURS, figure_style, new_figure, save_figure

__all__ = ["CHARTS", "COLUMNS", "charts", "goals", "markdown", "summary", "tree_comparison", "write_report"]

CHARTS = ("tokens_per_second", "speedup", "predicted_vs_measured", "time_split")
_SPLIT = ("prefill", "draft", "target", "other")
_SPLIT_COLOURS = {"prefill": COLOURS["neutral"], "draft": COLOURS["bonus"], "target": COLOURS["recovered"]}
_MISSING = "—"


def _number(spec: str, suffix: str = "") -> Callable[[object], str]:
    return lambda x: _MISSING if x is None else f"{x:{spec}}{suffix}"


def _speed(s: Spread) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})"


def _positions(rates: list[float]) -> str:
    shown = " ".join(f"{r:.2f}" for r in rates[:4])
    return (shown + (" …" if len(rates) > 4 else "")) or _MISSING


def _split(split: TimeSplit) -> str:
    return "/".join(f"{100 * share:.0f}" for share in _shares(split))


def _shares(split: TimeSplit) -> tuple[float, float, float, float]:
    """The shares in the order of :data:`_SPLIT`."""
    return split["prefill"], split["draft"], split["target"], split["other"]


def _scored(scored: list[float] | None) -> str:
    """A sample's prompt tokens scored / all its prompt tokens."""
    return _MISSING if not scored else f"{scored[0]:.0f}/{scored[1]:.0f}"


def _identity(identity: Identity | None) -> str:
    if identity is None or not identity["compared"]:
        return _MISSING
    differ, compared = identity["differ"], identity["compared"]
    if not differ:
        return f"✓ {compared}/{compared}"
    return f"✗ {len(differ)}/{compared} differ: {', '.join(differ)}"


def _validity(validity: Validity | None) -> str:
    if validity is None:
        return _MISSING
    checked, valid = validity["checked"], validity["valid"]
    cut = f" ({validity['cut']} cut)" if validity.get("cut") else ""
    if valid == checked:
        return f"✓ {valid}/{checked}{cut}"
    return f"✗ {valid}/{checked}{cut}: {', '.join(validity['invalid'])}"


# (header, the cell's metrics → the column's text)
COLUMNS: tuple[tuple[str, Callable[[Metrics], str]], ...] = (
    ("tok/s (min–max)", lambda m: _speed(m["tokens_per_second"])),
    ("decode tok/s", lambda m: f"{m['decode_tokens_per_second']['median']:.1f}"),
    ("× transformers", lambda m: _number(".2f", "×")(m["speedup_vs_transformers"])),
    ("× llama.cpp", lambda m: _number(".2f", "×")(m.get("speedup_vs_llamacpp"))),
    ("× none", lambda m: _number(".2f", "×")(m["speedup_vs_none"])),
    ("τ", lambda m: _number(".2f")(m["tokens_per_target_call"])),
    ("accept", lambda m: _number(".2f")(m["acceptance_rate"])),
    ("accept by position", lambda m: _positions(m["acceptance_per_position"])),
    ("prefill/draft/target/other %", lambda m: _split(m["time_split"])),
    ("peak RSS MiB (+growth)", lambda m: f"{m['peak_rss_mib']:.0f} (+{m['rss_growth_mib']:.0f})"),
    ("predicted", lambda m: _number(".2f", "×")(m["predicted_speedup"])),
    ("efficiency", lambda m: _number(".2f")(m["efficiency"])),
    ("forced", lambda m: _number(".0%")(m.get("forced_share"))),
    ("prompt scored", lambda m: _scored(m.get("prompt_scored"))),
)

LEGEND = """\
- **tok/s**: generated tokens over wall time, the prompt's prefill included; median over repetitions, min–max
  in brackets. **decode tok/s**: the same without the prefill (transformers: without its first forward, which
  also yields the first token).
- **× transformers**, **× llama.cpp**, **× none**: tok/s over that of transformers' plain `generate`, of
  llama.cpp's plain decoding of the same GGUF file and of verispec `none` (plain decoding in verispec's
  engine), medians.
- **τ**: tokens per target forward (verispec: per verification round; transformers: per forward, the first
  included; llama.cpp does not report its forwards). **accept**: accepted / drafted tokens (transformers
  assisted: (tokens − forwards) / assistant forwards; the prompt lookups do not expose it). **accept by
  position**: the fraction of rounds drafting position i in which positions 1..i were all accepted.
- **prefill/draft/target/other %**: shares of wall time: the prompt's prefill, drafting, the target's
  verification forwards, and the rest (verification, sampling, bookkeeping, detokenization).
- **peak RSS**: the process's peak resident memory during the cell's generations (every loaded model
  included), and its growth over the memory held when each generation started.
- **predicted**: the analytic model's decoding speedup over plain decoding,
  Σ n_d·E[L](α_1..α_d) / Σ n_d·(v(d+1) + d·c), from this cell's measured per-position acceptance and draft
  lengths and the calibrated v(k), c.
  **efficiency**: the measured decoding speedup over `none` divided by the predicted one.
- **forced**: the share of a constrained method's tokens that the grammar forced (drafted for free).
- **prompt scored**: a sample's prompt tokens that the target scored, over all its prompt tokens (the rest
  kept from a slot: a sequence's later turns begin with the conversation the last one held); a mean over the
  samples.
- **greedy = none**: each prompt's greedy output compared with `none`'s, token for token (✓: identical); a
  speculative peer's (assisted, lookup) with its own plain output's; a constrained method's (`-json`) with
  `none-json`'s.
- **valid**: on a task whose prompts bring a JSON schema (json), the outputs (every repetition's) that parse
  and validate against their prompt's schema (`jsonschema`), of those checked; ✗ names the prompts with an
  invalid one. A constrained method (`-json`, llama.cpp's included: its grammar from the schema) holds each
  output to the schema; its × none and × llama.cpp are over `none-json` and `llamacpp-json`. On a task of
  tool calls (agent_calls), the calls made (every repetition's), each's arguments parsed and validated
  against its function's schema; (N cut): calls a token limit cut off, not checked.
- **A task of tool calls** (agent_calls) runs an agent loop: every verispec method under the tools' grammar
  (its × none over `none`'s, itself constrained), `none-unconstrained` (tool_choice none: the tools rendered,
  no grammar) on the conversations `none`'s loop generated from; **constrained / unconstrained** is
  `none`'s tok/s over `none-unconstrained`'s.
"""


def _cells(results: Results, task: str, temperature: float) -> list[Cell]:
    return [
        c
        for c in results["cells"]
        if c["task"] == task and c["temperature"] == temperature and c["samples"] and c["metrics"]
    ]


def _label(cell: Cell, repetitions: int) -> str:
    return cell["label"] + ("" if len(cell["samples"]) >= repetitions else " †")


def _mode(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"sampled, temperature {temperature:g}"


def summary(results: Results, temperature: float) -> list[str]:
    """A Markdown table of every task at once: tok/s, its speedup over transformers' plain ``generate`` and
    the efficiency, one row per method (the lines of the table)."""
    tasks = results["config"]["tasks"]
    lines = ["| method | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]
    for label in _labels(results):
        row = [label]
        for task in tasks:
            cell = next((c for c in _cells(results, task, temperature) if c["label"] == label), None)
            m = metrics(cell) if cell else None
            if m is None:
                row.append(_MISSING)
                continue
            parts = [f"{m['tokens_per_second']['median']:.1f}"]
            if m["speedup_vs_transformers"]:
                parts.append(f"{m['speedup_vs_transformers']:.2f}× tf")
            if m.get("speedup_vs_llamacpp"):
                parts.append(f"{m['speedup_vs_llamacpp']:.2f}× llama.cpp")
            if m["efficiency"] and m["predicted_speedup"] != 1.0:
                parts.append(f"eff {m['efficiency']:.2f}")
            row.append(" · ".join(parts))
        lines.append("| " + " | ".join(row) + " |")
    return [
        *lines,
        "",
        "Each cell: tok/s · speedup over transformers `generate` (tf) and over llama.cpp's plain decoding · "
        "efficiency (measured / predicted).",
    ]


# ---------------------------------------------------------------------------------------------- goals


def goals(results: Results) -> list[str]:
    """The goals recorded with the run (``verispec bench --goals FILE``, :mod:`verispec.bench.goals`), judged
    from its medians: the lines of one Markdown table per temperature, empty when none can be judged."""
    lines = []
    for temperature in results["config"]["temperatures"]:
        cells = {task: _cells(results, task, temperature) for task in results["config"]["tasks"]}
        rows = judge(results, temperature, cells)
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
            f"| {row.goal} | {row.where} | {row.measured:.3f} | {'✓' if row.met else '✗ missed'} |"
            for row in rows
        ]
    return lines


def tree_comparison(results: Results) -> list[str]:
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
                k = tree.get("chain_k") or f"{(tree['tree_nodes'] or 1) - 1}"  # results before dynamic trees
                chain = by_label.get(f"{tree['method'].removesuffix('-tree')} k={k}")
                if chain is None:
                    continue
                t, c = metrics(tree), metrics(chain)
                speed, chain_speed = tokens_per_second(tree), tokens_per_second(chain)
                rows.append(
                    f"| {task} | {tree['label']} | {chain['label']} | {tree['tree_nodes'] or 'auto'} | "
                    f"{t['forward_size']:.2f} / {c['forward_size']:.2f} | "
                    f"{t['tokens_per_target_call']:.2f} / {c['tokens_per_target_call']:.2f} | "
                    f"{speed:.1f} / {chain_speed:.1f} | {speed / chain_speed:.2f}× |"
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


def _constrained_over_free(cells: list[Cell]) -> list[str]:
    """A task of tool calls: ``none``'s tok/s over the unconstrained baseline's (lines; none elsewhere)."""
    by_label = {c["label"]: c for c in cells}
    none, free = by_label.get("none"), by_label.get(TOOLS_FREE)
    if none is None or free is None:
        return []
    ratio = tokens_per_second(none) / tokens_per_second(free)
    return ["", f"Constrained / unconstrained (`none` / `{TOOLS_FREE}`): {ratio:.2f}×"]


def markdown(results: Results) -> str:
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
        ratios = ", ".join(
            f"{name} {c['cost_ratio']:.4f} + {_fixed(c):.4f}"
            for name, c in calibrations.items()
            if c["draft"]
        )
        lines.append(
            f"- Calibration: T_target(1) = {1e3 * first['target']['seconds'][0]:.2f} ms; "
            f"v(k) for k = 1..{len(first['verify_cost'])}: {v}; a proposal's cost c per token + c₀: "
            f"{ratios or _MISSING}"
        )
    lines += [f"- Not run: {note}" for note in results["notes"]]
    lines += goals(results)
    lines += tree_comparison(results)
    if len(config["tasks"]) > 1:
        for temperature in config["temperatures"]:
            lines += ["", f"## Summary — {_mode(temperature)}", "", *summary(results, temperature)]
    headers = ["method", *(h for h, _ in COLUMNS), "greedy = none", "valid"]
    for task in config["tasks"]:
        for temperature in config["temperatures"]:
            cells = _cells(results, task, temperature)
            if not cells:
                continue
            lines += ["", f"## {task} — {_mode(temperature)}", ""]
            lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            for cell in cells:
                row = [_label(cell, config["repetitions"])]
                row += [column(metrics(cell)) for _, column in COLUMNS]
                row.append(_identity(cell.get("greedy_identity")))
                row.append(_validity(cell.get("schema_valid")))
                lines.append("| " + " | ".join(row) + " |")
            lines += _constrained_over_free(cells)
    if any(c["samples"] and len(c["samples"]) < config["repetitions"] for c in results["cells"]):
        lines += ["", "† fewer repetitions than asked (the run was interrupted)."]
    lines += ["", LEGEND]
    return "\n".join(lines)


def _fixed(calibration: Calibration) -> float:
    """c₀ of a calibration's drafter: its fixed seconds a proposal over the T_target(1) timed beside them, as
    c is (:meth:`verispec.costs.calibrate.Calibration.cost_model`; 0 for a record made before it was
    measured)."""
    draft = calibration["draft"]
    assert draft is not None
    return draft.get("fixed_seconds", 0.0) * draft["cost_ratio"] / draft["seconds_per_token"]


# ---------------------------------------------------------------------------------------------- charts


def _colours(labels: list[str]) -> dict[str, tuple]:
    palette = colormaps["tab10"]
    return {label: palette(i % 10) for i, label in enumerate(labels)}


def _labels(results: Results) -> list[str]:
    return list(dict.fromkeys(c["label"] for c in results["cells"] if c["samples"] and c["metrics"]))


def _grouped_bars(
    results: Results, value: Callable[[Metrics], tuple[float, float, float] | None], ylabel: str, title: str
) -> Figure:
    """One panel per temperature: tasks along x, one bar per method (value: (height, low, high) or None)."""
    config, labels = results["config"], _labels(results)
    colours = _colours(labels)
    temperatures = config["temperatures"]
    with figure_style():
        # at most 12 inches wide: many methods make the panels taller, not a 7:1 strip
        fig = new_figure(
            min(12.0, max(6.0, 0.9 * len(config["tasks"]) + 0.25 * len(labels))), 4.2 * len(temperatures)
        )
        axes = fig.subplots(len(temperatures), 1, squeeze=False)[:, 0]
        width = 0.8 / max(1, len(labels))
        for ax, temperature in zip(axes, temperatures, strict=True):
            for j, label in enumerate(labels):
                xs: list[float] = []
                heights: list[float] = []
                errors: tuple[list[float], list[float]] = ([], [])
                for i, task in enumerate(config["tasks"]):
                    cell = next((c for c in _cells(results, task, temperature) if c["label"] == label), None)
                    bar = value(metrics(cell)) if cell else None
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


def _speedup(results: Results) -> tuple[Callable[[Metrics], tuple[float, float, float] | None], str]:
    """The speedup bars (over transformers' plain ``generate``, or over ``none`` when it did not run)."""
    key = "speedup_vs_transformers"
    if not any(c["metrics"].get(key) for c in results["cells"] if c["metrics"]):
        key = "speedup_vs_none"
    baseline = "transformers generate" if key == "speedup_vs_transformers" else "verispec none"
    return (lambda m: (m[key], m[key], m[key]) if m.get(key) else None), f"Speedup over {baseline}"


def _predicted_figure(results: Results) -> Figure:
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


def _split_figure(results: Results) -> Figure:
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
                split = [_shares(metrics(c)["time_split"]) for c in cells]
                shares.append([float(np.mean(part)) if cells else 0.0 for part in zip(*split, strict=True)])
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


def charts(results: Results, out_dir: str | os.PathLike) -> list[Path]:
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


def write_report(results: Results, out_dir: str | os.PathLike) -> list[Path]:
    """Write results.md and the charts into ``out_dir``; returns the paths written."""
    text = markdown(results)
    md = atomic_write(Path(out_dir) / "results.md", text)
    return [md, *charts(results, out_dir)]

"""The charts of ``verispec simulate --plot DIR``: the Monte-Carlo cells of :mod:`verispec.costs.simulate`
drawn
over the analytic model of :mod:`verispec.costs.analytic`.

- ``acceptance``: the measured acceptance rate vs the agreement a, against α = a (sampled mode) and the
  pool's argmax agreement β (greedy mode);
- ``tokens_per_call``: τ, tokens per target call, vs K, the analytic E[L](α, K) curves over the Monte-Carlo
  points (± 2 standard errors), one panel per mode and one colour per agreement;
- ``speedup``: speedup τ / (v(K+1) + K·c) vs K at the simulated cost ratio c, analytic and Monte-Carlo;
- ``speedup_cost``: the analytic speedup over K × cost ratio, one panel per agreement (sampled, α = a), with
  the break-even contour (speedup 1), the best K for each c and the simulated c.

Each is written as PNG and SVG into the directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib import colormaps, patheffects
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from verispec.costs.analytic import expected_speedup, expected_tokens_per_call
from verispec.costs.simulate import CellResult, SimulationResult
from verispec.errors import UsageError
from verispec.viz.figures import COLOURS, figure_style, new_figure, save_figure

__all__ = ["CHARTS", "chart_directory", "simulation_charts"]

CHARTS = ("acceptance", "tokens_per_call", "speedup", "speedup_cost")
_MARKERS = {"sampled": "o", "greedy": "s"}
_MODE_COLOURS = {"sampled": "accepted", "greedy": "recovered"}
_COST_RATIOS = np.linspace(0.0, 0.5, 51)  # the cost ratio axis of the speedup_cost heatmaps
_MIN_HEATMAP_K = 8  # the heatmaps span K = 1..max(this, the largest simulated K)
_OUTLINED = [patheffects.withStroke(linewidth=3, foreground="black")]


def chart_directory(path: str | os.PathLike) -> Path:
    """``path`` as a directory the charts can be written to, created if needed; else one-line UsageError."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create the chart directory {path}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write into the chart directory {path}")
    return path


def _cells(result: SimulationResult, mode: str, agreement: float) -> list[CellResult]:
    """The cells of one (mode, agreement), by K."""
    return [c for c in result.cells if c.mode == mode and c.agreement == agreement]


def _colour(result: SimulationResult, agreement: float) -> tuple:
    """One colour per agreement level, from light to dark."""
    levels = sorted(result.config.agreements)
    return colormaps["viridis"](0.85 * (1 - levels.index(agreement) / max(1, len(levels) - 1)))


def _rate_label(mode: str, cells: list[CellResult]) -> str:
    a, rate = cells[0].agreement, cells[0].acceptance_analytic
    return f"α = {a:g}" if mode == "sampled" else f"β = {rate:.3g} (a = {a:g})"


def acceptance_figure(result: SimulationResult) -> Figure:
    """Measured acceptance vs agreement, per mode, over the analytic rate (module doc)."""
    agreements = sorted(result.config.agreements)
    with figure_style():
        fig = new_figure(6.5, 4.5)
        ax = fig.subplots()
        ax.plot([0, 1], [0, 1], color=COLOURS["neutral"], linewidth=1, label="sampled, analytic: α = a")
        for mode in result.config.modes:
            colour = COLOURS[_MODE_COLOURS[mode]]
            pooled, se, analytic = [], [], []
            for a in agreements:
                cells = _cells(result, mode, a)
                positions = np.array([c.k for c in cells]) * result.config.rounds
                rate = float(np.average([c.acceptance for c in cells], weights=positions))
                pooled.append(rate)
                se.append(np.sqrt(rate * (1 - rate) / positions.sum()))
                analytic.append(cells[0].acceptance_analytic)
            if mode == "greedy":
                ax.plot(agreements, analytic, "--", color=colour, label="greedy, analytic: β of the pool")
            ax.errorbar(
                agreements,
                pooled,
                yerr=2 * np.array(se),
                fmt=_MARKERS[mode],
                color=colour,
                capsize=3,
                label=f"{mode}, Monte-Carlo (± 2 se, all K)",
            )
        ax.set(xlabel="agreement a", ylabel="acceptance rate", xlim=(-0.02, 1.02), ylim=(-0.02, 1.05))
        ax.set_title("Acceptance rate vs agreement")
        ax.legend(fontsize=8, loc="upper left")
    return fig


def _per_k_figure(result: SimulationResult, quantity: str) -> Figure:
    """One panel per mode: ``quantity`` ("tau" or "speedup") vs K, analytic lines over Monte-Carlo points."""
    config = result.config
    ks = np.arange(1, max(config.ks) + 1)
    c, v = config.cost.cost_ratio, config.cost.verify_cost
    with figure_style():
        fig = new_figure(5.0 * len(config.modes), 4.5)
        axes = np.atleast_1d(fig.subplots(1, len(config.modes), sharey=True, squeeze=False)[0])
        for ax, mode in zip(axes, config.modes, strict=True):
            for a in config.agreements:
                cells = _cells(result, mode, a)
                rate, colour = cells[0].acceptance_analytic, _colour(result, a)
                if quantity == "tau":
                    curve = [expected_tokens_per_call(rate, int(k)) for k in ks]
                    points, errors = [x.tau_mc for x in cells], [2 * x.tau_se for x in cells]
                else:
                    curve = [expected_speedup(rate, int(k), c, v) for k in ks]
                    points, errors = [x.speedup_mc for x in cells], None
                ax.plot(ks, curve, "-", color=colour, linewidth=1.2, label=_rate_label(mode, cells))
                ax.errorbar(
                    [x.k for x in cells], points, yerr=errors, fmt=_MARKERS[mode], color=colour, capsize=3
                )
            if quantity == "speedup":
                ax.axhline(1.0, color=COLOURS["neutral"], linewidth=0.8, linestyle=":")
            ax.set(xlabel="draft length K")
            ax.set_title(f"{mode}: lines analytic, points Monte-Carlo", fontsize=10)
            ax.legend(fontsize=8)
        axes[0].set_ylabel("tokens per target call τ" if quantity == "tau" else "speedup over plain decoding")
        fig.suptitle(
            "Tokens per target call vs K: E[L] = 1 + α + … + α^K"
            if quantity == "tau"
            else f"Speedup vs K at cost ratio c = {c:g}: τ / (v(K+1) + K·c)"
        )
    return fig


def speedup_cost_figure(result: SimulationResult) -> Figure:
    """Analytic speedup over K × cost ratio, one heatmap per agreement (sampled mode, α = a)."""
    config = result.config
    k_top = max(max(config.ks), _MIN_HEATMAP_K)
    if config.cost.max_k is not None:
        k_top = min(k_top, config.cost.max_k)
    ks = np.arange(1, k_top + 1)
    agreements = sorted(config.agreements)
    v = config.cost.verify_cost
    with figure_style():
        fig = new_figure(4.2 * len(agreements) + 1.0, 4.2)
        axes = fig.subplots(1, len(agreements), sharey=True, squeeze=False)[0]
        grids = [
            np.array([[expected_speedup(a, int(k), float(c), v) for k in ks] for c in _COST_RATIOS])
            for a in agreements
        ]  # each [cost ratios, K]
        high = max(2.0, max(float(g.max()) for g in grids))
        norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=high)
        for ax, a, grid in zip(axes, agreements, grids, strict=True):
            image = ax.pcolormesh(ks, _COST_RATIOS, grid, cmap="RdYlGn", norm=norm, shading="nearest")
            if grid.min() < 1.0 < grid.max():
                ax.contour(ks, _COST_RATIOS, grid, levels=[1.0], colors="black", linewidths=1.0)
            best = ks[np.argmax(grid, axis=1)]
            ax.plot(best, _COST_RATIOS, color="white", linewidth=1.5, label="best K", path_effects=_OUTLINED)
            ax.axhline(
                config.cost.cost_ratio, color="black", linestyle="--", linewidth=0.8, label="simulated c"
            )
            ax.set(xlabel="draft length K", title=f"α = {a:g}")
            ax.grid(False)
        axes[0].set_ylabel("cost ratio c = T_draft / T_target")
        axes[0].legend(fontsize=8, loc="upper right")
        fig.colorbar(image, ax=list(axes), label="analytic speedup (black line: 1, break-even)")
        fig.suptitle("Speedup vs K and cost ratio (sampled, α = a)")
    return fig


def simulation_charts(result: SimulationResult, out_dir: str | os.PathLike) -> list[Path]:
    """Write the charts of the module doc into ``out_dir`` (created if needed); returns the paths written."""
    out_dir = chart_directory(out_dir)
    figures = {
        "acceptance": acceptance_figure(result),
        "tokens_per_call": _per_k_figure(result, "tau"),
        "speedup": _per_k_figure(result, "speedup"),
        "speedup_cost": speedup_cost_figure(result),
    }
    return [path for name in CHARTS for path in save_figure(figures[name], out_dir / name)]

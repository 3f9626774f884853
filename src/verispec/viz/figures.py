"""The shared look of verispec's figures, and their output as PNG + SVG.

One palette everywhere: green is mass (or a token) that is accepted, red is draft mass that can be rejected
(and a rejected draft token), blue is the residual a rejection resamples from (and a recovered token),
amber is a bonus token.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure
from matplotlib.typing import RcKeyType

from verispec.errors import UsageError
from verispec.files import atomic_path, check_writable

__all__ = ["COLOURS", "FIGURE_FORMATS", "figure_paths", "figure_style", "new_figure", "save_figure"]

COLOURS = {
    "accepted": "#2e9d4e",
    "rejected": "#d64541",
    "recovered": "#3b6fd6",
    "residual": "#3b6fd6",
    "bonus": "#e69f00",
    "plain": "#8c8c8c",  # a plain step's token (a trace round that drafted nothing)
    "neutral": "#555555",
}
FIGURE_FORMATS = ("png", "svg")

_DPI = 120

_STYLE: dict[RcKeyType, Any] = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.frameon": False,
    "svg.fonttype": "none",  # text stays text in the SVG
    "svg.hashsalt": "verispec",  # the same figure gives the same SVG
}


def figure_style() -> contextlib.AbstractContextManager:
    """The context in which verispec figures are built and saved (matplotlib reads its style settings when
    an artist is created and when a file is written)."""
    return matplotlib.rc_context(_STYLE)


def new_figure(width: float, height: float) -> Figure:
    """A figure of ``width`` × ``height`` inches, not registered with pyplot; build it inside
    :func:`figure_style`."""
    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def figure_paths(out: str | os.PathLike) -> tuple[Path, ...]:
    """The PNG and SVG paths for ``out``: ``name.png``, ``name.svg`` or ``name`` all give both
    (``name.png`` and ``name.svg``); any other extension is a UsageError."""
    out = Path(out)
    if out.suffix.lower() in tuple(f".{f}" for f in FIGURE_FORMATS):
        out = out.with_suffix("")
    elif out.suffix:
        raise UsageError(f"figure output {out} must end in .png or .svg, or have no extension (both)")
    return tuple(check_writable(out.with_name(f"{out.name}.{f}")) for f in FIGURE_FORMATS)


def save_figure(fig: Figure, out: str | os.PathLike) -> tuple[Path, ...]:
    """Write ``fig`` as PNG and SVG (see :func:`figure_paths`), atomically; returns the paths written."""
    paths = figure_paths(out)
    with figure_style():
        for path in paths:
            with atomic_path(path) as tmp:
                fig.savefig(tmp, format=path.suffix[1:], dpi=_DPI)
    return paths

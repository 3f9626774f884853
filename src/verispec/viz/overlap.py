"""The p/q overlap picture: which probability mass rejection sampling always accepts, which it can reject,
and what a rejection resamples from, at one next-token position.

For a target distribution p and a draft distribution q over the same vocabulary, a token x drawn from q is
accepted with probability min(1, p(x) / q(x)). Per token:

- min(p(x), q(x)) is mass that is always accepted (green); its sum is the acceptance probability
  α = Σ min(p, q) (:func:`verispec.costs.analytic.acceptance_rate`);
- (q(x) − p(x))⁺ is q's excess over p (red): the draft mass that can be rejected, 1 − α in all;
- (p(x) − q(x))⁺ is the residual (blue), also 1 − α in all: a rejection resamples from it, normalized.

The picture draws, for the ``top`` tokens of largest max(p, q) and one bar for all the others, a p bar
(green + blue = p) beside a q bar (green + red = q), and below them the normalized residual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.typing import LineStyleType

from verispec.costs.analytic import acceptance_rate
from verispec.errors import UsageError
from verispec.inputs import check_int
from verispec.models.base import LanguageModel
from verispec.options import SamplingParams
from verispec.sampling import probs_from_logits
from verispec.viz.figures import COLOURS, figure_style, new_figure

__all__ = ["OverlapBars", "next_token_distributions", "overlap_bars", "overlap_figure"]

LEGEND = {  # bar colour -> legend text; the bars carry the colour name as their gid
    "accepted": "min(p, q): always accepted",
    "residual": "(p − q)⁺: residual, resampled on rejection",
    "rejected": "(q − p)⁺: q's excess, can be rejected",
}


@dataclass(frozen=True)
class OverlapBars:
    """The bars of the overlap picture: the shown tokens, then (when any are left) one bar for the rest.

    Each array has one entry per bar [N or N + 1]; green + blue = p, green + red = q, and over the whole
    vocabulary Σ green = α, Σ red = Σ blue = 1 − α.
    """

    tokens: tuple[int, ...]  # [N] the shown token ids, by decreasing max(p, q)
    rest: int  # how many tokens the last bar sums (0: no such bar)
    p: np.ndarray
    q: np.ndarray
    green: np.ndarray  # min(p, q): always accepted
    red: np.ndarray  # (q − p)⁺: q's excess, can be rejected
    blue: np.ndarray  # (p − q)⁺: the residual
    alpha: float  # Σ min(p, q) over the whole vocabulary

    @property
    def residual(self) -> np.ndarray:
        """The distribution a rejection resamples from, normalize((p − q)⁺), per bar (zeros when p = q)."""
        return self.blue / (1.0 - self.alpha) if self.alpha < 1.0 else np.zeros_like(self.blue)


def overlap_bars(*, p: object, q: object, top: int) -> OverlapBars:
    """The bars for distributions p, q [V] and the ``top`` ≥ 1 tokens of largest max(p, q); one-line
    UsageError unless p and q are distributions (as :func:`verispec.costs.analytic.acceptance_rate`
    checks) of the same length."""
    try:
        p, q = (np.asarray(x, dtype=np.float64) for x in (p, q))
    except (TypeError, ValueError):
        raise UsageError("p and q must be lists of numbers") from None
    if p.ndim != 1 or p.shape != q.shape:
        raise UsageError(f"p and q must be lists of the same length, got shapes {p.shape} and {q.shape}")
    check_int(top, "top", 1)
    alpha = acceptance_rate(p=p, q=q)  # validates: non-empty, finite, non-negative, each summing to 1
    assert isinstance(alpha, float)  # one α for one pair of distributions [V]
    order = np.lexsort((np.arange(p.size), -np.maximum(p, q)))  # by max(p, q) down, then by id
    shown, others = order[:top], order[top:]

    def per_bar(values: np.ndarray) -> np.ndarray:  # [V] -> [N (+1)]
        return np.append(values[shown], values[others].sum()) if others.size else values[shown]

    return OverlapBars(
        tokens=tuple(int(i) for i in shown),
        rest=int(others.size),
        p=per_bar(p),
        q=per_bar(q),
        green=per_bar(np.minimum(p, q)),
        red=per_bar(np.maximum(q - p, 0.0)),
        blue=per_bar(np.maximum(p - q, 0.0)),
        alpha=alpha,
    )


def overlap_figure(
    *, p: object, q: object, top: int = 12, label: Callable[[int], str] = str, title: str = ""
) -> Figure:
    """The overlap picture of p and q [V] (see the module doc); ``label(token_id)`` names a token."""
    bars = overlap_bars(p=p, q=q, top=top)
    names = [label(t) for t in bars.tokens] + ([f"{bars.rest} others"] if bars.rest else [])
    x = np.arange(len(names))  # [N (+1)]
    width = 0.38
    with figure_style():
        fig_width = max(6.5, 0.75 * len(names) + 2.0)
        fig = new_figure(fig_width, 6.0)
        top_ax, bottom_ax = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
        layers = (  # (offset, bottom, height, colour): the p bar on the left, the q bar on the right
            (-width / 2, 0.0, bars.green, "accepted"),
            (-width / 2, bars.green, bars.blue, "residual"),
            (width / 2, 0.0, bars.green, "accepted"),
            (width / 2, bars.green, bars.red, "rejected"),
        )
        for offset, bottom, height, colour in layers:
            top_ax.bar(x + offset, height, width, bottom=bottom, color=COLOURS[colour], gid=colour)
        for offset, height, style in ((-width / 2, bars.p, "-"), (width / 2, bars.q, "--")):
            outline = top_ax.bar(
                x + offset, height, width, fill=False, edgecolor="black", linewidth=0.8, linestyle=style
            )
            shown = [f"{v:.2f}" if v >= 0.005 else "" for v in height]  # no clutter of 0.00 labels
            top_ax.bar_label(outline, labels=shown, fontsize=7, padding=1)
        outlines: tuple[tuple[LineStyleType, str], ...] = (
            ("-", "p (target): left bar"),
            ("--", "q (draft): right bar"),
        )
        legend = [Patch(color=COLOURS[colour], label=text) for colour, text in LEGEND.items()] + [
            Patch(fill=False, edgecolor="black", linestyle=style, label=text) for style, text in outlines
        ]
        fig.legend(handles=legend, loc="outside upper center", ncols=3 if fig_width > 9 else 2, fontsize=8)
        top_ax.set_ylabel("probability")
        top_ax.set_axisbelow(True)
        alpha = f"α = Σ min(p, q) = {bars.alpha:.4f}"
        heading = f"{alpha}      rejection probability 1 − α = {1 - bars.alpha:.4f}"
        top_ax.set_title(f"{title}\n{heading}" if title else heading)
        bottom_ax.bar(x, bars.residual, 0.6, color=COLOURS["residual"])
        bottom_ax.set_axisbelow(True)
        bottom_ax.set_ylabel("probability")
        bottom_ax.set_title(
            "on rejection, the next token is drawn from (p − q)⁺ / (1 − α)"
            if bars.alpha < 1.0
            else "p = q: nothing is ever rejected",
            fontsize=9,
        )
        bottom_ax.set_xticks(x, names, rotation=45, ha="right", rotation_mode="anchor")
    return fig


def next_token_distributions(
    target: LanguageModel, draft: LanguageModel, prompt_ids: list[int], sampling: SamplingParams
) -> tuple[np.ndarray, np.ndarray]:
    """p and q [V] float64: the target's and the draft's distributions of the token after ``prompt_ids``,
    both through :func:`verispec.sampling.probs_from_logits` with ``sampling`` (exactly as the engine)."""
    if draft.vocab_size != target.vocab_size:
        raise UsageError(
            f"the draft has {draft.vocab_size} tokens, the target {target.vocab_size}: "
            "the draft must share the target's vocabulary"
        )
    limit = min(target.max_context, draft.max_context)
    if not prompt_ids or len(prompt_ids) > limit:
        raise UsageError(f"the prompt must have 1 to {limit} tokens, got {len(prompt_ids)}")

    def last(model: LanguageModel) -> np.ndarray:
        tokens = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)  # [1, T]
        positions = torch.arange(len(prompt_ids), device=model.device).unsqueeze(0)  # [1, T]
        with torch.inference_mode():
            logits = model.forward(tokens, positions, model.new_cache())[0, -1]  # [V]
        probs = probs_from_logits(logits, sampling).double().cpu().numpy()  # [V]
        return probs / probs.sum()  # float32 rounding of the sum, removed

    return last(target), last(draft)

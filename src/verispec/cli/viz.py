"""``verispec simulate`` (the analytic model against Monte Carlo) and ``verispec viz overlap`` (p and q
drawn)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from verispec.cli.common import (
    across_fields,
    add_model_specs,
    add_sampling_arguments,
    add_threads_argument,
    format_table,
    joined_values,
    list_of,
)
from verispec.costs.simulate import SimulationConfig, simulate  # numpy: no torch
from verispec.errors import UsageError

if TYPE_CHECKING:
    from verispec.options import SamplingParams

__all__ = ["add_simulate_parser", "add_viz_parser", "run_simulate", "run_viz_overlap"]


_SIMULATE_COLUMNS = (
    ("mode", "mode", ""),
    ("agreement", "agreement", "g"),
    ("K", "k", "d"),
    ("acceptance", "acceptance", ".4f"),
    ("tau MC", "tau_mc", ".3f"),
    ("tau analytic", "tau_analytic", ".3f"),
    ("speedup MC", "speedup_mc", ".3f"),
    ("speedup analytic", "speedup_analytic", ".3f"),
)


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec simulate``."""
    defaults = SimulationConfig()
    parser = subparsers.add_parser(
        "simulate",
        help="Monte-Carlo speculative rounds on toy distributions vs the analytic model",
        description="Simulate speculative rounds on toy draft/target pairs whose acceptance rate equals the "
        "agreement, in sampled and greedy modes, and compare tokens per target call (tau) and speedup "
        "with the analytic model (see verispec.costs.simulate).",
    )
    parser.add_argument(
        "--k",
        type=list_of(int, "integers"),
        default=joined_values(defaults.ks),
        help="draft lengths K, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--agreement",
        type=list_of(float, "numbers"),
        default=joined_values(defaults.agreements),
        help="agreement levels in [0, 1], comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--cost-ratio",
        type=float,
        default=defaults.cost_ratio,
        help="cost of a draft step / cost of a target step (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="random seed (default: %(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=defaults.rounds, help="rounds per cell (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--plot",
        metavar="DIR",
        help="also write the charts (acceptance, tokens_per_call, speedup, speedup_cost; PNG + SVG) into DIR",
    )
    parser.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``verispec simulate``: print the table (or the JSON object) of every cell."""
    config = SimulationConfig(
        ks=args.k, agreements=args.agreement, cost_ratio=args.cost_ratio, seed=args.seed, rounds=args.rounds
    )
    if args.plot is not None:
        from verispec.viz.charts import chart_directory, simulation_charts  # matplotlib: only when asked

        chart_directory(args.plot)
    result = simulate(config)
    if args.plot is not None:
        paths = simulation_charts(result, args.plot)
        print(f"charts written: {', '.join(str(p) for p in paths)}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(
        f"{config.rounds} rounds per cell, seed {config.seed}, cost ratio c = {config.cost_ratio:g}, "
        "verification cost v = 1; speedup = tau / (1 + K*c)"
    )
    print(format_table(result.to_dict()["cells"], _SIMULATE_COLUMNS))
    return 0


def add_viz_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec viz`` and its pictures (``overlap``)."""
    parser = subparsers.add_parser(
        "viz",
        help="pictures of speculative decoding",
        description="Pictures of speculative decoding drawn from real runs (PICTURE --help for each). The "
        "token-fate trace is `generate --trace`, the simulation charts `simulate --plot`.",
    )
    pictures = parser.add_subparsers(dest="picture", metavar="PICTURE", required=True)
    overlap = pictures.add_parser(
        "overlap",
        help="the p/q overlap at one next-token position (PNG + SVG)",
        description="Draw the target's (p) and the draft's (q) distributions of one next token: the mass "
        "min(p, q) that is always accepted (green), q's excess over p that can be rejected (red) and the "
        "residual (p - q)+ that a rejection resamples from (blue), annotated with the acceptance probability "
        "alpha = sum min(p, q). Either toy distributions (--p, --q) or a real model's next token after "
        "--prompt (--target, --draft).",
    )
    overlap.add_argument("--p", type=list_of(float, "numbers"), help="toy target distribution: 0.5,0.3,0.2")
    overlap.add_argument("--q", type=list_of(float, "numbers"), help="toy draft distribution, as long as --p")
    overlap.add_argument("--labels", type=list_of(str, "names"), help="toy token names, comma-separated")
    overlap.add_argument("--prompt", help="model mode: the distributions of the token after this prompt")
    add_model_specs(overlap)
    overlap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_arguments(overlap, temperature=1.0)
    overlap.add_argument(
        "--top", type=int, default=12, help="tokens shown, the rest as one bar (default: 12)"
    )
    overlap.add_argument(
        "--out",
        default="overlap.png",
        metavar="FILE",
        help="FILE.png, FILE.svg or FILE: writes FILE.png and FILE.svg; a directory: overlap.png and "
        "overlap.svg in it (default: overlap.png)",
    )
    add_threads_argument(overlap)
    overlap.set_defaults(func=run_viz_overlap)


def run_viz_overlap(args: argparse.Namespace) -> int:
    """Run ``verispec viz overlap``: draw the picture, print alpha and the files written."""
    from verispec.costs.analytic import acceptance_rate
    from verispec.viz.figures import figure_paths, save_figure
    from verispec.viz.overlap import overlap_figure

    toy = args.p is not None or args.q is not None or args.labels is not None
    if toy == (args.prompt is not None):
        raise UsageError("give either --p and --q (toy distributions) or --prompt (a model's next token)")
    if Path(args.out).is_dir():  # a directory: the picture's files inside it
        args.out = str(Path(args.out) / "overlap")
    figure_paths(args.out)  # validate the output before any work
    from verispec.options import SamplingParams

    # validated in either mode
    sampling = SamplingParams(args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    if toy and sampling != SamplingParams(temperature=1.0):
        raise UsageError(
            "toy mode draws --p and --q as they are: --temperature, --top-k, --top-p and --min-p transform a "
            "model's logits (give --prompt)"
        )
    if toy:
        if args.p is None or args.q is None:
            raise UsageError("toy mode needs both --p and --q")
        if args.labels is not None and len(args.labels) != len(args.p):
            raise UsageError(f"--labels names {len(args.labels)} tokens, --p has {len(args.p)}")
        names = args.labels or tuple(str(i) for i in range(len(args.p)))
        p, q, label, title = args.p, args.q, names.__getitem__, "toy distributions"
    else:
        p, q, label, title = _model_overlap(args, sampling)
    paths = save_figure(overlap_figure(p=p, q=q, top=args.top, label=label, title=title), args.out)
    print(f"alpha = sum min(p, q) = {acceptance_rate(p=p, q=q):.6f}")  # p and q were validated by the figure
    print(f"written: {', '.join(str(path) for path in paths)}")
    return 0


def _model_overlap(args: argparse.Namespace, sampling: SamplingParams):
    """(p, q, label, title) of the next token after --prompt under ``sampling``, for
    :func:`run_viz_overlap`."""
    from verispec.api import Speculator
    from verispec.drafting.registry import DRAFT_MODEL
    from verispec.models.names import DEFAULT_MODEL
    from verispec.viz import visible_text
    from verispec.viz.overlap import next_token_distributions

    speculator = Speculator(
        args.target, args.draft, DRAFT_MODEL, args.tokenizer, precision=args.precision, **across_fields(args)
    )
    if speculator.pair is not None:
        raise UsageError("viz overlap draws p and q over one vocabulary: the draft must share the target's")
    assert speculator.draft is not None  # the model drafter refuses to be built without one
    prompt_ids = speculator.encode_prompt(args.prompt, args.chat)
    p, q = next_token_distributions(speculator.model, speculator.draft, prompt_ids, sampling)

    def label(token_id: int) -> str:
        return visible_text(speculator.tokenizer.decode([token_id]), token_id)

    prompt = args.prompt if len(args.prompt) <= 40 else f"…{args.prompt[-40:]}"
    target = args.target or DEFAULT_MODEL
    target = os.path.basename(target) if os.path.exists(target) else target  # a file: its name suffices
    title = f"next token after {prompt!r}\ntarget {target}, draft {args.draft}"
    return p, q, label, title

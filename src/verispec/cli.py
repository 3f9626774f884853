"""The ``verispec`` command line (also ``python -m verispec``).

Each subcommand is a pair of functions: ``add_<name>_parser(subparsers)`` declares its arguments and binds
``run_<name>`` with ``set_defaults(func=...)``; ``run_<name>(args) -> int`` does the work and returns the exit
status. To add one, write the pair and call ``add_<name>_parser`` from :func:`build_parser`.

Error contract: bad usage (unknown flag or subcommand, unparsable value) and any
:class:`~verispec.errors.UsageError` raised while running (the library's validation convention) print
exactly one line ``verispec: error: <message>`` on stderr and exit with status 2. Any other exception is a
bug (ours or a library's): one line ``verispec: internal error: ...`` asking for a report, exit status 1,
and its traceback with ``--debug``. Ctrl-C exits with 130 after one line; a closed output pipe
(``verispec ... | head``) exits quietly with 141 (128 + SIGPIPE, as a process killed by it would).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from verispec import __version__
from verispec.analysis.simulate import SimulationConfig, simulate  # numpy: no torch
from verispec.cores import use_threads
from verispec.drafting.registry import AUTO as AUTO_DRAFTER
from verispec.drafting.registry import CROSS_TOKENIZER, DRAFTERS, drafter_names
from verispec.errors import UsageError
from verispec.files import check_writable
from verispec.inputs import is_int

if TYPE_CHECKING:  # the modules that load torch (and transformers) are imported by the commands that run
    from verispec.grammar.constraint import Constraint
    from verispec.options import SamplingParams
    from verispec.sequence import GenerationStats
    from verispec.trace import Trace

__all__ = ["add_simulate_parser", "build_parser", "format_table", "main", "run_simulate"]

PROG = "verispec"

_INTERNAL_ERROR = 1
_USAGE_ERROR = 2
_INTERRUPTED = 130  # 128 + SIGINT
_BROKEN_PIPE = 141  # 128 + SIGPIPE


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises UsageError instead of printing usage and exiting, so that :func:`main`
    reports every error the same way (subparsers are created with this class too)."""

    def error(self, message: str) -> NoReturn:
        """Raise the usage error for :func:`main` to report."""
        raise UsageError(message)


def _list_of(convert: Callable[[str], Any], what: str) -> Callable[[str], tuple]:
    """An argparse ``type`` parsing a comma-separated list of values with ``convert`` (ranges are checked by
    the library's configs, not here)."""

    def parse(text: str) -> tuple:
        """The values of ``text``, or ArgumentTypeError (argparse reports it as one line)."""
        try:
            return tuple(convert(item) for item in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None

    return parse


def _joined(values: Sequence[Any]) -> str:
    """values as the comma-separated text a list option takes (argparse parses string defaults too)."""
    return ",".join(str(v) for v in values)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """An aligned text table. columns: (header, key in each row, format spec such as ".3f"); the first column
    is left-aligned, the others right-aligned."""
    cells = [[header for header, _, _ in columns]]
    cells += [[format(row[key], spec) for _, key, spec in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    align = [str.ljust] + [str.rjust] * (len(columns) - 1)
    return "\n".join(
        "  ".join(a(cell, w) for a, cell, w in zip(align, line, widths, strict=True)) for line in cells
    )


# ---------------------------------------------------------------------------------------------- simulate

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
        "with the analytic model (see verispec.analysis.simulate).",
    )
    parser.add_argument(
        "--k",
        type=_list_of(int, "integers"),
        default=_joined(defaults.ks),
        help="draft lengths K, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--agreement",
        type=_list_of(float, "numbers"),
        default=_joined(defaults.agreements),
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


# ---------------------------------------------------------------------------------------------- generate


def _add_model_specs(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the target and the draft model (generate, demo, viz overlap)."""
    parser.add_argument("--target", metavar="SPEC", help="target model (default: smollm2-135m)")
    parser.add_argument("--tokenizer", metavar="FILE", help="tokenizer file, for llama2.c checkpoints")
    parser.add_argument(
        "--draft",
        metavar="SPEC",
        help="draft model (a tokenizer other than the target's drafts across tokenizers) or layers:N "
        "(early exit)",
    )
    parser.add_argument(
        "--draft-tokenizer", metavar="FILE", help="the draft's tokenizer, a file of its own (llama2.c)"
    )
    parser.add_argument(
        "--cross-tokenizer",
        choices=CROSS_TOKENIZER,
        default="auto",
        help="with a draft of another tokenizer: tli (token-level intersection: the draft's q over the "
        "tokens both share), string (its text re-encoded and guessed) or auto (default: whichever has "
        "committed more per unit of cost so far)",
    )
    parser.add_argument(
        "--precision",
        type=_precision,
        default="auto",
        metavar="PRECISION",
        help="weights of the native models on the CPU: fp32 (oneDNN), or on verispec's native kernels fp16, "
        "q8_0 or q4_1 (GGUF blocks, 8-bit activations): each another target, whose output is exactly its "
        "own; "
        "auto (default): the checkpoint's own format where the kernels run it, else fp16, else fp32",
    )


def _precision(value: str) -> str:
    """--precision's type: one of :data:`verispec.models.llama.PRECISION_CHOICES` (torch), read only when a
    value other than the default auto is given (the help names them in words: --help imports no torch)."""
    if value == "auto":
        return value
    from verispec.models.llama import PRECISION_CHOICES

    if value not in PRECISION_CHOICES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {value!r} (choose from {', '.join(PRECISION_CHOICES)})"
        )
    return value


def _across(args: argparse.Namespace) -> dict[str, Any]:
    """The Speculator's options for a draft of another tokenizer, from the flags."""
    return {"draft_tokenizer": args.draft_tokenizer, "cross_tokenizer": args.cross_tokenizer}


def _model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The fields of a :class:`~verispec.api.ModelChoice` (the models and the drafter), from the flags."""
    return {
        **({"target": args.target} if args.target else {}),
        "tokenizer": args.tokenizer,
        "draft": args.draft,
        "drafter": args.drafter,
        "drafter_path": args.drafter_path,
        "precision": args.precision,
        **_across(args),
    }


def _no_draft_model(args: argparse.Namespace, command: str) -> None:
    """UsageError for the draft-model flags of a command whose drafters need none."""
    flags = {"--draft": args.draft is not None, "--draft-tokenizer": args.draft_tokenizer is not None,
             "--cross-tokenizer": args.cross_tokenizer != "auto"}  # fmt: skip
    if given := [flag for flag, set_ in flags.items() if set_]:
        raise UsageError(f"{command} runs drafters that need no draft model: leave out {', '.join(given)}")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the models and the drafter, K and the output's length (generate, demo)."""
    _add_drafter_arguments(parser)
    parser.add_argument(
        "--k",
        help="draft tokens per round: N >= 0, 'additive', or 'auto' (the K that the calibrated costs and the "
        "running acceptance rate favour, 0 included); default: auto, and with the learned drafter its token "
        "tree [[0], [1], [2], [0, 0]] instead of a chain",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="tokens to generate (default: 128); more than the target's context leaves after the prompt: a "
        "warning, and generation stops at the context",
    )


def _add_drafter_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the models and the drafter (generate, demo, serve)."""
    _add_model_specs(parser)
    kinds = "; ".join(f"{name}: {kind.summary}" for name, kind in DRAFTERS.items())
    parser.add_argument(
        "--drafter",
        default=AUTO_DRAFTER,
        help="auto (default): model with --draft, else the learned drafter shipped for the target (or given "
        f"by --drafter-path), else ngram; {kinds}",
    )
    parser.add_argument(
        "--drafter-path", metavar="FILE", help="a learned drafter (verispec train-drafter) for the target"
    )
    _add_threads_argument(parser)


def _add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``, on every command that runs a model (applied by :func:`main` before it runs)."""
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads for the models (default: OMP_NUM_THREADS if set, else the cores this process may use: "
        "its CPU affinity, capped by a container's CPU quota); on a busy machine the native kernels drop to "
        "one by themselves; outputs never depend on it",
    )


def _add_suffix_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a suffix drafter's cache kept across runs (generate, batch, serve)."""
    shared = drafter_names(lambda kind: kind.shared_cache)
    group = parser.add_argument_group(
        "suffix cache",
        f"the {shared} drafter's cache of earlier outputs, kept in a file (README: the suffix drafter)",
    )
    group.add_argument(
        "--suffix-cache",
        metavar="FILE",
        help="load the cache from FILE at start (when it exists), save it there at exit (Ctrl-C too)",
    )
    group.add_argument(
        "--suffix-budget",
        type=int,
        metavar="N",
        help="tokens the cache holds, the oldest evicted beyond (~32 bytes a token; default: FILE's, else "
        "1000000)",
    )


def _suffix_fields(args: argparse.Namespace) -> dict[str, Any]:
    """A :class:`~verispec.options.ModelChoice`'s suffix cache fields, from the flags."""
    return {"suffix_cache_file": args.suffix_cache, "suffix_budget": args.suffix_budget}


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec generate``."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate text from PROMPT (or standard input) with speculative decoding; the text "
        "streams to stdout and a one-line summary goes to stderr (--json: one JSON object on stdout).",
    )
    parser.add_argument(
        "prompt", nargs="?", metavar="PROMPT", help="the prompt (default: read standard input)"
    )
    _add_model_arguments(parser)
    _add_suffix_arguments(parser)
    _add_sampling_arguments(parser, temperature=0.0)
    parser.add_argument("--seed", type=int, help="seed of all sampling (default: random)")
    _add_invariant_argument(parser)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    _add_constraint_arguments(parser)
    parser.add_argument(
        "--batch",
        metavar="FILE.jsonl",
        help='generate for every request of a JSONL file ({"id", "prompt"} or {"id", "messages"} per line; '
        "messages are a chat) in a continuous batch; --json: one JSON line per request",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=8,
        metavar="N",
        help="sequences decoded at once with --batch (default: 8)",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE.html",
        help="write a token-fate trace: one self-contained HTML file, each token coloured by its fate",
    )
    parser.add_argument(
        "--show-trace",
        action="store_true",
        help="print the text as a token-fate trace (ANSI colours on a terminal, else [recovered] {bonus} "
        "~rejected~ markers) instead of streaming it",
    )
    tree = parser.add_argument_group(
        "token trees",
        f"the {drafter_names(lambda kind: kind.takes_trees)} drafter proposes a tree of alternatives each "
        "round, scored by the target in one forward (give no --k with one)",
    )
    tree.add_argument("--tree-width", type=int, metavar="W", help="children of every tree node")
    tree.add_argument("--tree-depth", type=int, metavar="D", help="draft tokens on each root-to-leaf path")
    tree.add_argument(
        "--tree-shape",
        metavar="FILE",
        help="a JSON tree shape: a list of paths of child ranks, e.g. [[0], [1], [0, 0]]",
    )
    tree.add_argument(
        "--tree-nodes",
        metavar="N|auto",
        help="a dynamic tree (eagle drafter, EAGLE-2): each round expands the likeliest nodes of the shape "
        "and verifies its N likeliest draft nodes, or with auto as many as this machine's calibrated costs "
        "pay for",
    )
    parser.set_defaults(func=run_generate)


def _tree_shape(args: argparse.Namespace):
    """The tree shape that --tree-width/--tree-depth or --tree-shape give, or None (chain rounds)."""
    from verispec.drafting.tree import AUTO, TreeShape, parse_budget

    sized = args.tree_width is not None or args.tree_depth is not None
    if sized and args.tree_shape is not None:
        raise UsageError("give either --tree-width and --tree-depth or --tree-shape, not both")
    if args.tree_shape is not None:
        shape = TreeShape.load(args.tree_shape)
    elif not sized:
        if args.tree_nodes is not None:
            raise UsageError("--tree-nodes needs a tree: --tree-width and --tree-depth, or --tree-shape")
        return None
    elif args.tree_width is None or args.tree_depth is None:
        raise UsageError("--tree-width and --tree-depth go together")
    else:
        shape = TreeShape.full(args.tree_width, args.tree_depth)
    if args.tree_nodes is None:
        return shape
    budget = parse_budget(args.tree_nodes)
    if budget is None:
        raise UsageError(f"--tree-nodes takes an integer >= 1 or {AUTO}, got {args.tree_nodes!r}")
    return shape.with_budget(budget)


def _add_sampling_arguments(parser: argparse.ArgumentParser, temperature: float) -> None:
    """The flags of the sampling transform (generate, viz overlap)."""
    parser.add_argument(
        "--temperature", type=float, default=temperature, help=f"0 is greedy (default: {temperature:g})"
    )
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)"
    )
    parser.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below min_p × the top probability"
    )


def _add_invariant_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--invariant",
        action=argparse.BooleanOptionalAction,
        help="draw each position's token from the seed and the position alone: sampled output is then the "
        "target's own with that seed, the same whatever the drafter, K or batch (default: when a seed is "
        "given). --no-invariant: rejection sampling's draws, accepted a little more often by a sampling "
        "drafter, the tokens then depending on the drafter, K and batch",
    )


# ------------------------------------------------------------------------------------- structured output


def _add_constraint_arguments(parser: argparse.ArgumentParser) -> None:
    """--json-schema, --regex, --grammar (generate, batch): one of them."""
    group = parser.add_argument_group(
        "structured output",
        "constrain the output (exactly: distributed as constrained sampling without speculation); one of "
        'these, or a batch line\'s own "json_schema", "regex" or "grammar" key',
    ).add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", help="a JSON schema file: the output is such JSON")
    group.add_argument("--regex", metavar="TEXT", help="a regular expression the whole output matches")
    group.add_argument("--grammar", metavar="FILE", help="a grammar file, Lark or GBNF (llguidance's)")


def _constraint(args: argparse.Namespace) -> Constraint | None:
    """The constraint the flags give, its file read and checked before any model loads (UsageError)."""
    from verispec.grammar.constraint import Constraint

    def read(path: str | None) -> str | None:
        if path is None:
            return None
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None

    return Constraint.of(read(args.json_schema), args.regex, read(args.grammar))


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """The sampling parameters of a command with a seed (generate, batch)."""
    from verispec.options import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed, args.invariant)


def _option_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The fields of a :class:`~verispec.options.GenerationOptions` (generate, batch), from the flags."""
    return dict(
        k=args.k if args.k is not None else "auto",
        max_new_tokens=args.max_new_tokens,
        sampling=_sampling(args),
        chat=args.chat,
        stop=tuple(args.stop),
        constraint=_constraint(args),
    )


def run_generate(args: argparse.Namespace) -> int:
    """Run ``verispec generate``."""
    from verispec.drafting.tree import AUTO
    from verispec.options import GenerationOptions

    if args.batch is not None:
        return _run_batch(args)
    prompt = args.prompt if args.prompt is not None else _read_stdin()
    options = GenerationOptions(**_option_fields(args))  # every argument checked before a model loads
    sampling = options.sampling
    if args.show_trace and args.json:
        raise UsageError("--show-trace and --json both write to standard output: choose one")
    if args.trace is not None:
        check_writable(args.trace)
    tree = _tree_shape(args)
    if tree is not None and args.k is not None:
        raise UsageError(
            "--k is not used with a token tree (its shape sets what each round drafts): leave it out"
        )
    tracing = args.trace is not None or args.show_trace
    if tree is not None and tracing:
        raise UsageError("token-fate traces record chain rounds only, not token trees")
    if tracing and sampling.invariant and not sampling.greedy:
        raise UsageError(
            "token-fate traces show rejection sampling's odds, not invariant draws (a seed's default): "
            "add --no-invariant"
        )
    if tree is None and args.k is None and not tracing:
        tree = AUTO  # the learned drafter's tree, where it drafts
    from verispec.options import ModelChoice

    choice = ModelChoice(**_model_fields(args), **_suffix_fields(args))
    speculator = choice.speculator(tree=tree)
    try:
        return _generate(args, speculator, prompt, options, tracing)
    finally:  # Ctrl-C too
        choice.save_suffix_cache(speculator.suffix_cache)


def _generate(args: argparse.Namespace, speculator, prompt: str, options, tracing: bool) -> int:
    """``verispec generate`` of one prompt by ``speculator``: the text streamed (or --json), the summary."""
    from verispec.sequence import GenerationStats
    from verispec.trace import TraceRecorder

    room = speculator.model.max_context - len(speculator.encode_prompt(prompt, args.chat))
    if 0 < room < args.max_new_tokens:  # no room at all: generation refuses the prompt, in one line
        _warn(
            f"--max-new-tokens {args.max_new_tokens} is more than the target's context of "
            f"{speculator.model.max_context} tokens leaves after this prompt: at most {room} new tokens"
        )
    recorder = TraceRecorder() if tracing else None
    if args.json:
        result = speculator.generate(prompt, options, trace=recorder)
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats}))
        stats = result.stats
    else:
        live = GenerationStats(speculator.drafter_name, speculator.k_label(options.k))
        for chunk in speculator.stream(prompt, options, stats=live, trace=recorder):
            if not args.show_trace:  # the trace shows the text instead
                print(chunk.text, end="", flush=True)
        if not args.show_trace:
            print()
        print(_summary(live), file=sys.stderr)
        stats = live.as_dict()
    if recorder is not None:
        _output_trace(args, recorder.finish(speculator.tokenizer, stats, prompt, _trace_settings(args)))
    return 0


def _run_batch(args: argparse.Namespace) -> int:
    """``verispec generate --batch FILE``: every request in a continuous batch of --max-batch sequences."""
    from verispec.options import GenerationOptions

    if args.prompt is not None:
        raise UsageError("give PROMPT or --batch FILE, not both")
    if args.trace is not None or args.show_trace or _tree_shape(args) is not None:
        raise UsageError("--batch decodes chains: no traces, no token trees")
    if not is_int(args.max_batch) or args.max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1, got {args.max_batch}")
    options = GenerationOptions(**_option_fields(args))
    from verispec.batch import generate_requests, read_requests, record
    from verispec.options import ModelChoice

    requests = read_requests(args.batch)  # refused before a model loads when no line is a request
    choice = ModelChoice(**_model_fields(args), **_suffix_fields(args))
    speculator = choice.speculator()
    start = time.perf_counter()
    try:
        results = generate_requests(speculator, requests, options, slots=args.max_batch)
    finally:  # Ctrl-C too
        choice.save_suffix_cache(speculator.suffix_cache)
    seconds = time.perf_counter() - start
    tokens = 0
    for (ident, _, _), result in zip(requests, results, strict=True):
        tokens += len(result.token_ids)
        if args.json:
            print(json.dumps(record(ident, result)))
        elif result.error:
            print(f"--- {ident}: error: {result.error}")
        else:
            print(f"--- {ident} ---\n{result.text.strip()}\n")
    failed = sum(1 for r in results if r.error)
    print(
        f"[batch of {len(requests)}, {args.max_batch} at a time] {tokens} tokens in {seconds:.2f} s: "
        f"{tokens / seconds:.1f} tokens/s" + (f"; {failed} refused" if failed else ""),
        file=sys.stderr,
    )
    return 0


def _trace_settings(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The header items of a trace that the stats do not hold: models and sampling settings."""
    from verispec.options import DEFAULT_MODEL

    items = [("target", args.target or DEFAULT_MODEL)]
    if args.draft is not None:
        items.append(("draft", args.draft))
    items.append(("temperature", f"{args.temperature:g}"))
    transforms = (("top-k", args.top_k, 0), ("top-p", args.top_p, 1.0), ("min-p", args.min_p, 0.0))
    items += [(name, f"{value:g}") for name, value, default in transforms if value != default]
    items.append(("seed", "random" if args.seed is None else str(args.seed)))
    if args.invariant:
        items.append(("draws", "invariant"))
    return tuple(items)


def _output_trace(args: argparse.Namespace, trace: Trace) -> None:
    """Print the trace (--show-trace) and write its HTML file (--trace)."""
    from verispec.viz.trace import trace_terminal, write_trace_html

    if args.show_trace:
        print(trace_terminal(trace, colour=sys.stdout.isatty()), end="")
    if args.trace is not None:
        print(f"trace written to {write_trace_html(trace, args.trace)}", file=sys.stderr)


def _read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: give PROMPT or pipe it on standard input")
    return sys.stdin.read()


def _summary(stats: GenerationStats) -> str:
    return (
        f"[{stats.drafter}, k={stats.k}] {stats.new_tokens} tokens in {stats.total_seconds:.2f} s: "
        f"{stats.tokens_per_second:.1f} tokens/s, {stats.tokens_per_target_call:.2f} tokens per target call, "
        f"acceptance {stats.acceptance_rate:.2f}"
    )


# ---------------------------------------------------------------------------------------------- demo

DEMO_PROMPT = (
    "Correct the spelling mistakes in this text and write it out again in full:\n\n"
    "Speculative decoding lets a smal draft model propose several tokens, and the large target model "
    "checks them all in one pass. When the draft is rigt, many tokens are acepted at once; when it is "
    "wrong, the target still produces the correct next token, so the output is exactly the same."
)


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="compare plain and speculative decoding on an input-grounded prompt",
        description="Generate greedily for a prompt that copies its input with --drafter none, then with the "
        "chosen drafter (by default: ngram, and the learned drafter shipped for the target when there is "
        "one), check that the outputs are identical, and print the speedups.",
    )
    _add_model_arguments(parser)
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="the prompt (default: a spelling correction)")
    parser.set_defaults(func=run_demo, max_new_tokens=96)


def run_demo(args: argparse.Namespace) -> int:
    """Run ``verispec demo``: exit status 1 if any speculative output differs from plain decoding's."""
    from verispec.drafting.tree import AUTO
    from verispec.options import GenerationOptions

    k = AUTO if args.k is None else args.k
    options = GenerationOptions(k=k, max_new_tokens=args.max_new_tokens, chat=True)  # greedy
    from verispec.api import Speculator  # loads transformers: once every argument is checked
    from verispec.drafting.learned.kinds import shipped_drafter
    from verispec.options import DEFAULT_MODEL

    plain = Speculator(args.target, drafter="none", tokenizer=args.tokenizer, precision=args.precision)
    loaded = (plain.model, plain.tokenizer)  # shared: the target is loaded once
    label = args.target or DEFAULT_MODEL  # names the loaded target: auto finds the drafter shipped for it
    tree = AUTO if args.k is None else None  # the learned drafter's tree, unless a K is asked for
    chosen = Speculator(
        loaded,
        args.draft,
        args.drafter,
        drafter_path=args.drafter_path,
        target_label=label,
        tree=tree,
        precision=args.precision,
        **_across(args),
    )
    speculators = {"none": plain}
    if args.drafter == AUTO_DRAFTER and args.draft is None:  # auto's choice and the other one beside it
        speculators["ngram"] = Speculator(loaded, drafter="ngram")
        if args.drafter_path is not None or shipped_drafter(label) is not None:
            speculators["eagle"] = Speculator(
                loaded, drafter="eagle", drafter_path=args.drafter_path, target_label=label, tree=tree
            )
        print(f"drafter auto chooses {chosen.drafter_name} for this target on this machine\n")
    speculators[chosen.drafter_name] = chosen
    plain.generate(args.prompt, options, max_new_tokens=4)  # warm-up: first-call overheads
    results = {}
    for name, speculator in speculators.items():
        results[name] = speculator.generate(args.prompt, options)
        print(f"--- {name} ---\n{results[name].text.strip()}\n")
    base = results["none"]
    for name, result in results.items():
        s = result.stats
        speedup = s["tokens_per_second"] / base.stats["tokens_per_second"]
        same = (
            ""
            if name == "none"
            else f"; identical to none: {'yes' if result.token_ids == base.token_ids else 'NO'}"
        )
        print(
            f"{name:>6}: {s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tokens/s ({speedup:.2f}x), "
            f"{s['tokens_per_target_call']:.2f} tokens per target call{same}"
        )
        if name != "none" and speedup < 1:
            print(_why_slower(s, base.stats))
    return 0 if all(r.token_ids == base.token_ids for r in results.values()) else 1


def _why_slower(stats: Mapping[str, Any], plain: Mapping[str, Any]) -> str:
    """Why a drafter ran slower than plain decoding, from what the run measured: a round's cost in plain
    decoding steps (verifying, drafting) against the tokens it committed."""
    step = (plain["total_seconds"] - plain["prefill_seconds"]) / max(1, plain["target_calls"])
    rounds = max(1, stats["target_calls"])
    verify, draft = stats["target_seconds"] / rounds / step, stats["draft_seconds"] / rounds / step
    return (
        f"        slower here: a round cost {verify:.2f} plain steps to verify and {draft:.2f} to draft, and "
        f"committed {stats['tokens_per_target_call']:.2f} tokens; speculation pays when a round commits more "
        "tokens than it costs steps (README: Adaptive K)"
    )


# ---------------------------------------------------------------------------------------------- batch


def add_batch_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec batch``."""
    parser = subparsers.add_parser(
        "batch",
        help="generate for a JSONL file of prompts, resumably, on this machine or on Ray",
        description='Generate for every request of --input (one JSON object a line: {"id", "prompt"} or '
        '{"id", "messages"}) and write one JSON line per request to --output, in input order: its id, '
        "text, token ids and speculation stats (or an error). Work goes in shards, each written atomically "
        "to OUTPUT.parts/ as it finishes: an interrupted run, started again with the same flags, continues "
        "where it stopped. Each request samples with a seed derived from --seed and its id, so the output "
        "is the same whatever --max-batch, --shard-size or --workers, sampled at --k auto too (invariant "
        "draws, the default: --no-invariant opts out). --ray runs the shards on Ray Data.",
    )
    parser.add_argument("--input", required=True, metavar="FILE.jsonl", help="the requests")
    parser.add_argument("--output", required=True, metavar="FILE.jsonl", help="the results")
    _add_model_arguments(parser)
    _add_suffix_arguments(parser)
    _add_sampling_arguments(parser, temperature=0.0)
    parser.add_argument("--seed", type=int, help="the job's seed (default: random, kept for a resumed run)")
    _add_invariant_argument(parser)
    parser.add_argument("--chat", action="store_true", help="wrap plain prompts in the model's chat template")
    parser.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    _add_constraint_arguments(parser)
    parser.add_argument("--max-batch", type=int, default=8, metavar="N", help="sequences decoded at once (8)")
    parser.add_argument(
        "--shard-size", type=int, default=64, metavar="N", help="requests per shard, what resumes (64)"
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="run the shards on Ray Data: the cluster at ADDRESS, or a local Ray started here",
    )
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="Ray workers, one model each (1)")
    parser.set_defaults(func=run_batch)


def run_batch(args: argparse.Namespace) -> int:
    """Run ``verispec batch``."""
    from verispec.batch import BatchJob, run_job

    job = BatchJob(
        input=args.input,
        output=args.output,
        **_model_fields(args),
        **_suffix_fields(args),
        **_option_fields(args),
        max_batch=args.max_batch,
        shard_size=args.shard_size,
        ray=args.ray,
        workers=args.workers,
    )
    summary = run_job(job)
    refused = f"; {summary['refused']} refused (error records)" if summary["refused"] else ""
    before = summary["resumed"]
    resumed = f", {before} of {summary['shards']} shards from before" if before else ""
    print(
        f"verispec batch: {summary['requests']} requests written to {job.output}{resumed}{refused}; "
        f"{summary['tokens']} tokens in {summary['seconds']:.1f} s "
        f"({summary['tokens'] / max(summary['seconds'], 1e-9):.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------------------------------------- viz


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
    overlap.add_argument("--p", type=_list_of(float, "numbers"), help="toy target distribution: 0.5,0.3,0.2")
    overlap.add_argument(
        "--q", type=_list_of(float, "numbers"), help="toy draft distribution, as long as --p"
    )
    overlap.add_argument("--labels", type=_list_of(str, "names"), help="toy token names, comma-separated")
    overlap.add_argument("--prompt", help="model mode: the distributions of the token after this prompt")
    _add_model_specs(overlap)
    overlap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling_arguments(overlap, temperature=1.0)
    overlap.add_argument(
        "--top", type=int, default=12, help="tokens shown, the rest as one bar (default: 12)"
    )
    overlap.add_argument(
        "--out",
        default="overlap.png",
        metavar="FILE",
        help="FILE.png, FILE.svg or FILE: writes FILE.png and FILE.svg (default: overlap.png)",
    )
    _add_threads_argument(overlap)
    overlap.set_defaults(func=run_viz_overlap)


def run_viz_overlap(args: argparse.Namespace) -> int:
    """Run ``verispec viz overlap``: draw the picture, print alpha and the files written."""
    from verispec.analysis.analytic import acceptance_rate
    from verispec.viz.figures import figure_paths, save_figure
    from verispec.viz.overlap import overlap_figure

    toy = args.p is not None or args.q is not None or args.labels is not None
    if toy == (args.prompt is not None):
        raise UsageError("give either --p and --q (toy distributions) or --prompt (a model's next token)")
    figure_paths(args.out)  # validate the output before any work
    if toy:
        if args.p is None or args.q is None:
            raise UsageError("toy mode needs both --p and --q")
        if args.labels is not None and len(args.labels) != len(args.p):
            raise UsageError(f"--labels names {len(args.labels)} tokens, --p has {len(args.p)}")
        names = args.labels or tuple(str(i) for i in range(len(args.p)))
        p, q, label, title = args.p, args.q, names.__getitem__, "toy distributions"
    else:
        p, q, label, title = _model_overlap(args)
    paths = save_figure(overlap_figure(p=p, q=q, top=args.top, label=label, title=title), args.out)
    print(f"alpha = sum min(p, q) = {acceptance_rate(p=p, q=q):.6f}")  # p and q were validated by the figure
    print(f"written: {', '.join(str(path) for path in paths)}")
    return 0


def _model_overlap(args: argparse.Namespace):
    """(p, q, label, title) of the next token after --prompt, for :func:`run_viz_overlap`."""
    from verispec.api import Speculator
    from verispec.options import DEFAULT_MODEL, SamplingParams
    from verispec.viz import visible_text
    from verispec.viz.overlap import next_token_distributions

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    speculator = Speculator(
        args.target, args.draft, "model", args.tokenizer, precision=args.precision, **_across(args)
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


# ---------------------------------------------------------------------------------------------- bench


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec bench``."""
    from verispec.bench.methods import METHODS, TASKS, TREE_METHODS

    parser = subparsers.add_parser(
        "bench",
        help="run the task suite with every method, verispec and transformers side by side",
        description="Run a task suite with verispec's drafters and transformers' own generation (plain, "
        "assisted, prompt lookup) on the same weights; write results.json, results.md and PNG charts into "
        "--out, and print the tables. Greedy outputs are checked against verispec none, token for token.",
    )
    _add_model_specs(parser)
    parser.add_argument(
        "--tasks",
        type=_list_of(str, "task names"),
        help=f"comma-separated, of {', '.join(TASKS)} (default: all)",
    )
    parser.add_argument(
        "--prompts",
        metavar="FILE",
        help='a JSONL file of more prompts: {"prompt": ...} or {"messages": [...]} per line, optional "id" '
        'and "task" (default task: the file name)',
    )
    parser.add_argument(
        "--methods",
        type=_list_of(str, "method names"),
        help=f"comma-separated (default: all that apply): {', '.join(METHODS)}",
    )
    parser.add_argument(
        "--drafter-path",
        metavar="FILE",
        help=f"a learned drafter for the method of its kind ({drafter_names(lambda kind: kind.learned)}); "
        "the others use the ones shipped for the target, if any",
    )
    parser.add_argument(
        "--k",
        type=_list_of(str, "values"),
        default="4,auto",
        help="draft lengths, comma-separated: N or auto (default: %(default)s); transformers use the numbers",
    )
    parser.add_argument(
        "--trees",
        type=_list_of(str, "tree shapes"),
        default=(),
        help=f"token-tree shapes for the tree methods ({', '.join(TREE_METHODS)}), comma-separated: WxD "
        "(width x depth) or a JSON shape file; each tree of N nodes runs beside its chain method at "
        "K = N - 1 (default: none)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per prompt (default: %(default)s)")
    parser.add_argument(
        "--temperature",
        type=_list_of(float, "numbers"),
        default="0",
        help="comma-separated; 0 is greedy, T > 0 samples (default: %(default)s)",
    )
    parser.add_argument("--repetitions", type=int, default=3, help="timed runs per cell (default: 3)")
    parser.add_argument("--prompts-per-task", type=int, metavar="N", help="the first N prompts of each task")
    _add_threads_argument(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled runs (default: 0)")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: results/bench-TIMESTAMP)")
    parser.add_argument(
        "--recalibrate", action="store_true", help="measure the costs again first (default: the cached ones)"
    )
    parser.add_argument(
        "--goals",
        metavar="FILE",
        help="a TOML file of speed goals to judge in the report (this project's: docs/bench/goals.toml)",
    )
    parser.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """Run ``verispec bench``: print the Markdown tables; the files go to --out."""
    from verispec.bench.report import markdown
    from verispec.bench.suite import Bench, BenchConfig, plan_methods, select_tasks
    from verispec.viz.charts import chart_directory

    config = BenchConfig(
        target=args.target or BenchConfig.target,
        tokenizer=args.tokenizer,
        draft=args.draft,
        draft_tokenizer=args.draft_tokenizer,
        drafter_path=args.drafter_path,
        tasks=args.tasks,
        prompts_file=args.prompts,
        methods=args.methods,
        ks=args.k,
        trees=args.trees,
        max_new_tokens=args.max_new_tokens,
        temperatures=args.temperature,
        repetitions=args.repetitions,
        prompts_per_task=args.prompts_per_task,
        threads=args.threads,
        seed=args.seed,
        out=args.out or "",
        recalibrate=args.recalibrate,
        goals=args.goals,
        precision=args.precision,
    )
    tasks = select_tasks(config)  # every check that needs no model, before loading one
    methods, notes = plan_methods(config)
    chart_directory(config.out)
    results = Bench(config, tasks, methods, notes).run()
    print(markdown(results))
    print(f"results written to {config.out}", file=sys.stderr)
    return 0


def add_bench_load_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec bench-load``."""
    from verispec.bench.methods import LOAD_METHODS

    parser = subparsers.add_parser(
        "bench-load",
        help="many requests at once: aggregate tokens/s, time to first token, inter-token latency",
        description="At each concurrency C, C clients keep C requests in flight through a continuous batch "
        "of C slots; report aggregate tokens/s, time to first token and inter-token latency (p50, p99) per "
        "method, beside transformers' batched generate; write results.json, results.md and a chart to --out.",
    )
    _add_model_specs(parser)
    parser.add_argument(
        "--methods",
        type=_list_of(str, "method names"),
        default="none,ngram,auto,transformers",
        help=f"comma-separated, of {', '.join(LOAD_METHODS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--k", type=_list_of(str, "values"), default="auto", help="draft lengths: N or auto (default: auto)"
    )
    parser.add_argument(
        "--concurrency",
        type=_list_of(int, "integers"),
        default="1,4,8,16",
        help="concurrent requests, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        help="requests at every concurrency, the same ones (default: 4 x the highest C, at least 8)",
    )
    parser.add_argument(
        "--repetitions",
        type=int,
        default=1,
        help="runs of every verispec cell, the methods taking turns at each C; tok/s: the median run "
        "(default: %(default)s)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per request (default: %(default)s)")
    _add_threads_argument(parser)
    parser.add_argument("--out", metavar="DIR", help="output directory (default: results/bench-load-STAMP)")
    parser.set_defaults(func=run_bench_load)


def run_bench_load(args: argparse.Namespace) -> int:
    """Run ``verispec bench-load``: print the table; the files go to --out."""
    import datetime

    from verispec.bench.load import LoadConfig, run_load, write_load_report

    _no_draft_model(args, "bench-load")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    config = LoadConfig(
        target=args.target or LoadConfig.target,
        tokenizer=args.tokenizer,
        precision=args.precision,
        methods=tuple(args.methods),
        ks=tuple(args.k),
        concurrency=tuple(args.concurrency),
        requests=args.requests,
        repetitions=args.repetitions,
        max_new_tokens=args.max_new_tokens,
        threads=args.threads,
        out=args.out or f"results/bench-load-{stamp}",
    )
    out = write_load_report(run_load(config), config.out)
    return _show_results(out)


def _show_results(out: Path) -> int:
    """Print a run's results.md, and on stderr where its files are."""
    print((out / "results.md").read_text())
    print(f"results written to {out}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------- serve


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec serve``."""
    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over the batched engine",
        description="Serve the OpenAI API (POST /v1/completions and /v1/chat/completions, streamed or not; "
        "GET /v1/models, /health, /metrics) with speculative decoding of up to --max-batch requests at once. "
        "Every response carries usage and a verispec object: drafter, K, target calls, acceptance by "
        "position. Requests may name their own drafter, k, top_k and min_p in the body.",
    )
    _add_drafter_arguments(parser)
    _add_suffix_arguments(parser)
    parser.add_argument(
        "--share-suffix-cache",
        action="store_true",
        help="one suffix cache for every --api-key tenant (default: one each, saved as FILE.<tenant>.npz)",
    )
    parser.add_argument(
        "--k", default="auto", help="K of requests naming none: N, additive or auto (default)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, only here)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: a free one)")
    parser.add_argument("--max-batch", type=int, default=8, metavar="N", help="requests decoded at once (8)")
    parser.add_argument(
        "--max-queue", type=int, default=64, metavar="N", help="requests waiting; more: 429 (64)"
    )
    parser.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require Authorization: Bearer KEY on /v1 routes (repeatable: each key a tenant)",
    )
    parser.add_argument(
        "--model-name", metavar="NAME", help="the model id clients name (default: the target's)"
    )
    limits = parser.add_argument_group("limits (README: Serving; unset: ServerConfig's defaults)")
    for flag, kind, meta, text in (
        ("--max-connections", int, "N", "open connections; at the cap a new one closes an idle one (512)"),
        ("--keep-alive", float, "S", "seconds an idle keep-alive connection stays open (5)"),
        ("--header-timeout", float, "S", "seconds for a request's headers to arrive (10)"),
        ("--body-timeout", float, "S", "seconds for a request's body to arrive; slower: 408 (30)"),
        ("--max-body", int, "BYTES", "a request body's size; larger: 413 (4194304)"),
    ):
        limits.add_argument(flag, type=kind, metavar=meta, help=text)
    parser.set_defaults(func=run_serve)


SERVER_LIMITS = ("max_connections", "keep_alive", "header_timeout", "body_timeout", "max_body")


def run_serve(args: argparse.Namespace) -> int:
    """Run ``verispec serve`` until interrupted."""
    from verispec.server.app import Server, ServerConfig, exposed, listen, run

    config = ServerConfig(
        **_model_fields(args),
        **_suffix_fields(args),
        share_suffix_cache=args.share_suffix_cache,
        k=args.k,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        api_key=tuple(args.api_key) if args.api_key else None,
        model_name=args.model_name,
        **{name: value for name in SERVER_LIMITS if (value := getattr(args, name)) is not None},
    )
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    sock = listen(args.host, args.port)  # before the model loads: a taken port fails at once
    host, port = sock.getsockname()[:2]
    if exposed(host) and config.api_key is None:
        _warn(
            f"{host} is reachable from other machines and no --api-key is set: anyone who can reach it can "
            "generate (bind 127.0.0.1, or give --api-key)"
        )
    server = Server(config)
    print(
        f"verispec: serving {server.name} (drafter {server.default.drafter_name}) on http://{host}:{port}/v1",
        file=sys.stderr,
        flush=True,
    )
    run(server, sock)
    print("verispec: stopped", file=sys.stderr)
    return 0


def add_bench_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec bench-serve``."""
    parser = subparsers.add_parser(
        "bench-serve",
        help="load the server on loopback: failures, tokens/s, latency, memory, what HTTP costs",
        description="Start `verispec serve` on a free loopback port; --clients streaming clients keep a "
        "request each in flight for --seconds (every --disconnect-every-th request hangs up after its first "
        "token); report completed requests, failures, whether every disconnect was freed, tokens/s, time to "
        "first token and inter-token latency p50/p99 and the server's memory at start and end; then the "
        "engine alone on the same work. Writes results.json and results.md to --out.",
    )
    _add_model_specs(parser)
    parser.add_argument(
        "--drafter",
        default="auto",
        help="the server's drafter (default: auto); suffix-warm: suffix, every prompt once through it first",
    )
    parser.add_argument("--k", default="auto", help="the server's K (default: auto)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default: 8)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long they keep at it (default: 30)")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request (default: 64)")
    parser.add_argument(
        "--disconnect-every", type=int, default=10, metavar="N", help="every N-th request hangs up (0: none)"
    )
    parser.add_argument("--no-engine", action="store_true", help="skip the engine-alone comparison")
    _add_threads_argument(parser)
    parser.add_argument("--out", metavar="DIR", help="output directory (default: results/bench-serve-STAMP)")
    parser.set_defaults(func=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run ``verispec bench-serve``: print the table; the files go to --out."""
    import datetime

    from verispec.bench.serve import ServeLoadConfig, run_serve_load, write_serve_report

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    config = ServeLoadConfig(
        target=args.target or ServeLoadConfig.target,
        tokenizer=args.tokenizer,
        precision=args.precision,
        drafter=args.drafter,
        k=args.k,
        clients=args.clients,
        seconds=args.seconds,
        max_tokens=args.max_tokens,
        disconnect_every=args.disconnect_every,
        engine=not args.no_engine,
        out=args.out or f"results/bench-serve-{stamp}",
    )
    _no_draft_model(args, "bench-serve")
    out = write_serve_report(run_serve_load(config), config.out)
    return _show_results(out)


def add_bench_suffix_cache_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec bench-suffix-cache``."""
    parser = subparsers.add_parser(
        "bench-suffix-cache",
        help="the suffix cache at its budget: memory after many requests, a lookup against a target step",
        description="Fill a suffix cache of --budget tokens with --requests synthetic outputs (Zipf-drawn "
        "phrases of the target's token ids), recording its size and the process's memory growth; then time "
        "the suffix drafter's chain (--k tokens) and tree (--tree) proposals in the full cache against the "
        "target's plain decoding step, in turns. Writes results.json and results.md to --out.",
    )
    parser.add_argument("--target", metavar="SPEC", help="target model (default: smollm2-135m)")
    parser.add_argument("--tokenizer", metavar="FILE", help="tokenizer file, for llama2.c checkpoints")
    parser.add_argument("--requests", type=int, default=10_000, help="outputs added (default: 10000)")
    parser.add_argument(
        "--budget", type=int, default=1_000_000, help="the cache's budget in tokens (default: 1000000)"
    )
    parser.add_argument("--lookups", type=int, default=400, help="proposals timed (default: 400)")
    parser.add_argument("--k", type=int, default=8, help="a chain proposal's tokens (default: 8)")
    parser.add_argument("--tree", default="2x4", help="a tree proposal's shape (default: 2x4)")
    _add_threads_argument(parser)
    parser.add_argument(
        "--out", metavar="DIR", help="output directory (default: results/bench-suffix-cache-STAMP)"
    )
    parser.set_defaults(func=run_bench_suffix_cache)


def run_bench_suffix_cache(args: argparse.Namespace) -> int:
    """Run ``verispec bench-suffix-cache``: print the tables; the files go to --out."""
    import datetime

    from verispec.bench.suffix_cache import (
        SuffixCacheBenchConfig,
        run_suffix_cache_bench,
        write_suffix_cache_report,
    )
    from verispec.options import DEFAULT_MODEL

    out = args.out or f"results/bench-suffix-cache-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    config = SuffixCacheBenchConfig(
        target=args.target or DEFAULT_MODEL,
        tokenizer=args.tokenizer,
        requests=args.requests,
        budget=args.budget,
        lookups=args.lookups,
        k=args.k,
        tree=args.tree,
    )
    return _show_results(write_suffix_cache_report(run_suffix_cache_bench(config), out).parent)


# ---------------------------------------------------------------------------------------------- calibrate


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec calibrate``."""
    parser = subparsers.add_parser(
        "calibrate",
        help="measure the target's verification curve and the draft's cost on this machine",
        description="Measure v(k) = T(k new tokens) / T(1) for k = 1..16 and the cost ratio c = T_draft / "
        "T_target(1) of the drafter (--drafter, as generate chooses it), and cache them for --k auto.",
    )
    _add_model_specs(parser)
    parser.add_argument(
        "--drafter",
        default=AUTO_DRAFTER,
        help="the drafter to calibrate with the target (default: auto, as generate chooses)",
    )
    parser.add_argument("--drafter-path", metavar="FILE", help="a learned drafter (verispec train-drafter)")
    parser.add_argument("--repetitions", type=int, default=10, help="timings per k (default: 10)")
    _add_threads_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    """Run ``verispec calibrate``: measure, cache, and print v(k), c and the best K for a few α."""
    import torch

    from verispec.analysis.analytic import optimal_k
    from verispec.options import ModelChoice

    if args.repetitions < 1:
        raise UsageError(f"--repetitions must be an integer >= 1, got {args.repetitions}")
    speculator = ModelChoice(**_model_fields(args)).speculator()
    calibration = speculator.calibration(force=True, repetitions=args.repetitions)
    if args.json:
        print(json.dumps(calibration.to_dict(), indent=2))
        return 0
    cost = calibration.cost_model
    print(
        f"{speculator.drafter_name} drafter: c = {calibration.cost_ratio:.4f}, catch-up u = "
        f"{cost.catch_up:.4f} a position; T_target(1) = {1e3 * calibration.target.seconds[0]:.2f} ms; "
        f"{torch.get_num_threads()} threads"
    )
    curve = cost.verify_cost
    assert isinstance(curve, tuple)  # a calibration measures v(k) as a sequence
    rows = [{"k": k, "v": v} for k, v in enumerate(curve, 1)]
    print(format_table(rows, (("k new tokens", "k", "d"), ("v(k)", "v", ".3f"))))
    best = (f"α={a:g}: K={optimal_k(a, cost.cost_ratio, cost.verify_cost)}" for a in (0.3, 0.5, 0.7, 0.9))
    print(f"best K: {', '.join(best)}")
    if calibration.cached:
        print(f"cached in {calibration.path}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------- drafter-data


def add_drafter_data_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec drafter-data``."""
    parser = subparsers.add_parser(
        "drafter-data",
        help="build the training data of a learned drafter: the target's own answers to a prompt set",
        description="Have the target answer a generated set of chat prompts (half greedily, half sampled at "
        "temperature 1) and store every token with the target's final hidden state, split into train and "
        "held-out sets (see verispec.drafting.learned.data). Needs no model hub and no corpus.",
    )
    parser.add_argument(
        "--target", default="smollm2-135m", metavar="SPEC", help="the target (default: %(default)s)"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the data set directory")
    parser.add_argument("--prompts", type=int, default=1024, help="prompts to answer (default: %(default)s)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=192, help="longest answer in tokens (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per batch (default: %(default)s)")
    parser.add_argument(
        "--heldout", type=float, default=0.05, help="fraction of prompts held out (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt set and sampling seed (default: 0)")
    parser.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        metavar="N",
        help="start at prompt N of the prompt set, to add new prompts to an earlier data set (default: 0)",
    )
    parser.add_argument(
        "--questions",
        choices=("templates", "target"),
        default="templates",
        help="who writes the user turns: verispec's prompt templates, or the target itself, sampled from its "
        "chat template (default: %(default)s)",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=1,
        metavar="N",
        help="user turns per target-written conversation; each answered turn is one sequence (default: 1)",
    )
    parser.add_argument(
        "--follow-ups",
        type=int,
        metavar="N",
        help="instead: copy the data set --from DIR and add second turns to its first N chats of each split",
    )
    parser.add_argument("--from", dest="source", metavar="DIR", help="the data set --follow-ups extends")
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="answer the prompts on Ray workers (the cluster at ADDRESS, or a local Ray), in ranges merged",
    )
    parser.add_argument("--workers", type=int, default=2, metavar="N", help="Ray workers with --ray (2)")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        help="instead: write the union of these data sets (same target) into --out",
    )
    _add_threads_argument(parser)
    parser.set_defaults(func=run_drafter_data)


def run_drafter_data(args: argparse.Namespace) -> int:
    """Run ``verispec drafter-data``: build the data set and print what it holds."""
    from verispec.drafting.learned.data import DataConfig, add_follow_ups, build_dataset, merge_datasets

    config = DataConfig(
        args.prompts,
        args.max_new_tokens,
        args.batch_size,
        args.heldout,
        args.seed,
        first_prompt=args.first_prompt,
        questions=args.questions,
        turns=args.turns,
    )
    if (args.follow_ups is None) != (args.source is None):
        raise UsageError("--follow-ups N and --from DIR go together")
    if args.merge is not None and args.source is not None:
        raise UsageError("--merge and --follow-ups are separate steps")
    if args.ray is not None and (args.merge is not None or args.source is not None):
        raise UsageError("--ray answers new prompts: not with --merge or --follow-ups")
    if args.merge is not None:
        meta = merge_datasets(args.merge, args.out)
    elif args.ray is not None:
        from verispec.batch import drafter_data_on_ray

        meta = drafter_data_on_ray(args.target, args.out, config, args.ray, args.workers)
    elif args.source is not None:
        meta = add_follow_ups(args.source, args.out, args.follow_ups, config)
    else:
        meta = build_dataset(args.target, args.out, config)
    print(
        f"{meta['num_sequences']} sequences ({meta['splits']['train']} train, {meta['splits']['heldout']} "
        f"held out), {meta['num_tokens']} tokens of which {meta['answer_tokens']} answer tokens, in "
        f"{meta['seconds']:.0f} s; written to {args.out}"
    )
    return 0


# ---------------------------------------------------------------------------------------------- train-drafter


def add_train_drafter_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec train-drafter``."""
    from verispec.drafting.learned.config import KINDS, TrainConfig

    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}  # no validation
    parser = subparsers.add_parser(
        "train-drafter",
        help="train a learned drafter (EAGLE head, Medusa heads, trained exit, lookahead tokens) on a "
        "drafter-data set",
        description="Train a learned drafter for a target, with logits over a reduced draft vocabulary (see "
        "verispec.drafting.learned.train): --kind eagle, a draft head (one decoder layer unless --layers) "
        "that predicts the target's next hidden state from its current one and the next token; medusa, "
        "--heads heads on the target's last hidden state, head i guessing the token i + 1 ahead; exit, an "
        "adapter after the target's first --exit-layer layers; lookahead, --lookahead input embeddings that "
        "one forward of the frozen target reads after the context to guess the tokens after its next "
        "(PaSS). Writes DIR/drafter.safetensors, "
        "DIR/checkpoint.pt and DIR/log.jsonl; --resume continues an interrupted run.",
    )
    parser.add_argument("--target", metavar="SPEC", help="the target (default: smollm2-135m)")
    parser.add_argument("--tokenizer", metavar="FILE", help="tokenizer file, for llama2.c checkpoints")
    parser.add_argument("--data", required=True, metavar="DIR", help="the data set (verispec drafter-data)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the training run's directory")
    parser.add_argument(
        "--kind", default=defaults["kind"], choices=KINDS, help="drafter kind (default: %(default)s)"
    )
    for flag, help_text in (
        ("steps", "optimizer steps"),
        ("batch-tokens", "slots per batch"),
        ("window", "slots per window (batch_tokens // window windows per batch)"),
        ("draft-vocab", "size of the draft vocabulary: the most frequent answer tokens"),
        ("unroll", "extra steps unrolled on the head's own features"),
        ("layers", "eagle: decoder layers of the head (beyond --init's: new layers that start as no-ops)"),
        ("heads", "medusa: heads, head i guessing the token i + 1 positions ahead"),
        ("exit-layer", "exit: the target layer whose output the trained exit reads"),
        ("lookahead", "lookahead: trained tokens after the context, each guessing one token further"),
        ("checkpoint-every", "steps between checkpoints"),
        ("eval-every", "steps between held-out evaluations"),
        ("seed", "seed of initialisation, batches and noise"),
        ("lr", "peak learning rate"),
        ("ce-weight", "weight of the cross-entropy against the feature loss"),
        ("noise", "half-width of the uniform feature noise, relative to the features' RMS"),
        ("ce-target", "token (the target's next token) or distribution (its own on the draft vocabulary)"),
    ):
        default = defaults[flag.replace("-", "_")]  # an int, float or str: the flag's type
        parser.add_argument(
            f"--{flag}", type=type(default), default=default, help=f"{help_text} (default: {default})"
        )
    parser.add_argument(
        "--init",
        default="",
        metavar="FILE",
        help="start from this drafter (fine-tuning it on --data), keeping its draft vocabulary",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    _add_threads_argument(parser)
    parser.set_defaults(func=run_train_drafter)


def run_train_drafter(args: argparse.Namespace) -> int:
    """Run ``verispec train-drafter``: validate, load the target, train, print where the drafter is."""
    from verispec.drafting.learned.data import read_data_meta
    from verispec.drafting.learned.train import TrainConfig, train_drafter
    from verispec.models.registry import load_model
    from verispec.options import DEFAULT_MODEL

    config = TrainConfig(
        kind=args.kind,
        steps=args.steps,
        batch_tokens=args.batch_tokens,
        window=args.window,
        lr=args.lr,
        draft_vocab=args.draft_vocab,
        ce_weight=args.ce_weight,
        noise=args.noise,
        ce_target=args.ce_target,
        unroll=args.unroll,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        init=args.init,
        layers=args.layers,
        heads=args.heads,
        exit_layer=args.exit_layer,
        lookahead=args.lookahead,
    )
    read_data_meta(args.data)  # before loading a model
    if args.init and not os.path.isfile(args.init):
        raise UsageError(f"no such drafter file: {args.init}")
    label = args.target or DEFAULT_MODEL
    model, _ = load_model(label, tokenizer=args.tokenizer)
    path = train_drafter(model, args.data, args.out, config, target_label=label, resume=args.resume)
    print(f"drafter written to {path}")
    return 0


# ---------------------------------------------------------------------------------------------- entry point


def add_write_gguf_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec write-gguf``."""
    parser = subparsers.add_parser(
        "write-gguf",
        help="write a random-weight Llama GGUF file of a given shape and tensor type (for speed runs)",
        description="Write a GGUF file of a Llama-3-shaped model with random weights in one tensor type, "
        "quickly (random blocks with sane scales, tensor by tensor), with a minimal tokenizer: speed does "
        "not depend on the weights' values, so such a file measures the regime of large models without "
        "downloading one. Its outputs are meaningless: never report their acceptance.",
    )
    parser.add_argument("--out", required=True, metavar="FILE.gguf", help="the file to write (atomically)")
    parser.add_argument(
        "--shape",
        required=True,
        help="llama3-1b, llama3-3b, or hidden=H,layers=L,heads=N,kv_heads=K,ffn=F,vocab=V "
        "[,tied=0|1][,rope_base=B][,rope_factor=X|none][,context=C]",
    )
    parser.add_argument("--type", required=True, help="Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K or F16")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.set_defaults(func=run_write_gguf)


def run_write_gguf(args: argparse.Namespace) -> int:
    """Run ``verispec write-gguf``: check every argument, write the file, print where it is."""
    from verispec.models.gguf_write import parse_shape, write_random_gguf

    path = write_random_gguf(args.out, parse_shape(args.shape), args.type, args.seed)
    print(f"random-weight GGUF written to {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


def add_bench_gguf_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec bench-gguf``."""
    parser = subparsers.add_parser(
        "bench-gguf",
        help="GGUF files in place on the native kernels: tok/s against llama.cpp and the read limit, v(k)",
        description="Per GGUF file: memory added by loading, load time, decoding's time per token against "
        "the bandwidth limit of the weights' bytes, the verification cost v(k) for k = 1..max-k, prefill, "
        "llama.cpp on the same file (default settings; where `make peers` installed it), and the speedup "
        "the measured v(k) gives a drafter of known acceptance. --random SHAPE:TYPE measures a random-weight "
        "file (e.g. llama3-1b:Q4_K), written once into verispec's cache: speed does not depend on the "
        "weights' values, which are meaningless (no acceptance is measured on them).",
    )
    parser.add_argument("files", nargs="*", metavar="FILE.gguf", help="GGUF files to measure")
    parser.add_argument(
        "--random",
        action="append",
        default=[],
        metavar="SHAPE:TYPE",
        help="a random-weight file: llama3-1b, llama3-3b or explicit dims (see write-gguf), and a type",
    )
    _add_threads_argument(parser)
    parser.add_argument(
        "--context", type=int, default=256, help="positions before the timed tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--prefill", type=int, default=128, help="prompt tokens timed for prefill (default: %(default)s)"
    )
    parser.add_argument("--max-k", type=int, default=8, help="v(k) for k = 1..max-k (default: %(default)s)")
    parser.add_argument("--repetitions", type=int, default=7, help="timed turns (default: %(default)s)")
    parser.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: results/bench-gguf-STAMP)")
    parser.set_defaults(func=run_bench_gguf)


def run_bench_gguf(args: argparse.Namespace) -> int:
    """Run ``verispec bench-gguf``: check every argument, measure each file, print the tables."""
    import datetime

    import torch

    from verispec.bench.gguf import FileBenchConfig, bench_file, random_file, read_bandwidth, write_report

    for name, least in (("context", 1), ("prefill", 2), ("max_k", 1), ("repetitions", 1)):
        if getattr(args, name) < least:
            raise UsageError(
                f"--{name.replace('_', '-')} must be an integer >= {least}, got {getattr(args, name)}"
            )
    files = [Path(f) for f in args.files]
    for path in files:
        if path.suffix != ".gguf" or not path.is_file():
            raise UsageError(f"no such GGUF file: {path}")
    if not files and not args.random:
        raise UsageError("give GGUF files, or --random SHAPE:TYPE")
    files += [random_file(spec) for spec in args.random]
    threads = args.threads or torch.get_num_threads()
    config = FileBenchConfig(
        tuple(files), threads, args.context, args.prefill, args.max_k, args.repetitions, not args.no_llamacpp
    )
    bandwidth = read_bandwidth(threads)
    results = [bench_file(path, config, bandwidth) for path in files]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = write_report(results, config, Path(args.out or f"results/bench-gguf-{stamp}"))
    return _show_results(out)


def build_parser() -> argparse.ArgumentParser:
    """The ``verispec`` parser with all its subcommands."""
    parser = _Parser(prog=PROG, description="Exact speculative decoding for language models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an internal error (a bug to report)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_generate_parser(subparsers)
    add_batch_parser(subparsers)
    add_demo_parser(subparsers)
    add_simulate_parser(subparsers)
    add_viz_parser(subparsers)
    add_bench_parser(subparsers)
    add_bench_load_parser(subparsers)
    add_serve_parser(subparsers)
    add_bench_serve_parser(subparsers)
    add_bench_suffix_cache_parser(subparsers)
    add_calibrate_parser(subparsers)
    add_drafter_data_parser(subparsers)
    add_train_drafter_parser(subparsers)
    add_write_gguf_parser(subparsers)
    add_bench_gguf_parser(subparsers)
    return parser


def _warn(message: str) -> None:
    """Print ``verispec: warning: <message>`` as one line on stderr (what a run cannot honour in full)."""
    print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)


def _report(message: str, status: int) -> int:
    """Print ``verispec: <message>`` as one line on stderr; return status."""
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]), run the subcommand, return the exit status (module doc)."""
    args = None
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:  # --help or --version: printed, status 0
            return exit_.code if isinstance(exit_.code, int) else 0
        if hasattr(args, "threads"):  # a command that runs a model
            use_threads(args.threads)
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return status
    except UsageError as exc:
        return _report(f"error: {exc}", _USAGE_ERROR)
    except KeyboardInterrupt:
        return _report("interrupted", _INTERRUPTED)
    except BrokenPipeError:
        try:  # nothing more can be written: send what Python flushes at exit to /dev/null
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a real file (e.g. captured); nothing to silence
            pass
        return _BROKEN_PIPE
    except Exception as exc:  # a bug, ours or a library's: never presented as the user's mistake
        if args is not None and args.debug:
            traceback.print_exc()
        hint = "" if args is not None and args.debug else "; run again with --debug for the traceback"
        message = f"internal error: {type(exc).__name__}: {exc} (please report it{hint})"
        return _report(message, _INTERNAL_ERROR)

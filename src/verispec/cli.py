"""The ``verispec`` command line (also ``python -m verispec``).

Each subcommand is a pair of functions: ``add_<name>_parser(subparsers)`` declares its arguments and binds
``run_<name>`` with ``set_defaults(func=...)``; ``run_<name>(args) -> int`` does the work and returns the exit
status. To add one, write the pair and call ``add_<name>_parser`` from :func:`build_parser`.

Error contract: bad usage (unknown flag or subcommand, unparsable value) and any ValueError raised while
running (the library's validation convention) print exactly one line ``verispec: error: <message>`` on stderr
and exit with status 2. Ctrl-C exits with 130 after one line; a closed output pipe (``verispec ... | head``)
exits quietly with 141 (128 + SIGPIPE, as a process killed by it would).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from verispec import __version__
from verispec.engine import EngineConfig, GenerationStats
from verispec.sampling import SamplingParams
from verispec.simulate import SimulationConfig, simulate

__all__ = ["add_simulate_parser", "build_parser", "format_table", "main", "run_simulate"]

PROG = "verispec"

_USAGE_ERROR = 2
_INTERRUPTED = 130  # 128 + SIGINT
_BROKEN_PIPE = 141  # 128 + SIGPIPE


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises ValueError instead of printing usage and exiting, so that :func:`main`
    reports every error the same way (subparsers are created with this class too)."""

    def error(self, message: str) -> NoReturn:
        """Raise the usage error for :func:`main` to report."""
        raise ValueError(message)


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
        "with the analytic model (see verispec.simulate).",
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
    parser.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``verispec simulate``: print the table (or the JSON object) of every cell."""
    config = SimulationConfig(
        ks=args.k, agreements=args.agreement, cost_ratio=args.cost_ratio, seed=args.seed, rounds=args.rounds
    )
    result = simulate(config)
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


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the models and the drafter (generate, demo)."""
    parser.add_argument("--target", metavar="SPEC", help="target model (default: smollm2-135m)")
    parser.add_argument("--tokenizer", metavar="FILE", help="tokenizer file, for llama2.c checkpoints")
    parser.add_argument("--draft", metavar="SPEC", help="draft model for --drafter model (same tokenizer)")
    parser.add_argument(
        "--drafter", default="auto", help="auto (model with --draft, else ngram; default), none, model, ngram"
    )
    parser.add_argument("--k", default="4", help="draft tokens per round: N >= 0 or 'additive' (default: 4)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default: 128)")


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
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)"
    )
    parser.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below min_p × the top probability"
    )
    parser.add_argument("--seed", type=int, help="seed of all sampling (default: random)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Run ``verispec generate``."""
    from verispec.api import Speculator, k_policy  # loads transformers: only for the commands that need it

    prompt = args.prompt if args.prompt is not None else _read_stdin()
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed)
    k_policy(args.k)  # validate everything before loading a model
    EngineConfig(args.max_new_tokens, sampling, stop_strings=tuple(args.stop))
    speculator = Speculator(args.target, args.draft, args.drafter, args.tokenizer)
    options = dict(
        k=args.k, max_new_tokens=args.max_new_tokens, sampling=sampling, chat=args.chat, stop=args.stop
    )
    if args.json:
        result = speculator.generate(prompt, **options)
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats}))
        return 0
    stats = GenerationStats(speculator.drafter_name, str(args.k))
    for chunk in speculator.stream(prompt, stats=stats, **options):
        print(chunk.text, end="", flush=True)
    print()
    print(_summary(stats), file=sys.stderr)
    return 0


def _read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError("no prompt: give PROMPT or pipe it on standard input")
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
        description="Generate greedily for a prompt that copies its input, once with --drafter none and once "
        "with --drafter ngram (or --draft), check that both outputs are identical, and print the speedup.",
    )
    _add_model_arguments(parser)
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="the prompt (default: a spelling correction)")
    parser.set_defaults(func=run_demo, max_new_tokens=96)


def run_demo(args: argparse.Namespace) -> int:
    """Run ``verispec demo``: exit status 1 if the two outputs differ."""
    from verispec.api import Speculator

    greedy = SamplingParams(temperature=0)
    options = dict(k=args.k, max_new_tokens=args.max_new_tokens, sampling=greedy, chat=True)
    plain = Speculator(args.target, drafter="none", tokenizer=args.tokenizer)
    fast = Speculator((plain.model, plain.tokenizer), args.draft, args.drafter)
    plain.generate(args.prompt, **dict(options, max_new_tokens=4))  # warm-up: first-call overheads
    results = {}
    for name, speculator in (("none", plain), (fast.drafter_name, fast)):
        result = speculator.generate(args.prompt, **options)
        results[name] = result
        print(f"--- {name} ---\n{result.text.strip()}\n")
    base, spec = results["none"], results[fast.drafter_name]
    same = base.token_ids == spec.token_ids
    for name, result in results.items():
        s = result.stats
        print(
            f"{name:>6}: {s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tokens/s, "
            f"{s['tokens_per_target_call']:.2f} tokens per target call"
        )
    speedup = spec.stats["tokens_per_second"] / base.stats["tokens_per_second"]
    print(
        f"identical outputs: {'yes' if same else 'NO'}; speedup {speedup:.2f}x ({fast.drafter_name} vs none)"
    )
    return 0 if same else 1


# ---------------------------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    """The ``verispec`` parser with all its subcommands."""
    parser = _Parser(prog=PROG, description="Exact speculative decoding for language models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_generate_parser(subparsers)
    add_demo_parser(subparsers)
    add_simulate_parser(subparsers)
    return parser


def _report(message: str, status: int) -> int:
    """Print ``verispec: <message>`` as one line on stderr; return status."""
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]), run the subcommand, return the exit status (module doc)."""
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:  # --help or --version: printed, status 0
            return exit_.code if isinstance(exit_.code, int) else 0
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return status
    except ValueError as exc:
        return _report(f"error: {exc}", _USAGE_ERROR)
    except KeyboardInterrupt:
        return _report("interrupted", _INTERRUPTED)
    except BrokenPipeError:
        try:  # nothing more can be written: send what Python flushes at exit to /dev/null
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a real file (e.g. captured); nothing to silence
            pass
        return _BROKEN_PIPE

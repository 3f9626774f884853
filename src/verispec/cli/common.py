"""What the ``verispec`` commands share: the parser that raises UsageError, the flags that choose models,
drafters, threads, sampling, constraints and a suffix cache (declared once, read back into typed options),
the table and results printing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from verispec.drafting.registry import AUTO as AUTO_DRAFTER
from verispec.drafting.registry import CROSS_TOKENIZER, DRAFTERS, LOOKUP_FIRST, PLAIN, drafter_names
from verispec.errors import UsageError
from verispec.inputs import did_you_mean

if TYPE_CHECKING:  # the modules that load torch (and transformers) are imported by the commands that run
    from verispec.grammar.constraint import Constraint
    from verispec.options import DraftLength

__all__ = [
    "DEFAULT_MAX_BATCH",
    "PROG",
    "Parser",
    "across_fields",
    "add_constraint_arguments",
    "add_drafter_arguments",
    "add_generation_arguments",
    "add_invariant_argument",
    "add_max_batch_argument",
    "add_model_arguments",
    "add_model_specs",
    "add_sampling_arguments",
    "add_suffix_arguments",
    "add_threads_argument",
    "constraint_of",
    "read_text",
    "format_table",
    "joined_values",
    "list_of",
    "model_fields",
    "no_draft_model",
    "option_fields",
    "k_flag",
    "parse_precision",
    "refuse_empty_specs",
    "show_results",
    "suffix_fields",
    "tree_shape_of",
    "warn",
]


MAX_INTEGER = 2**63 - 1  # the largest integer an option takes (a seed's range: 64-bit, as torch's)


def _integer(text: str) -> int:
    """An integer option's value (``type=int``, see :class:`Parser`): ValueError for what is no integer
    (argparse reports it "invalid int value"), ArgumentTypeError beyond what 64 bits hold."""
    value = int(text)
    if abs(value) > MAX_INTEGER:
        raise argparse.ArgumentTypeError(f"{text} is out of range (at most 2**63 - 1 in size)")
    return value


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises UsageError instead of printing usage and exiting, so that :func:`main`
    reports every error the same way (subparsers are created with this class too); its ``type=int`` options
    take integers that 64 bits hold (beyond them, one line, never an overflow deep in a library); a flag it
    does not know is refused by the (sub)command that knows its flags, naming the closest one
    (``--max-tokens``: ``--max-new-tokens``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("type", int, _integer)

    def error(self, message: str) -> NoReturn:
        """Raise the usage error for :func:`main` to report."""
        raise UsageError(message)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, refusing at once an argument that looks like a flag and is not one of this parser's,
        with the closest of its flags."""
        parsed, extras = super().parse_known_args(args, namespace)
        flags = [x for x in extras if x.startswith("-") and not _number(x)]
        if flags:
            known = [flag for action in self._actions for flag in action.option_strings]
            close = did_you_mean(flags[0].split("=", 1)[0], known)
            raise UsageError(f"unrecognized arguments: {' '.join(extras)}{close}")
        return parsed, extras


def _number(text: str) -> bool:
    """Whether ``text`` is a number (a negative value, not a flag)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def list_of(convert: Callable[[str], Any], what: str) -> Callable[[str], tuple]:
    """An argparse ``type`` parsing a comma-separated list of values with ``convert`` (ranges are checked by
    the library's configs, not here)."""

    def parse(text: str) -> tuple:
        """The values of ``text``, or ArgumentTypeError (argparse reports it as one line)."""
        try:
            return tuple(convert(item) for item in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None

    return parse


def joined_values(values: Sequence[Any]) -> str:
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


def add_model_specs(parser: argparse.ArgumentParser) -> None:
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
        type=parse_precision,
        default="auto",
        metavar="PRECISION",
        help="weights of the native models on the CPU: fp32 (oneDNN), or on verispec's native kernels fp16, "
        "q8_0 or q4_1 (GGUF blocks, 8-bit activations): each another target, whose output is exactly its "
        "own; "
        "auto (default): the checkpoint's own format where the kernels run it, else fp16, else fp32",
    )


_SPECS = ("target", "draft", "tokenizer", "draft_tokenizer", "drafter_path")  # flags naming a model or a file


def refuse_empty_specs(args: argparse.Namespace) -> None:
    """UsageError for a model or file flag given as empty text (``--target ""`` would silently mean the
    default model); what a SPEC names is checked with its choice, before it loads
    (:meth:`~verispec.choice.ModelChoice.check_models`)."""
    for name in _SPECS:
        value = getattr(args, name, None)
        if isinstance(value, str) and not value.strip():
            raise UsageError(f"--{name.replace('_', '-')} is empty: name a model or a file (or leave it out)")


def check_target(args: argparse.Namespace) -> None:
    """UsageError for a ``--target`` that cannot name a model, known before anything loads
    (:func:`~verispec.models.names.check_spec`), for every command that takes one with ``--tokenizer``."""
    if isinstance(getattr(args, "target", None), str) and hasattr(args, "tokenizer"):
        from verispec.models.names import check_spec

        check_spec(args.target, args.tokenizer)


def parse_precision(value: str) -> str:
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


def across_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The Speculator's options for a draft of another tokenizer, from the flags."""
    return {"draft_tokenizer": args.draft_tokenizer, "cross_tokenizer": args.cross_tokenizer}


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The fields of a :class:`~verispec.choice.ModelChoice` (the models and the drafter), from the flags."""
    return {
        **({"target": args.target} if args.target else {}),
        "tokenizer": args.tokenizer,
        "draft": args.draft,
        "drafter": args.drafter,
        "drafter_path": args.drafter_path,
        "precision": args.precision,
        **across_fields(args),
    }


def no_draft_model(args: argparse.Namespace, command: str) -> None:
    """UsageError for the draft-model flags of a command whose drafters need none."""
    flags = {"--draft": args.draft is not None, "--draft-tokenizer": args.draft_tokenizer is not None,
             "--cross-tokenizer": args.cross_tokenizer != "auto"}  # fmt: skip
    if given := [flag for flag, set_ in flags.items() if set_]:
        raise UsageError(f"{command} runs drafters that need no draft model: leave out {', '.join(given)}")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the models and the drafter, K and the output's length (generate, demo)."""
    add_drafter_arguments(parser)
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


def add_drafter_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the models and the drafter (generate, demo, serve)."""
    add_model_specs(parser)
    kinds = "; ".join(f"{name}: {kind.summary}" for name, kind in DRAFTERS.items())
    parser.add_argument(
        "--drafter",
        default=AUTO_DRAFTER,
        help="auto (default): model with --draft, else the learned drafter shipped for the target (or given "
        f"by --drafter-path) where it pays, an eagle head behind prompt lookup ({LOOKUP_FIRST}), else ngram; "
        f"{kinds}",
    )
    parser.add_argument(
        "--drafter-path", metavar="FILE", help="a learned drafter (verispec train-drafter) for the target"
    )
    add_threads_argument(parser)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``, on every command that runs a model (applied by :func:`main` before it runs)."""
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads for the models (default: OMP_NUM_THREADS if set, else the cores this process may use: "
        "its CPU affinity, capped by a container's CPU quota); on a busy machine the native kernels drop to "
        "one by themselves; outputs never depend on it",
    )


def add_suffix_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a suffix drafter's cache kept across runs (generate, batch, serve)."""
    shared = drafter_names(lambda kind: kind.shared_cache)
    group = parser.add_argument_group(
        "suffix cache",
        f"the {shared} drafter's cache of earlier outputs, kept in a file (docs/suffix.md)",
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


def suffix_fields(args: argparse.Namespace) -> dict[str, Any]:
    """A :class:`~verispec.choice.ModelChoice`'s suffix cache fields, from the flags."""
    return {"suffix_cache_file": args.suffix_cache, "suffix_budget": args.suffix_budget}


def tree_shape_of(args: argparse.Namespace):
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


def add_generation_arguments(parser: argparse.ArgumentParser, *, seed_help: str, chat_help: str) -> None:
    """The flags of what a generation asks for, before its output's (generate, batch): the models, the
    suffix cache, sampling, the seed, invariant draws, chat and stop strings (read back by
    :func:`model_fields`, :func:`suffix_fields` and, with :func:`add_constraint_arguments`'s,
    :func:`option_fields`)."""
    add_model_arguments(parser)
    add_suffix_arguments(parser)
    add_sampling_arguments(parser, temperature=0.0)
    parser.add_argument("--seed", type=int, help=seed_help)
    add_invariant_argument(parser)
    parser.add_argument("--chat", action="store_true", help=chat_help)
    parser.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")


def add_max_batch_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--max-batch N``, how many ``what`` are decoded at once (batch, serve)."""
    parser.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        metavar="N",
        help=f"{what} decoded at once ({DEFAULT_MAX_BATCH})",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, temperature: float) -> None:
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


def add_invariant_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--invariant",
        action=argparse.BooleanOptionalAction,
        help="draw each position's token from the seed and the position alone: sampled output is then the "
        "target's own with that seed, the same whatever the drafter, K or batch (default: when a seed is "
        "given). --no-invariant: rejection sampling's draws, accepted a little more often by a sampling "
        "drafter, the tokens then depending on the drafter, K and batch",
    )


def add_constraint_arguments(parser: argparse.ArgumentParser) -> None:
    """--json-schema, --regex, --grammar (generate, batch): one of them."""
    group = parser.add_argument_group(
        "structured output",
        "constrain the output (exactly: distributed as constrained sampling without speculation); one of "
        'these, or a batch line\'s own "json_schema", "regex" or "grammar" key',
    ).add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", help="a JSON schema file: the output is such JSON")
    group.add_argument("--regex", metavar="TEXT", help="a regular expression the whole output matches")
    group.add_argument("--grammar", metavar="FILE", help="a grammar file, Lark or GBNF (llguidance's)")


def constraint_of(args: argparse.Namespace) -> Constraint | None:
    """The constraint the flags give, its file read and checked before any model loads (UsageError)."""
    from verispec.grammar.constraint import Constraint

    def read(path: str | None) -> str | None:
        return None if path is None else read_text(path)

    return Constraint.of(read(args.json_schema), args.regex, read(args.grammar))


def read_text(path: str) -> str:
    """A flag's file as text; UsageError (one line) when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None


def k_flag(args: argparse.Namespace) -> DraftLength:
    """--k parsed (default: auto); UsageError for a K with --drafter none, which drafts nothing whatever
    K says (generate, batch, demo)."""
    if args.k not in (None, "0") and args.drafter == PLAIN:
        raise UsageError(
            f"--drafter {PLAIN} drafts nothing: --k {args.k} would change nothing (leave it out)"
        )
    from verispec.options import DraftLength

    return DraftLength.parse(args.k)  # None: the default


def option_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The fields of a :class:`~verispec.options.GenerationOptions` (generate, batch), from the flags."""
    from verispec.options import SamplingParams

    return dict(
        k=k_flag(args),
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams.of(args),
        chat=args.chat,
        stop=tuple(args.stop),
        constraint=constraint_of(args),
    )


def show_results(out: Path) -> int:
    """Print a run's results.md, and on stderr where its files are."""
    print((out / "results.md").read_text())
    print(f"results written to {out}", file=sys.stderr)
    return 0


def warn(message: str) -> None:
    """Print ``verispec: warning: <message>`` as one line on stderr (what a run cannot honour in full)."""
    print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)


PROG = "verispec"
DEFAULT_MAX_BATCH = 8  # sequences decoded at once: generate --batch, batch and serve

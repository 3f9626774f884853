"""The ``verispec`` command line (also ``python -m verispec``).

Each subcommand is a pair of functions: ``add_<name>_parser(subparsers)`` declares its arguments and binds
``run_<name>`` with ``set_defaults(func=...)``; ``run_<name>(args) -> int`` does the work and returns the exit
status. To add one, write the pair and call ``add_<name>_parser`` from :func:`build_parser`.

Error contract: bad usage (unknown flag or subcommand, unparsable value) and any
:class:`~verispec.errors.UsageError` raised while running (the library's validation convention) print exactly
one line ``verispec: error: <message>`` on stderr and exit with status 2, as does running out of memory (a
count or size beyond this machine: ``error: out of memory (...): ask for less``) and an output with no room
left (a full disk, ``> /dev/full``: ``error: cannot write the output: ...``). Any other exception is a bug
(ours or a library's): one line ``verispec: internal error: ...`` asking for a report, exit status 1, and its
traceback with ``--debug``. Ctrl-C exits with 130 after one line (with what to do next where the command
says it: ``batch``'s resume); a closed output pipe (``verispec ... | head``) exits quietly with 141 (128 +
SIGPIPE, as a process killed by it would).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback
from collections.abc import Sequence

from verispec import __version__
from verispec.cli.batch import add_batch_parser
from verispec.cli.bench import (
    add_bench_gguf_parser,
    add_bench_load_parser,
    add_bench_parser,
    add_bench_serve_parser,
    add_bench_suffix_cache_parser,
    add_write_gguf_parser,
)
from verispec.cli.common import PROG, Parser, check_target, refuse_empty_specs
from verispec.cli.drafters import add_calibrate_parser, add_drafter_data_parser, add_train_drafter_parser
from verispec.cli.generate import add_demo_parser, add_generate_parser
from verispec.cli.serve import add_serve_parser
from verispec.cli.viz import add_simulate_parser, add_viz_parser
from verispec.cores import use_threads
from verispec.errors import UsageError

__all__ = ["build_parser", "main"]

_INTERNAL_ERROR = 1
_USAGE_ERROR = 2
_INTERRUPTED = 130  # 128 + SIGINT
_BROKEN_PIPE = 141  # 128 + SIGPIPE
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # an output that takes no more: a full disk, /dev/full


def build_parser() -> argparse.ArgumentParser:
    """The ``verispec`` parser with all its subcommands."""
    parser = Parser(prog=PROG, description="Exact speculative decoding for language models.")
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
        refuse_empty_specs(args)
        check_target(args)
        if hasattr(args, "threads"):  # a command that runs a model
            use_threads(args.threads)
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return status
    except UsageError as exc:
        return _report(f"error: {exc}", _USAGE_ERROR)
    except KeyboardInterrupt as exc:  # a command's own words, where it has some: what to do next
        return _report(f"interrupted: {exc}" if str(exc) else "interrupted", _INTERRUPTED)
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not _out_of_memory(exc):
            return _internal(exc, args)
        return _report(f"error: out of memory ({_first_line(exc)}): ask for less", _USAGE_ERROR)
    except BrokenPipeError:
        try:  # nothing more can be written: send what Python flushes at exit to /dev/null
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a real file (e.g. captured); nothing to silence
            pass
        return _BROKEN_PIPE
    except OSError as exc:  # an output with no room left: the machine's state, not a bug
        if exc.errno not in _NO_ROOM:
            return _internal(exc, args)
        return _report(f"error: cannot write the output: {exc.strerror}", _USAGE_ERROR)
    except Exception as exc:  # a bug, ours or a library's: never presented as the user's mistake
        return _internal(exc, args)


def _internal(exc: Exception, args: argparse.Namespace | None) -> int:
    """An internal error (a bug to report) in one line; its traceback with --debug."""
    if args is not None and args.debug:
        traceback.print_exc()
    hint = "" if args is not None and args.debug else "; run again with --debug for the traceback"
    return _report(f"internal error: {type(exc).__name__}: {exc} (please report it{hint})", _INTERNAL_ERROR)


def _out_of_memory(exc: RuntimeError) -> bool:
    """Whether torch's allocator could not give the memory asked for (its RuntimeError on the CPU)."""
    return "can't allocate memory" in str(exc) or "Storage size calculation overflowed" in str(exc)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]

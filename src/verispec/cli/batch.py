"""``verispec batch``: a JSONL file of requests, resumably, in-process or on Ray."""

from __future__ import annotations

import argparse
import sys

from verispec.cli.common import (
    add_constraint_arguments,
    add_generation_arguments,
    add_max_batch_argument,
    model_fields,
    option_fields,
    suffix_fields,
)

__all__ = ["add_batch_parser", "run_batch"]


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
    add_generation_arguments(
        parser,
        seed_help="the job's seed (default: random, kept for a resumed run)",
        chat_help="wrap plain prompts in the model's chat template",
    )
    add_constraint_arguments(parser)
    add_max_batch_argument(parser, "sequences")
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
        **model_fields(args),
        **suffix_fields(args),
        **option_fields(args),
        max_batch=args.max_batch,
        shard_size=args.shard_size,
        ray=args.ray,
        workers=args.workers,
    )
    job.check_models()  # before anything starts
    try:
        summary = run_job(job)
    except KeyboardInterrupt:
        if not job.parts.is_dir():  # interrupted before anything was kept
            raise
        done = len(list(job.parts.glob("shard-*.jsonl")))
        raise KeyboardInterrupt(
            f"{done} finished shard{'s are' if done != 1 else ' is'} kept in {job.parts}: "
            "run the same command again to resume"
        ) from None
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

"""The measuring commands: ``bench``, ``bench-load``, ``bench-serve``, ``bench-suffix-cache``, ``write-gguf``
and ``bench-gguf``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from verispec.bench.methods import results_dir
from verispec.cli.common import (
    add_model_specs,
    add_threads_argument,
    list_of,
    no_draft_model,
    show_results,
)
from verispec.drafting.registry import drafter_names
from verispec.errors import UsageError
from verispec.inputs import check_int

__all__ = [
    "add_bench_gguf_parser",
    "add_bench_load_parser",
    "add_bench_parser",
    "add_bench_serve_parser",
    "add_bench_suffix_cache_parser",
    "add_write_gguf_parser",
    "run_bench",
    "run_bench_gguf",
    "run_bench_load",
    "run_bench_serve",
    "run_bench_suffix_cache",
    "run_write_gguf",
]


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
    add_model_specs(parser)
    parser.add_argument(
        "--tasks",
        type=list_of(str, "task names"),
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
        type=list_of(str, "method names"),
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
        type=list_of(str, "values"),
        default="4,auto",
        help="draft lengths, comma-separated: N or auto (default: %(default)s); transformers use the numbers",
    )
    parser.add_argument(
        "--trees",
        type=list_of(str, "tree shapes"),
        default=(),
        help=f"token-tree shapes for the tree methods ({', '.join(TREE_METHODS)}), comma-separated: WxD "
        "(width x depth) or a JSON shape file; each tree of N nodes runs beside its chain method at "
        "K = N - 1 (default: none)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per prompt (default: %(default)s)")
    parser.add_argument(
        "--temperature",
        type=list_of(float, "numbers"),
        default="0",
        help="comma-separated; 0 is greedy, T > 0 samples (default: %(default)s)",
    )
    parser.add_argument("--repetitions", type=int, default=3, help="timed runs per cell (default: 3)")
    parser.add_argument("--prompts-per-task", type=int, metavar="N", help="the first N prompts of each task")
    add_threads_argument(parser)
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
    add_model_specs(parser)
    parser.add_argument(
        "--methods",
        type=list_of(str, "method names"),
        default="none,ngram,auto,transformers",
        help=f"comma-separated, of {', '.join(LOAD_METHODS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--k", type=list_of(str, "values"), default="auto", help="draft lengths: N or auto (default: auto)"
    )
    parser.add_argument(
        "--concurrency",
        type=list_of(int, "integers"),
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
    add_threads_argument(parser)
    parser.add_argument("--out", metavar="DIR", help="output directory (default: results/bench-load-STAMP)")
    parser.set_defaults(func=run_bench_load)


def run_bench_load(args: argparse.Namespace) -> int:
    """Run ``verispec bench-load``: print the table; the files go to --out."""
    from verispec.bench.load import LoadConfig, run_load, write_load_report

    config = LoadConfig(
        target=args.target or LoadConfig.target,
        tokenizer=args.tokenizer,
        draft=args.draft,
        draft_tokenizer=args.draft_tokenizer,
        cross_tokenizer=args.cross_tokenizer,
        precision=args.precision,
        methods=tuple(args.methods),
        ks=tuple(args.k),
        concurrency=tuple(args.concurrency),
        requests=args.requests,
        repetitions=args.repetitions,
        max_new_tokens=args.max_new_tokens,
        threads=args.threads,
        out=args.out or results_dir("bench-load"),
    )
    out = write_load_report(run_load(config), config.out)
    return show_results(out)


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
    add_model_specs(parser)
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
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        metavar="N",
        help="serve with --ray --replicas N (a local Ray; --threads: each replica's), each client a session "
        "(docs/serve-ray.md; default 0: the server alone)",
    )
    parser.add_argument(
        "--kill-replica-at",
        type=float,
        metavar="SECONDS",
        help="with --replicas 2 or more: kill the replica that answered most this many seconds into the run "
        "(a crash); its requests must fail with one message, the others succeed, Ray Serve start another",
    )
    add_threads_argument(parser)
    parser.add_argument("--out", metavar="DIR", help="output directory (default: results/bench-serve-STAMP)")
    parser.set_defaults(func=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run ``verispec bench-serve``: print the table; the files go to --out."""
    from verispec.bench.serve import ServeLoadConfig, run_serve_load, write_serve_report

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
        replicas=args.replicas,
        threads=args.threads if args.replicas else None,
        kill_replica_at=args.kill_replica_at,
        engine=not args.no_engine,
        out=args.out or results_dir("bench-serve"),
    )
    no_draft_model(args, "bench-serve")
    out = write_serve_report(run_serve_load(config), config.out)
    return show_results(out)


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
    add_threads_argument(parser)
    parser.add_argument(
        "--out", metavar="DIR", help="output directory (default: results/bench-suffix-cache-STAMP)"
    )
    parser.set_defaults(func=run_bench_suffix_cache)


def run_bench_suffix_cache(args: argparse.Namespace) -> int:
    """Run ``verispec bench-suffix-cache``: print the tables; the files go to --out."""
    from verispec.bench.suffix_cache import (
        SuffixCacheBenchConfig,
        run_suffix_cache_bench,
        write_suffix_cache_report,
    )
    from verispec.models.names import DEFAULT_MODEL

    out = args.out or results_dir("bench-suffix-cache")
    config = SuffixCacheBenchConfig(
        target=args.target or DEFAULT_MODEL,
        tokenizer=args.tokenizer,
        requests=args.requests,
        budget=args.budget,
        lookups=args.lookups,
        k=args.k,
        tree=args.tree,
    )
    return show_results(write_suffix_cache_report(run_suffix_cache_bench(config), out).parent)


# write-gguf --from's types, as the help lists them (models.gguf_requantize.FILE_TYPES: tested equal; the
# models package imports torch, which --help must not)
FROM_TYPES = "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, Q6_K, F16, BF16"


def add_write_gguf_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec write-gguf``."""
    parser = subparsers.add_parser(
        "write-gguf",
        help="write a GGUF file: random weights of a given shape (for speed runs), a model requantized, or a "
        "model inflated to a bigger model's cost",
        description="Write a GGUF file. --shape: a Llama-3-shaped model with random weights in one tensor "
        "type, quickly (random blocks with sane scales, tensor by tensor), with a minimal tokenizer: speed "
        "does not depend on the weights' values, so such a file measures the regime of large models without "
        "downloading one; its outputs are meaningless: never report their acceptance. --from: a GGUF file "
        "(or a short name's) requantized by llama.cpp's own quantizer (after `make peers`) to a file type "
        "whose tensors all run natively, e.g. the shipped SmolLM2 file as Q4_K_M; requantizing a quantized "
        "file compounds two roundings: for speed and format checks, not for quality. --from with --inflate: "
        "the model zero-padded to a bigger model's widths (llama3-1b, llama3-3b, llama3-8b or "
        "hidden=H,ffn=F[,kv_heads=K]), which computes the same function (the presets' logits bit for bit) at "
        "the bigger model's cost: a real model's predictions where users' models live. It is not a better "
        "model.",
    )
    parser.add_argument("--out", required=True, metavar="FILE.gguf", help="the file to write (atomically)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--shape",
        help="random weights: llama3-1b, llama3-3b, or hidden=H,layers=L,heads=N,kv_heads=K,ffn=F,vocab=V "
        "[,tied=0|1][,rope_base=B][,rope_factor=X|none][,context=C]",
    )
    source.add_argument(
        "--from", dest="source", metavar="MODEL", help="a GGUF file or short name to requantize"
    )
    parser.add_argument(
        "--inflate",
        metavar="SHAPE",
        help="with --from: pad the model's widths to SHAPE's cost, keeping its function (llama3-1b, "
        "llama3-3b, llama3-8b, or hidden=H,ffn=F[,kv_heads=K]); its blocks stay in their types (no --type)",
    )
    parser.add_argument(
        "--drafters",
        metavar="shipped|FILE[,FILE]",
        help="with --inflate: learned drafters of MODEL padded the same way, each written beside --out as "
        "OUT.KIND.safetensors (shipped: those verispec ships for MODEL)",
    )
    parser.add_argument(
        "--type",
        help="with --shape: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K or F16; with --from (without "
        "--inflate): " + FROM_TYPES,
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of --shape (default: %(default)s)")
    parser.set_defaults(func=run_write_gguf)


def run_write_gguf(args: argparse.Namespace) -> int:
    """Run ``verispec write-gguf``: check every argument, write the file, print where it is."""
    if args.inflate is not None and args.source is None:
        raise UsageError("--inflate pads a model: give it with --from MODEL")
    if args.inflate is not None and args.type is not None:
        raise UsageError("--inflate keeps each tensor's type: drop --type (requantize first, then inflate)")
    if args.inflate is None and args.type is None:
        raise UsageError(f"--type is required with {'--from' if args.source is not None else '--shape'}")
    if args.drafters is not None and args.inflate is None:
        raise UsageError("--drafters are padded for an inflated file: give --inflate too")
    if args.inflate is not None:
        return _inflate(args)
    if args.source is not None:
        from verispec.cores import available_cores
        from verispec.models.gguf_requantize import requantize_gguf
        from verispec.models.registry import gguf_file

        source = gguf_file(args.source)
        if source is None:
            raise UsageError(f"--from takes a .gguf file or a short name with one, got {args.source!r}")
        path = requantize_gguf(source, args.out, args.type, available_cores())
        print(f"{args.source} requantized to {args.type}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
        return 0
    from verispec.models.gguf_write import parse_shape, write_random_gguf

    path = write_random_gguf(args.out, parse_shape(args.shape), args.type, args.seed)
    print(f"random-weight GGUF written to {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


def _inflate(args: argparse.Namespace) -> int:
    """``write-gguf --from MODEL --inflate SHAPE [--drafters ...]``: the file, then each drafter beside it."""
    from verispec.models.gguf_inflate import inflate_gguf
    from verispec.models.registry import gguf_file

    source = gguf_file(args.source)
    if source is None:
        raise UsageError(f"--from takes a .gguf file or a short name with one, got {args.source!r}")
    drafters = _drafters_to_inflate(args.drafters, args.source)
    if drafters:  # each checked against the source before anything is written
        from verispec.drafting.learned.inflate import inflate_drafter
        from verispec.drafting.learned.kinds import load_head
        from verispec.models.registry import load_model

        small = load_model(source, precision="auto")[0]
        kinds = [load_head(drafter, small, args.source).kind for drafter in drafters]
    path, plan = inflate_gguf(source, args.out, args.inflate)
    exact = "the source's logits bit for bit" if plan.exact else "the source's function up to rounding"
    print(
        f"{args.source} inflated ({plan.describe()}; {exact}): {path} ({path.stat().st_size / 2**20:.1f} MiB)"
    )
    if drafters:
        wide = load_model(path, precision="auto")[0]
        for drafter, kind in zip(drafters, kinds, strict=True):
            out = inflate_drafter(
                drafter, small, wide, plan.scaling, path.with_name(f"{path.stem}.{kind}.safetensors")
            )
            print(f"{kind} drafter {drafter} padded for it: {out}")
    return 0


def _drafters_to_inflate(spec: str | None, model: str) -> list[Path]:
    """The drafter files ``--drafters`` names (``shipped``: verispec's own for ``model``); UsageError for a
    missing file or a model verispec ships none for."""
    if spec is None:
        return []
    if spec == "shipped":
        from verispec.drafting.learned.kinds import HEADS, shipped_drafter

        found = [path for kind in HEADS if (path := shipped_drafter(model, kind)) is not None]
        if not found:
            raise UsageError(f"verispec ships no drafters for {model!r}: give their files to --drafters")
        return found
    paths = [Path(item.strip()) for item in spec.split(",") if item.strip()]
    for path in paths:
        if not path.is_file():
            raise UsageError(f"no such drafter file: {path}")
    if not paths:
        raise UsageError("--drafters takes shipped or drafter files, FILE[,FILE]")
    return paths


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
        help="a random-weight file: llama3-1b, llama3-3b or explicit dims (see write-gguf), and a type; "
        "written once into verispec's cache (bench/; 0.7 GB for llama3-1b:Q4_K, 1.8 GB for llama3-3b:Q4_K); "
        "repeat it for several",
    )
    add_threads_argument(parser)
    parser.add_argument(
        "--context", type=int, default=256, help="positions before the timed tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--prefill", type=int, default=128, help="prompt tokens timed for prefill (default: %(default)s)"
    )
    parser.add_argument(
        "--max-k",
        type=int,
        default=8,
        help="v(k) for blocks of k = 1..max-k tokens; a round of K drafts verifies K + 1, so the predicted "
        "best K is at most max-k - 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--repetitions", type=int, default=7, help="timed repetitions of each figure (default: %(default)s)"
    )
    parser.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: results/bench-gguf-STAMP)")
    parser.set_defaults(func=run_bench_gguf)


def run_bench_gguf(args: argparse.Namespace) -> int:
    """Run ``verispec bench-gguf``: check every argument (before torch loads), measure each file, print the
    tables."""
    for name, least in (("context", 1), ("prefill", 2), ("max_k", 2), ("repetitions", 1)):  # v(k): k >= 2
        check_int(getattr(args, name), f"--{name.replace('_', '-')}", least)
    files = [Path(f) for f in args.files]
    for path in files:
        if path.suffix != ".gguf" or not path.is_file():
            raise UsageError(f"no such GGUF file: {path}")
    if not files and not args.random:
        raise UsageError("give GGUF files, or --random SHAPE:TYPE")
    from verispec.models.gguf_file import read_gguf

    for path in files:
        read_gguf(path)  # a file that is not GGUF: at once
    import torch

    from verispec.bench.gguf import (
        FileBenchConfig,
        bench_file,
        check_file,
        machine,
        random_file,
        read_bandwidth,
        write_report,
    )

    files += [random_file(spec) for spec in args.random]
    threads = args.threads or torch.get_num_threads()
    config = FileBenchConfig(
        tuple(files), threads, args.context, args.prefill, args.max_k, args.repetitions, not args.no_llamacpp
    )
    for path in files:
        check_file(path, config)  # before a byte is measured (a 1 GB buffer) or loaded
    load_at_start = os.getloadavg()
    bandwidth = read_bandwidth(threads)
    results = [bench_file(path, config, bandwidth) for path in files]
    out = write_report(results, config, machine(load_at_start), Path(args.out or results_dir("bench-gguf")))
    return show_results(out)

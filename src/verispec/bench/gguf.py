"""``verispec bench-gguf``: a GGUF file run in place on the native kernels, where users' models live.

Per file: the memory loading added (RSS, against the file's size), the load time, decoding's time per token
after ``context`` committed positions against the bandwidth limit (the bytes of the weight matrices a token
reads, at the read rate this machine measures in the same run), the verification curve v(k) = T(k) / T(1)
for k = 1..max_k (each block timed in a pair with a single token, medians of the ratios), prefill tokens/s,
and llama.cpp on the same file and threads with its default settings (weight repacking on), where ``make
peers`` installed it: its decoding and prefill, timed the same way, in turns with verispec's. Then the
analytic model turns the measured v(k) into the speedup a drafter of a given acceptance α and cost ratio c
would reach (its best K). Random-weight files (``--random SHAPE:TYPE``, written once into verispec's cache)
measure the regime of large models without downloading one: speed does not depend on the weights' values,
their outputs are meaningless and no acceptance is measured on them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from verispec.bench.peers import llamacpp_missing, llamacpp_model
from verispec.costs.analytic import expected_speedup, optimal_k
from verispec.errors import UsageError
from verispec.inputs import is_int
from verispec.kernels.threads import THREADS
from verispec.models.gguf import cache_dir
from verispec.models.gguf_file import read_gguf
from verispec.models.gguf_native import in_place_problem, load_gguf
from verispec.models.gguf_write import RANDOM_NAME, TYPES, parse_shape, write_random_gguf
from verispec.models.llama import Llama

__all__ = [
    "FileBenchConfig",
    "FileResult",
    "bench_file",
    "check_file",
    "machine",
    "random_file",
    "read_bandwidth",
    "write_report",
]

PREDICTED = ((0.6, 0.0), (0.8, 0.0), (0.8, 0.05))  # (α, c): prompt lookup-like, and a cheap learned head


@dataclass(frozen=True)
class FileBenchConfig:
    """What ``verispec bench-gguf`` measures (validated at the command line)."""

    files: tuple[Path, ...]
    threads: int
    context: int = 256
    prefill: int = 128
    max_k: int = 8
    repetitions: int = 7
    llamacpp: bool = True

    @property
    def positions(self) -> int:
        """The cache a file's timings fill: the context, then the longer of a block and a prompt, and room."""
        return self.context + max(self.max_k, self.prefill) + 16


@dataclass
class FileResult:
    """One file's measurements (seconds, bytes, GB/s); llama.cpp's are None where it did not run."""

    file: str
    file_bytes: int
    weight_bytes: int  # the matrices a decoding step reads: every layer's and the head's
    formats: str
    load_seconds: float
    rss_added: int
    startup_rss: int  # a process's one-time memory for its first model (torch's start), apart from rss_added
    decode_seconds: float
    bandwidth: float
    verify: list[float]  # v(1) .. v(max_k)
    prefill_tps: float
    llamacpp_decode_seconds: float | None = None
    llamacpp_prefill_tps: float | None = None
    agreement: dict | None = None  # against llama.cpp's logits on a real file (see _agreement)
    predicted: list[dict] = field(default_factory=list)

    @property
    def bound_seconds(self) -> float:
        """The time a token's weight bytes take to read at the measured rate."""
        return self.weight_bytes / (self.bandwidth * 1e9)


def random_file(spec: str) -> Path:
    """The random-weight file of ``SHAPE:TYPE`` (e.g. ``llama3-1b:Q4_K``), written once into verispec's cache
    (``bench/``) and reused."""
    shape, _, type_name = spec.partition(":")
    if type_name not in TYPES:
        raise UsageError(f"--random takes SHAPE:TYPE with TYPE one of {', '.join(TYPES)}, got {spec!r}")
    parsed = parse_shape(shape)
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in shape)
    path = cache_dir().parent / "bench" / f"{name}-{type_name}.gguf"
    if not path.is_file():
        print(f"verispec: writing the random-weight file {path} (once; kept for later runs)", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_random_gguf(path, parsed, type_name)
    return path


def read_bandwidth(threads: int, gigabytes: float = 1.0) -> float:
    """This machine's read rate now, GB/s: the best of 5 sums over a float32 buffer far larger than caches."""
    buffer = torch.ones(int(gigabytes * 2**30 / 4))  # [n] float32
    torch.set_num_threads(threads)
    best = min(_timed(lambda: buffer.sum()) for _ in range(5))
    return buffer.numel() * 4 / best / 1e9


# the vector extensions the kernels' speed depends on, widest first (a Linux /proc/cpuinfo flag each)
_VECTOR_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni", "avx512f", "avx2")


def machine(load_at_start: tuple[float, float, float]) -> dict[str, Any]:
    """What the run's figures depend on beyond the files: the CPU, its vector extensions and last-level
    cache, the load average at the start and now, llama.cpp's version (None where not installed)."""
    from verispec.costs.calibrate import cpu_name
    from verispec.kernels.build import cpu_features

    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()  # e.g. 266240K
        llc: str | None = f"{int(size[:-1]) // 1024} MiB" if size.endswith("K") else size
    except OSError:
        llc = None
    try:
        import llama_cpp

        peer = llama_cpp.__version__
    except ImportError:
        peer = None
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "vector": [f for f in _VECTOR_FLAGS if f in cpu_features().split()],
        "last_level_cache": llc,
        "load_average_at_start": list(load_at_start),
        "load_average_at_end": list(os.getloadavg()),
        "llamacpp": peer,
    }


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


_LOAD = """
import json, sys, time
from pathlib import Path
import torch
from verispec.models.gguf_native import load_gguf
from verispec.models.llama import Llama
from verispec.models.llama_config import LlamaConfig

def rss():
    lines = Path("/proc/self/status").read_text().splitlines()
    return next(int(x.split()[1]) * 1024 for x in lines if x.startswith("VmRSS:"))

torch.set_num_threads(int(sys.argv[2]))
start = rss()
Llama(LlamaConfig(8, 8, 8, 1, 1, 1), device="meta")  # torch's one-time start of a first model
before, start_seconds = rss(), time.perf_counter()
model = load_gguf(sys.argv[1])
seconds, added = time.perf_counter() - start_seconds, rss() - before
print(json.dumps({"seconds": seconds, "rss_added": added, "startup": before - start}))
"""


def _load_in_child(path: Path, threads: int) -> dict:
    """Load time and memory added, {"seconds", "rss_added", "startup"}, measured in a fresh process (Linux):
    what loading adds to a process that has imported verispec and made its first model (``startup``: the
    memory that first model took, once per process, whatever its size: torch's own start)."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(path), str(threads)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise UsageError(f"cannot load {path}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_file(path: Path, config: FileBenchConfig) -> None:
    """UsageError (one line, naming the file) unless ``path`` is a GGUF file the native kernels run in place
    whose context holds the positions the bench fills (:attr:`FileBenchConfig.positions`): checked from its
    header alone, before anything is measured or loaded."""
    reader = read_gguf(path)
    problem = in_place_problem(reader)
    if problem is not None:
        raise UsageError(f"{path} cannot run in place: {problem}")
    context = reader.fields.get(f"{reader.fields.get('general.architecture')}.context_length")
    if is_int(context) and config.positions > context:
        raise UsageError(
            f"{path} holds {context} positions, and --context {config.context} with --max-k {config.max_k} "
            f"and --prefill {config.prefill} fill {config.positions}: ask for fewer"
        )


def bench_file(path: Path, config: FileBenchConfig, bandwidth: float) -> FileResult:
    """Measure ``path`` (see the module docstring)."""
    reader = read_gguf(path)
    weight_bytes = sum(
        int(t.n_bytes)
        for t in reader.tensors
        if len(t.shape) == 2 and t.name != "token_embd.weight" or t.name == "output.weight"
    )
    if not any(t.name == "output.weight" for t in reader.tensors):  # a tied head reads the embeddings
        weight_bytes += next(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    real = not str(reader.fields.get("general.name", "")).startswith(RANDOM_NAME)  # random: no agreement
    del reader
    loads = [_load_in_child(path, config.threads) for _ in range(2)]  # the first reads the file from disk
    torch.set_num_threads(config.threads)
    model = load_gguf(path)
    with THREADS.held():  # no probe of another thread count among the timed forwards
        timings = _timings(model, path, config, real)
    result = FileResult(
        file=str(path),
        file_bytes=path.stat().st_size,
        weight_bytes=weight_bytes,
        formats=model.cpu_precision or "",
        load_seconds=loads[1]["seconds"],
        rss_added=max(load["rss_added"] for load in loads),
        startup_rss=max(load["startup"] for load in loads),
        bandwidth=bandwidth,
        **timings,
    )
    for alpha, c in PREDICTED:
        k = optimal_k(alpha, c, result.verify)
        speedup = expected_speedup(alpha, k, c, result.verify) if k else 1.0
        result.predicted.append({"alpha": alpha, "cost_ratio": c, "k": k, "speedup": speedup})
    return result


def _timings(model: Llama, path: Path, config: FileBenchConfig, real: bool) -> dict[str, Any]:
    """The timed fields of :class:`FileResult` (and on a ``real`` file, its agreement with llama.cpp)."""
    vocab, capacity = model.vocab_size, config.positions
    ids = torch.randint(0, vocab, (1, capacity), generator=torch.Generator().manual_seed(0))  # [1, capacity]
    cache = model.new_cache(1, capacity)
    model.prefill(ids[:, : config.context], torch.arange(config.context)[None], cache)

    def step(k: int) -> float:  # a block of k new tokens after the context, then rolled back
        tokens, positions = (
            ids[:, config.context : config.context + k],
            torch.arange(k)[None] + config.context,
        )
        seconds = _timed(lambda: model(tokens, positions, cache))
        cache.truncate(config.context)
        return seconds

    peer = _LlamaCpp(path, config) if config.llamacpp and llamacpp_missing() is None else None
    singles: list[float] = []
    peer_singles: list[float] = []
    ratios: dict[int, list[float]] = {k: [] for k in range(2, config.max_k + 1)}
    step(1)  # warm
    for _ in range(config.repetitions):  # turns: verispec's pairs, then llama.cpp's token
        for k in ratios:
            one = step(1)
            singles.append(one)
            ratios[k].append(step(k) / one)
        if peer is not None:
            peer_singles.append(peer.decode(ids[0, : config.context + 1].tolist()))

    def prefill() -> None:  # the prompt into a fresh cache, logits of its last token only (as llama.cpp's)
        fresh, n = model.new_cache(1, config.prefill), config.prefill
        model.prefill(ids[:, : n - 1], torch.arange(n - 1)[None], fresh)
        model(ids[:, n - 1 : n], torch.tensor([[n - 1]]), fresh)

    return {
        "decode_seconds": statistics.median(singles),
        "verify": [1.0] + [statistics.median(ratios[k]) for k in ratios],
        "prefill_tps": config.prefill / min(_timed(prefill) for _ in range(3)),
        "llamacpp_decode_seconds": statistics.median(peer_singles) if peer_singles else None,
        "llamacpp_prefill_tps": peer.prefill_tps(ids[0, : config.prefill].tolist()) if peer else None,
        "agreement": _agreement(model, path, peer) if peer is not None and real else None,
    }


class _LlamaCpp:
    """llama.cpp (llama-cpp-python) on the file, the bench's settings (:func:`llamacpp_model`), logits of the
    last token only."""

    def __init__(self, path: Path, config: FileBenchConfig) -> None:
        context = config.context + config.prefill + 16
        self.model = llamacpp_model(path, config.threads, context, batch=context)
        self.context = config.context

    def decode(self, ids: list[int]) -> float:
        """Seconds to decode the last of ``ids`` after the others (evaluated once, then kept)."""
        if self.model.n_tokens < self.context:
            self.model.reset()
            self.model.eval(ids[:-1])
        self.model.n_tokens = self.context  # the next eval drops what came after
        return _timed(lambda: self.model.eval(ids[-1:]))

    def logits(self, ids: list[int]) -> torch.Tensor:
        """llama.cpp's logits [len(ids), vocab] of every position of ``ids``, in one evaluation."""
        import llama_cpp

        self.model.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.model.ctx), True)  # its KV cache too
        batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
                batch.seq_id[i][0] = 0
            if llama_cpp.llama_decode(self.model.ctx, batch) != 0:
                raise UsageError("llama.cpp could not evaluate the agreement text")
            vocab = self.model.n_vocab()
            values = llama_cpp.llama_get_logits(self.model.ctx)
            return torch.tensor([values[i * vocab : (i + 1) * vocab] for i in range(len(ids))])
        finally:
            llama_cpp.llama_batch_free(batch)

    def prefill_tps(self, ids: list[int]) -> float:
        def once() -> None:
            self.model.reset()
            self.model.eval(ids)

        return len(ids) / min(_timed(once) for _ in range(3))


AGREEMENT_POSITIONS = 256  # positions of the built-in summarization prompts compared with llama.cpp


def _agreement(model: Llama, path: Path, peer: _LlamaCpp) -> dict:
    """verispec's logits against llama.cpp's on the same file, over the first AGREEMENT_POSITIONS tokens of
    the bench's summarization prompts (the file's own tokenizer): the share of positions where their most
    likely tokens agree and KL(llama.cpp ‖ verispec), mean and max; and how many of verispec's 48 greedy
    tokens after the first 128 of them llama.cpp's greedy choice repeats before it first differs."""
    from verispec.bench.prompts import builtin_tasks
    from verispec.models.registry import load_tokenizer

    text = "\n\n".join(str(p.for_model(chat=False)) for p in builtin_tasks()["summarization"])
    ids = load_tokenizer(path).encode(text)[: min(AGREEMENT_POSITIONS, peer.context)]
    theirs = peer.logits(ids)  # [T, vocab]
    with torch.no_grad():
        ours = model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache(1, len(ids)))[0]
        prompt, greedy = ids[:128], []
        cache = model.new_cache(1, len(prompt) + 48)
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)[0, -1]  # [vocab]
        for i in range(48):
            greedy.append(int(logits.argmax()))
            position = torch.tensor([[len(prompt) + i]])
            logits = model(torch.tensor([[greedy[-1]]]), position, cache)[0, -1]
    their_greedy = peer.logits(prompt + greedy[:-1])[len(prompt) - 1 :].argmax(-1).tolist()  # [48]
    same = next((i for i, (a, b) in enumerate(zip(greedy, their_greedy, strict=True)) if a != b), 48)
    reference = load_gguf(path, "fp16")  # the file's weights (fp16 holds them), float activations
    with torch.no_grad():
        exact = reference(
            torch.tensor([ids]), torch.arange(len(ids))[None], reference.new_cache(1, len(ids))
        )[0]
    kl = _kl(theirs, ours)  # [T]
    return {
        "positions": len(ids),
        "top1": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "greedy_same": same,
        "kl_float_llamacpp": float(_kl(exact, theirs).mean()),
        "kl_float_verispec": float(_kl(exact, ours).mean()),
    }


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per position [T] of logits [T, vocab]."""
    p, q = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)  # [T, vocab]
    return (p.exp() * (p - q)).sum(-1)


def write_report(results: list[FileResult], config: FileBenchConfig, host: dict[str, Any], out: Path) -> Path:
    """results.json and results.md in ``out`` (``host``: :func:`machine`'s record); returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    records = [asdict(r) | {"bound_seconds": r.bound_seconds} for r in results]
    document = {"config": _jsonable(config), "machine": host, "files": records}
    (out / "results.json").write_text(json.dumps(document, indent=2))
    (out / "results.md").write_text(report(results, config, host))
    return out


def _jsonable(config: FileBenchConfig) -> dict:
    return {k: [str(f) for f in v] if k == "files" else v for k, v in asdict(config).items()}


def report(results: list[FileResult], config: FileBenchConfig, host: dict[str, Any]) -> str:
    """The tables of a run (markdown)."""
    loads = " → ".join(f"{host[k][0]:.2f}" for k in ("load_average_at_start", "load_average_at_end"))
    peer = "left out (--no-llamacpp)" if not config.llamacpp else host["llamacpp"] or "not installed"
    turns = f"{config.repetitions} repetition{'s' if config.repetitions > 1 else ''}"
    lines = [
        f"GGUF files on the native kernels, {config.threads} threads, decoding after {config.context} "
        f"positions; medians of {turns}"
        f"{', in turns with llama.cpp' if config.llamacpp and host['llamacpp'] else ''}.",
        "",
        f"Machine: {host['cpu']}, {host['cores']} cores ({', '.join(host['vector']) or 'no AVX2'}; "
        f"last-level cache {host['last_level_cache'] or 'unknown'}); load average {loads} (start → end); "
        f"llama.cpp {peer}.",
        "",
        "| file | formats | MB | tok/s | × llama.cpp | ms/token | bound ms | bound/time | RSS/file | load s "
        "| prefill tok/s | × llama.cpp |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        peer = r.llamacpp_decode_seconds
        peer_prefill = r.llamacpp_prefill_tps
        lines.append(
            f"| {Path(r.file).name} | {r.formats} | {r.file_bytes / 1e6:.0f} | {1 / r.decode_seconds:.1f} | "
            f"{'—' if peer is None else f'{peer / r.decode_seconds:.2f}'} | {r.decode_seconds * 1e3:.1f} | "
            f"{r.bound_seconds * 1e3:.1f} | {r.bound_seconds / r.decode_seconds:.2f} | "
            f"{r.rss_added / r.file_bytes:.2f} | {r.load_seconds:.1f} | {r.prefill_tps:.0f} | "
            f"{'—' if peer_prefill is None else f'{r.prefill_tps / peer_prefill:.2f}'} |"
        )
    agreements = [r for r in results if r.agreement is not None]
    if agreements:
        lines += [
            "",
            "Against llama.cpp's logits on the same file (real weights): the share of positions whose most "
            "likely token agrees, KL(llama.cpp ‖ verispec) per position, and how many of verispec's 48 "
            "greedy tokens llama.cpp's greedy choice repeats before it first differs; and each engine's KL "
            "from a float reference (the file's weights in fp16, which holds them, float activations): "
            "both quantize activations, each its own way.",
            "",
            "| file | positions | top-1 agreement | KL mean | KL max | greedy tokens the same "
            "| KL float ‖ llama.cpp | KL float ‖ verispec |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in agreements:
            a = r.agreement
            assert a is not None
            lines.append(
                f"| {Path(r.file).name} | {a['positions']} | {a['top1']:.3f} | {a['kl_mean']:.4f} | "
                f"{a['kl_max']:.3f} | {a['greedy_same']} / 48 | {a['kl_float_llamacpp']:.4f} | "
                f"{a['kl_float_verispec']:.4f} |"
            )
    lines += ["", "Verification cost v(k) = T(k) / T(1):", ""]
    if config.repetitions < 3:
        lines += [
            f"(from {turns}: timings this few move from run to run — a v(k) below 1 is such noise — and the "
            "predicted speedups below with them; the default 7 or more settle them)",
            "",
        ]
    ks = range(1, config.max_k + 1)
    lines += ["| file | " + " | ".join(f"v({k})" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    lines += [f"| {Path(r.file).name} | " + " | ".join(f"{v:.2f}" for v in r.verify) + " |" for r in results]
    lines += [
        "",
        "Predicted speedup over plain decoding from the measured v(k) (analytic model, best K), for a "
        "drafter of acceptance α per token and cost c per draft token (in target steps):",
        "",
        "| file | " + " | ".join(f"α={a}, c={c}" for a, c in PREDICTED) + " |",
        "|---|" + "---|" * len(PREDICTED),
    ]
    for r in results:
        cells = [f"{p['speedup']:.2f}× (K={p['k']})" for p in r.predicted]
        lines.append(f"| {Path(r.file).name} | " + " | ".join(cells) + " |")
    if results:
        lines += [
            "",
            f"Read rate measured in this run: {results[0].bandwidth:.1f} GB/s. RSS/file: memory a load adds "
            "(a fresh process, after its first model: torch's one-time start took "
            f"{max(r.startup_rss for r in results) / 2**20:.0f} MB more); load s: a second load, the file "
            "in the page cache.",
        ]
    return "\n".join(lines) + "\n"

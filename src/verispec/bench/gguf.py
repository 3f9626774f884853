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

import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from verispec.analysis.analytic import expected_speedup, optimal_k
from verispec.bench.peers import llamacpp_missing
from verispec.errors import UsageError
from verispec.models.gguf import cache_dir
from verispec.models.gguf_native import load_gguf, read_gguf
from verispec.models.gguf_write import TYPES, parse_shape, write_random_gguf

__all__ = ["FileBenchConfig", "FileResult", "bench_file", "random_file", "read_bandwidth", "write_report"]

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


@dataclass
class FileResult:
    """One file's measurements (seconds, bytes, GB/s); llama.cpp's are None where it did not run."""

    file: str
    file_bytes: int
    weight_bytes: int  # the matrices a decoding step reads: every layer's and the head's
    formats: str
    load_seconds: float
    rss_added: int
    decode_seconds: float
    bandwidth: float
    verify: list[float]  # v(1) .. v(max_k)
    prefill_tps: float
    llamacpp_decode_seconds: float | None = None
    llamacpp_prefill_tps: float | None = None
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
        path.parent.mkdir(parents=True, exist_ok=True)
        write_random_gguf(path, parsed, type_name)
    return path


def read_bandwidth(threads: int, gigabytes: float = 1.0) -> float:
    """This machine's read rate now, GB/s: the best of 5 sums over a float32 buffer far larger than caches."""
    buffer = torch.ones(int(gigabytes * 2**30 / 4))  # [n] float32
    torch.set_num_threads(threads)
    best = min(_timed(lambda: buffer.sum()) for _ in range(5))
    return buffer.numel() * 4 / best / 1e9


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _rss() -> int:
    """This process's resident memory, bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


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
    del reader
    gc.collect()
    torch.set_num_threads(config.threads)
    before, start = _rss(), time.perf_counter()
    model = load_gguf(path)
    load_seconds, rss_added = time.perf_counter() - start, _rss() - before
    vocab, capacity = model.vocab_size, config.context + max(config.max_k, config.prefill) + 16
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
    prompt = ids[:, : config.prefill]
    prefill = min(
        _timed(lambda: model(prompt, torch.arange(config.prefill)[None], model.new_cache(1, config.prefill)))
        for _ in range(3)
    )
    verify = [1.0] + [statistics.median(ratios[k]) for k in ratios]
    result = FileResult(
        file=str(path),
        file_bytes=path.stat().st_size,
        weight_bytes=weight_bytes,
        formats=model.cpu_precision or "",
        load_seconds=load_seconds,
        rss_added=rss_added,
        decode_seconds=statistics.median(singles),
        bandwidth=bandwidth,
        verify=verify,
        prefill_tps=config.prefill / prefill,
        llamacpp_decode_seconds=statistics.median(peer_singles) if peer_singles else None,
        llamacpp_prefill_tps=peer.prefill_tps(ids[0, : config.prefill].tolist()) if peer else None,
    )
    for alpha, c in PREDICTED:
        k = optimal_k(alpha, c, verify)
        speedup = expected_speedup(alpha, k, c, verify) if k else 1.0
        result.predicted.append({"alpha": alpha, "cost_ratio": c, "k": k, "speedup": speedup})
    return result


class _LlamaCpp:
    """llama.cpp (llama-cpp-python) on the file, default settings, logits of the last token only."""

    def __init__(self, path: Path, config: FileBenchConfig) -> None:
        import llama_cpp

        context = config.context + config.prefill + 16
        self.model = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=context,
            n_batch=context,
            n_threads=config.threads,
            n_threads_batch=config.threads,
            verbose=False,
        )
        self.context = config.context

    def decode(self, ids: list[int]) -> float:
        """Seconds to decode the last of ``ids`` after the others (evaluated once, then kept)."""
        if self.model.n_tokens < self.context:
            self.model.reset()
            self.model.eval(ids[:-1])
        self.model.n_tokens = self.context  # the next eval drops what came after
        return _timed(lambda: self.model.eval(ids[-1:]))

    def prefill_tps(self, ids: list[int]) -> float:
        def once() -> None:
            self.model.reset()
            self.model.eval(ids)

        return len(ids) / min(_timed(once) for _ in range(3))


def write_report(results: list[FileResult], config: FileBenchConfig, out: Path) -> Path:
    """results.json and results.md in ``out``; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    records = [asdict(r) | {"bound_seconds": r.bound_seconds} for r in results]
    (out / "results.json").write_text(json.dumps({"config": _jsonable(config), "files": records}, indent=2))
    (out / "results.md").write_text(report(results, config))
    return out


def _jsonable(config: FileBenchConfig) -> dict:
    return {k: [str(f) for f in v] if k == "files" else v for k, v in asdict(config).items()}


def report(results: list[FileResult], config: FileBenchConfig) -> str:
    """The tables of a run (markdown)."""
    lines = [
        f"GGUF files on the native kernels, {config.threads} threads, decoding after {config.context} "
        f"positions; medians of {config.repetitions} turns with llama.cpp.",
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
    lines += ["", "Verification cost v(k) = T(k) / T(1):", ""]
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
    lines += ["", f"Read rate measured in this run: {results[0].bandwidth:.1f} GB/s." if results else ""]
    return "\n".join(lines) + "\n"

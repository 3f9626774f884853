"""A GGUF file requantized by llama.cpp's own quantizer (``llama_model_quantize`` of llama-cpp-python, which
``make peers`` builds): how the bench makes SmolLM2's Q4_K_M, Q6_K, Q8_0 and Q4_0 files from the shipped Q4_1
one, and how a user makes a file of the formats people download from one they have.

Only file types whose tensors all have native kernels are offered (K-quants below 4 bits and the IQ types
write tensor types the kernels lack). Requantizing an already quantized file compounds two roundings: such a
file is for measuring speed and formats, not for quality; a real model's quantization starts from its float
weights. Light to import (the CLI's help lists the types). The output is written to a partial file beside
it and renamed into place when llama.cpp is done.
"""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

from verispec.errors import UsageError
from verispec.files import atomic_path, check_writable

__all__ = ["FILE_TYPES", "requantize_gguf"]

# llama.cpp's file types (LLAMA_FTYPE_MOSTLY_*) whose tensors all have native kernels; the mixed ones (_S, _M)
# keep some tensors in Q5_0, Q6_K or Q8_0, as llama.cpp chooses
FILE_TYPES = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "F16", "BF16",
)  # fmt: skip


def requantize_gguf(source: Path, path: str | Path, file_type: str, threads: int) -> Path:
    """Write ``source`` (a GGUF file) requantized to ``file_type`` (:data:`FILE_TYPES`) by llama.cpp's
    quantizer on ``threads`` threads, to ``path``, atomically. UsageError (one line) for a bad argument, an
    unreadable source or llama.cpp missing, before anything is written; or when llama.cpp fails."""
    if file_type not in FILE_TYPES:
        raise UsageError(f"--type with --from must be one of {', '.join(FILE_TYPES)}, got {file_type!r}")
    path = check_writable(path, ".gguf")
    if path.resolve() == source.resolve():
        raise UsageError(f"the output file must not be the source file ({source})")
    from verispec.models.gguf_native import read_gguf  # here: the CLI's help imports this module

    read_gguf(source)  # a one-line error for a file that is not GGUF, before llama.cpp reads it
    try:
        import llama_cpp
    except ImportError:
        raise UsageError(
            "requantizing needs llama.cpp's quantizer, not installed here (`make peers` builds "
            "llama-cpp-python into .venv, ~20 minutes)"
        ) from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = True  # the source may be quantized already (the shipped files are)
    params.nthread = threads
    print(f"verispec: requantizing {source} to {file_type} with llama.cpp's quantizer", file=sys.stderr)
    log: list[str] = []  # llama.cpp's log of the run (hundreds of lines), summed up below

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        log.append(text.decode("utf-8", "replace"))

    with atomic_path(path) as partial:
        llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
        try:
            status = llama_cpp.llama_model_quantize(
                str(source).encode(), str(partial).encode(), ctypes.byref(params)
            )
        finally:  # llama-cpp-python's own logger again
            from llama_cpp import _logger

            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
        if status:
            said = [line.strip() for line in "".join(log).splitlines() if "error" in line.lower()]
            raise UsageError(
                f"llama.cpp could not requantize {source} to {file_type}: {said[-1] if said else status}"
            )
    fallback = _fallback(log)
    if fallback:
        print(f"verispec: {fallback}", file=sys.stderr)
    return path


def _fallback(log: list[str]) -> str | None:
    """What llama.cpp's log says of tensors it wrote in another type than the file type's (a K-quant needs
    widths that are multiples of 256), in one line; None when it says nothing of them."""
    text = "".join(log)
    summary = re.search(r"(\d+) of (\d+) tensor\(s\) required fallback", text)
    if summary is None:
        return None
    types = sorted(set(re.findall(r"falling back to\s+(\S+)", text)))
    return (
        f"llama.cpp wrote {summary[1]} of {summary[2]} tensors in another type ({', '.join(types) or '?'}): "
        "a K-quant needs widths that are multiples of 256"
    )

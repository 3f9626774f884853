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
    path = check_writable(path)
    if path.suffix != ".gguf":
        raise UsageError(f"the output file must end in .gguf, got {path.name}")
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
    print(f"verispec: requantizing {source.name} to {file_type} with llama.cpp's quantizer", file=sys.stderr)
    with atomic_path(path) as partial:
        status = llama_cpp.llama_model_quantize(
            str(source).encode(), str(partial).encode(), ctypes.byref(params)
        )
        if status:
            raise UsageError(f"llama.cpp could not requantize {source} to {file_type} (its status {status})")
    return path

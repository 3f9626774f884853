"""GGUF files converted, once, into transformers-format directories in verispec's cache; their tokenizers
alone, for models that run the file in place (:mod:`verispec.models.gguf_native`).

A converted directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (every tensor
dequantized to float32, under the transformers parameter names, with llama.cpp's rotary q/k row permutation
undone), the tokenizer (``tokenizer.json``, ``tokenizer_config.json``), the chat template and
``verispec_source.json`` (the file it came from and the format of its weights, :func:`stored_format`). The
work is transformers' own GGUF reading code; verispec only checks that every parameter came through and
writes the result.

A conversion (or a tokenizer, :func:`gguf_tokenizer_dir`) is built in a hidden ``.NAME.partial-PID-*``
directory next to its target and renamed into place at the end, so the target directory either holds a
complete conversion or does not exist. Partial directories left by a process that died are removed by the
next conversion in the same cache. A tokenizer is extracted only from a file whose header reads whole
(:func:`~verispec.models.gguf_file.read_gguf`) and whose tokenizer metadata holds together: a file refused
leaves nothing in the cache.

The cache lives in ``$VERISPEC_CACHE/models`` (default ``~/.cache/verispec/models``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGUFReader
from safetensors.torch import save_file
from tqdm.auto import tqdm

from verispec.errors import UsageError
from verispec.inputs import is_int
from verispec.models.gguf_file import read_gguf

if TYPE_CHECKING:  # transformers is imported where a tokenizer or a conversion needs it: a second of every
    # process that loads a GGUF file natively and makes no tokenizer (bench-gguf's load measurements)
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

__all__ = [
    "cache_dir",
    "convert_gguf",
    "gguf_cache_path",
    "gguf_tokenizer",
    "gguf_tokenizer_dir",
    "is_converted",
    "source_gguf",
    "stored_format",
]

_PARTIAL = ".partial-"  # infix of the names of directories under construction
_SOURCE = "verispec_source.json"  # what a conversion was made from (and the file's weight format)
_TOKENIZER = "-tokenizer"  # suffix of a tokenizer's directory beside the conversion's (gguf_tokenizer_dir)
# what a saved tokenizer_config.json says of how to load it, not of the tokenizer (its added tokens: in the
# tokenizer.json the backend reads)
_LOADING_KEYS = (
    "tokenizer_class",
    "backend",
    "is_local",
    "local_files_only",
    "auto_map",
    "added_tokens_decoder",
)
# The chat format of an architecture whose files may lack their template (Gemma's turns, a system message
# put before the first user message's text) and its end-of-turn token, which then ends generation too.
_CHAT_FORMATS = {
    "gemma3": (
        "{{ bos_token }}{% set system = namespace(text='') %}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% set system.text = message['content'] | trim + '\n\n' %}"
        "{% else %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
        "{{ system.text if message['role'] == 'user' else '' }}{{ message['content'] | trim }}<end_of_turn>\n"
        "{% if message['role'] == 'user' %}{% set system.text = '' %}{% endif %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
        "<end_of_turn>",
    ),
}
# GGUF tensor types verispec's native kernels multiply as they are (verispec.kernels.cpu.FORMATS)
_NATIVE_TYPES = {"Q8_0": "q8_0", "Q4_1": "q4_1", "F16": "fp16"}


def cache_dir() -> Path:
    """Where converted models live: ``$VERISPEC_CACHE/models``, by default ``~/.cache/verispec/models``."""
    root = os.environ.get("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec"
    return Path(root).expanduser() / "models"


def gguf_cache_path(gguf: Path) -> Path:
    """The cache directory for the conversion of the GGUF file ``gguf``, keyed by its path, size and mtime."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / f"{gguf.stem}-{key}"


def is_converted(directory: Path) -> bool:
    """Whether ``directory`` holds a finished conversion (conversions appear by renaming, all at once)."""
    return (directory / "config.json").is_file()


def source_gguf(directory: Path) -> Path | None:
    """The GGUF file ``directory`` was converted from, where it still exists (a kept copy, or the file at
    its recorded path): what llama.cpp runs as a bench peer. None for other directories."""
    try:
        source = json.loads((Path(directory) / _SOURCE).read_text())
    except (OSError, ValueError):
        return None
    path = Path(directory) / str(source.get("gguf", "")) if isinstance(source, dict) else None
    return path if path is not None and path.suffix == ".gguf" and path.is_file() else None


def stored_format(directory: Path) -> str | None:
    """The native format (``q8_0``, ``q4_1``, ``fp16``) most of the weight matrices of the GGUF file that
    ``directory`` was converted from were stored in; None for other formats and other directories. Their
    values, dequantized to float32 in the conversion, requantize to the very same blocks."""
    try:
        source = json.loads((Path(directory) / _SOURCE).read_text())
    except (OSError, ValueError):
        return None
    value = source.get("weight_format") if isinstance(source, dict) else None
    return value if value in _NATIVE_TYPES.values() else None


def _weight_format(gguf: Path) -> str | None:
    """The native format of most of ``gguf``'s matrices (by count), None when that type has none."""
    reader = GGUFReader(gguf)
    types = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
    return _NATIVE_TYPES.get(types.most_common(1)[0][0]) if types else None


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Convert the GGUF file ``gguf`` into the transformers-format directory ``out_dir``, unless that is done.

    Returns ``out_dir``. UsageError (one line) when the file cannot be read or converted; nothing is left
    behind then."""
    if not is_converted(out_dir):
        _build(out_dir, is_converted, lambda partial: _write_transformers_dir(gguf, partial), gguf)
    return out_dir


def gguf_tokenizer_dir(gguf: Path) -> Path:
    """The tokenizer (and chat template) transformers converts from the GGUF file's metadata, saved once in
    the cache beside where its conversion would go (keyed the same way): later loads read these files.
    UsageError (one line) when the file is no readable GGUF file or has no tokenizer transformers reads,
    checked before anything is written: nothing is left behind then."""
    return _tokenizer_dir(gguf)[0]


def gguf_tokenizer(gguf: Path) -> tuple[PreTrainedTokenizerBase, Path]:
    """The tokenizer in :func:`gguf_tokenizer_dir` and that directory: the tokenizer this call built there,
    else read back (:func:`_read_tokenizer`)."""
    directory, built = _tokenizer_dir(gguf)
    if built is not None:
        return built, directory
    try:
        return _read_tokenizer(directory), directory
    except (ValueError, KeyError, OSError, TypeError) as err:  # a file of it damaged since it was saved
        raise UsageError(f"no usable tokenizer in {directory}: {first_line(err)}") from err


def _read_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer a :func:`gguf_tokenizer_dir` holds, read whole from its ``tokenizer.json`` by the
    tokenizers library, its special tokens and chat template from the files beside it: what
    ``PreTrainedTokenizerFast.from_pretrained`` makes of that directory (tested), without its second reading
    of ``tokenizer.json`` as JSON in Python for the added tokens (which the file's backend holds already):
    1.0 of its 2.5 s for Gemma 3's 262,144 tokens, at every start. (transformers' own class for the model
    would rebuild it from its vocabulary and merges in Python: seconds more.)"""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((directory / "tokenizer_config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError("tokenizer_config.json holds no object")
    for key in _LOADING_KEYS:
        config.pop(key, None)
    template = directory / "chat_template.jinja"
    if template.is_file():
        config["chat_template"] = template.read_text()
    try:
        return PreTrainedTokenizerFast(
            tokenizer_file=str(directory / "tokenizer.json"), name_or_path=str(directory), **config
        )
    except Exception as err:
        if type(err) is not Exception:
            raise
        raise ValueError(f"tokenizer.json: {err}") from err  # the tokenizers library's errors are bare


def _tokenizer_dir(gguf: Path) -> tuple[Path, PreTrainedTokenizerBase | None]:
    """:func:`gguf_tokenizer_dir`, and the tokenizer when this call built it (None: it was there)."""
    out_dir = gguf_cache_path(gguf)
    out_dir = out_dir.with_name(out_dir.name + _TOKENIZER)

    def done(directory: Path) -> bool:
        return (directory / "tokenizer_config.json").is_file()

    if done(out_dir):
        return out_dir, None
    header = read_gguf(gguf)  # a file refused leaves nothing in the cache
    problem = _tokenizer_problem(header.fields)
    if problem is not None:
        raise UsageError(f"no tokenizer in {gguf} that transformers reads: {problem}")
    built: list[PreTrainedTokenizerBase] = []

    def write(partial: Path) -> None:
        kind = _tokenizer_class(header.fields.get("general.architecture"))
        try:
            tokenizer = kind.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (ValueError, KeyError, IndexError, OSError, NotImplementedError, TypeError) as err:
            raise UsageError(f"no tokenizer in {gguf} that transformers reads: {first_line(err)}") from err
        arch = header.fields.get("general.architecture")
        if not tokenizer.chat_template and arch in _CHAT_FORMATS:  # a file without its template
            template, end_of_turn = _CHAT_FORMATS[arch]
            tokenizer.chat_template = template
            end = tokenizer.convert_tokens_to_ids(end_of_turn)
            if end is not None and end != tokenizer.unk_token_id:
                eos = [tokenizer.eos_token_id, end]
                (partial / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}) + "\n")
        tokenizer.save_pretrained(partial)
        built.append(tokenizer)

    _build(out_dir, done, write, gguf)
    return out_dir, (built[0] if built else None)


def _tokenizer_class(arch: object) -> Any:  # a tokenizer class, or AutoTokenizer: from_pretrained either way
    """The tokenizer class AutoTokenizer would pick for a GGUF file of architecture ``arch`` (its model
    type's: a Gemma 3 file's GemmaTokenizer; a Llama file's none, so the generic backend), found from the name
    alone: AutoTokenizer reads the file's whole metadata with gguf's reader to learn the model type, 10-20 s
    over Gemma 3's 262,144 tokens. AutoTokenizer itself for an architecture transformers does not map."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    if arch == "llama" or arch in TOKENIZER_MAPPING_NAMES:
        name = TOKENIZER_MAPPING_NAMES.get(str(arch)) or "TokenizersBackend"
        found = tokenizer_class_from_name(name)
        if found is not None:
            return found
    return AutoTokenizer


def _tokenizer_problem(fields: dict) -> str | None:
    """What keeps the tokenizer metadata ``fields`` of a GGUF header from making a tokenizer (no token list, a
    special token's id beyond it: transformers' reading fails on them, some with an IndexError), None when
    nothing does."""
    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        return "its metadata has no tokenizer.ggml.tokens"
    for key, value in fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            if not is_int(value) or value >= len(tokens):
                return f"{key} is {value!r}, not one of its {len(tokens)} tokens"
    return None


def _build(out_dir: Path, done: Callable[[Path], bool], write: Callable[[Path], None], gguf: Path) -> None:
    """Run ``write`` into a partial directory beside ``out_dir`` and rename it into place (see the module
    docstring); ``done``: whether a directory holds the finished result (a concurrent build's)."""
    if not gguf.is_file():
        raise UsageError(f"no such GGUF file: {gguf}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(out_dir)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}{_PARTIAL}{os.getpid()}-", dir=out_dir.parent))
    partial.chmod(0o755)  # mkdtemp's 0o700 would stay on the finished directory
    try:
        write(partial)
        try:
            os.replace(partial, out_dir)
        except OSError as err:
            if not done(out_dir):  # not a concurrent build that finished first
                raise UsageError(
                    f"{out_dir} is in the way: not a finished conversion ({first_line(err)})"
                ) from err
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # nothing left there after a successful rename


def _write_transformers_dir(gguf: Path, out: Path) -> None:
    """Read, dequantize and check every tensor of ``gguf``; write the transformers-format files to ``out``."""
    # transformers' modeling code takes seconds to import: only a conversion needs it
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    with tqdm(total=4, desc=f"Converting {name}", unit="step") as bar:
        try:
            bar.set_postfix_str("config")
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            bar.update()
            bar.set_postfix_str("weights")
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)  # parameter names only, no memory
            tensors = load_gguf_checkpoint(
                str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
            )["tensors"]
            bar.update()
            bar.set_postfix_str("tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            bar.update()
        except (ValueError, KeyError, OSError, NotImplementedError) as err:
            raise UsageError(f"cannot convert {gguf}: {first_line(err)}") from err
        # Tied parameters appear once in named_parameters(), under the name the checkpoint stores.
        missing = sorted(set(dict(skeleton.named_parameters())) - set(tensors))
        if missing:
            raise UsageError(f"{gguf} lacks {len(missing)} of the model's tensors, e.g. {missing[0]}")
        bad = next((key for key, tensor in tensors.items() if not np.isfinite(tensor.numpy()).all()), None)
        if bad is not None:
            raise UsageError(f"{gguf}: tensor {bad} holds non-finite values")
        bar.set_postfix_str("writing")
        config.architectures = [type(skeleton).__name__]
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
        tokenizer.save_pretrained(out)
        weights = out / "model.safetensors"
        save_file({k: t.contiguous() for k, t in tensors.items()}, weights, {"format": "pt"})
        weights.chmod(0o644)  # safetensors writes 0o600; the other files follow the umask
        source = {
            "gguf": str(gguf.resolve()),
            "bytes": gguf.stat().st_size,
            "weight_format": _weight_format(gguf),
        }
        (out / _SOURCE).write_text(json.dumps(source, indent=2) + "\n")
        bar.update()


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message (or its type's name), for one-line errors."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _remove_dead_partials(out_dir: Path) -> None:
    """Remove the partial conversions into ``out_dir`` whose process no longer runs."""
    prefix = f".{out_dir.name}{_PARTIAL}"
    for partial in out_dir.parent.glob(f"{prefix}*"):
        pid = partial.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _is_running(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def _is_running(pid: int) -> bool:
    """Whether a process with this id exists (always assumed on Windows, where os.kill would end it)."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True

"""Drafter data from offline text: ``verispec drafter-data --text SOURCE...``.

A forward over existing text gives the target's features and next-token distribution at every position — far
cheaper than having it write answers — so a data set of token ids alone is enough for a recipe that
recomputes both while it trains (:mod:`verispec.training.eagle3`: the target's states at three layers are
too large to store). The text must be offline and licensed for this use; each source names its licence:

- ``stdlib``: the docstrings of the installed Python standard library (PSF-2.0);
- ``PATH:LICENCE``: the files under PATH (a file or a directory, read in name order) under that licence —
  ``.py`` files by their docstrings, ``.md``, ``.rst`` and ``.txt`` files whole (this repository's docs:
  ``docs:Apache-2.0``; a package's own docs under its licence).

A document met before (the same text, in this source or an earlier one: packages copy docstrings from
model to model) is skipped and counted, so no text is trained on twice or both trained on and held out.
Each source's documents are tokenized in shards of :data:`SHARD_DOCUMENTS`, each shard's token stream (the
documents one after another, each ended by the target's end token) cut into windows of ``window`` tokens, one
sequence each (no prompt: every position counts), and written atomically to ``OUT/shards/``; a rerun with
the same settings continues from the shards written (other settings are refused). Then the windows are split
(a ``heldout_fraction`` held out, by seed) into ``train.safetensors`` / ``heldout.safetensors`` as
:mod:`verispec.training.data` writes them, without hidden states, and ``meta.json`` records every source, its
licence and its counts.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.errors import UsageError
from verispec.files import atomic_path, atomic_write
from verispec.inputs import check_int, check_seed
from verispec.training.data import target_sizes, write_dataset

__all__ = ["STDLIB", "TextConfig", "TextSource", "build_text_dataset"]

STDLIB = "stdlib"  # the built-in source: the standard library's docstrings
SHARD_DOCUMENTS = 512  # documents per shard
SUFFIXES = (".py", ".md", ".rst", ".txt")  # the files a directory source reads
_SETTINGS = "settings.json"  # in OUT/shards: what the shards were made with
_MIN_WINDOW = 2  # the shortest window kept (a position and the token after it)


@dataclass(frozen=True)
class TextSource:
    """One source of text: the standard library's docstrings, or the files under a path, with its licence."""

    name: str  # "stdlib" or the path as given
    licence: str
    path: Path | None  # None: the standard library

    @classmethod
    def parse(cls, spec: str) -> TextSource:
        """``stdlib`` or ``PATH:LICENCE`` (the licence after the last colon); UsageError, one line, for a
        path without a licence or one that does not exist."""
        if spec == STDLIB:
            return cls(STDLIB, "PSF-2.0", None)
        path, colon, licence = spec.rpartition(":")
        if not colon or not path or not licence.strip():
            raise UsageError(
                f"text source {spec!r}: give {STDLIB} or PATH:LICENCE (the licence the text may be used "
                "under, e.g. docs:Apache-2.0)"
            )
        where = Path(path).expanduser()
        if not where.exists():
            raise UsageError(f"text source {spec!r}: no such file or directory {where}")
        return cls(path, licence.strip(), where)

    @property
    def description(self) -> str:
        if self.path is None:
            return f"the docstrings of the Python {sysconfig.get_python_version()} standard library"
        return f"the {', '.join(SUFFIXES)} files under {self.path} (.py files: their docstrings)"

    def files(self) -> list[Path]:
        """The files the source reads, in name order."""
        if self.path is None:
            root = Path(sysconfig.get_paths()["stdlib"])
            return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
        if self.path.is_file():
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.suffix in SUFFIXES and p.is_file())

    def documents(self) -> Iterator[str]:
        """The source's documents: each docstring of a ``.py`` file (module, classes, functions), each other
        file whole; files that are not UTF-8 or do not parse are skipped."""
        for path in self.files():
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if path.suffix != ".py":
                if text.strip():
                    yield text
                continue
            yield from _docstrings(text)


def _docstrings(source: str) -> Iterator[str]:
    """The docstrings of a module's source (the module's, then its classes' and functions', in order)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and doc.strip():
                yield doc


@dataclass(frozen=True)
class TextConfig:
    """What :func:`build_text_dataset` makes; validated with UsageError."""

    sources: tuple[str, ...]  # each "stdlib" or "PATH:LICENCE"
    window: int = 512  # tokens per sequence
    heldout_fraction: float = 0.02
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.sources:
            raise UsageError(f"no text source: give {STDLIB} or PATH:LICENCE")
        for spec in self.sources:
            TextSource.parse(spec)
        if len(set(self.sources)) != len(self.sources):
            raise UsageError("a text source is given twice")
        check_int(self.window, "window", _MIN_WINDOW)
        check_seed(self.seed)
        if not 0 < self.heldout_fraction < 1:
            raise UsageError(f"heldout_fraction must lie in (0, 1), got {self.heldout_fraction!r}")

    def settings(self, target: str) -> dict:
        """What the shards depend on (a rerun must give the same)."""
        return {"target": target, "sources": list(self.sources), "window": self.window, "unique": True}


def _windows(documents: list[str], tokenizer, window: int) -> list[list[int]]:
    """The documents' tokens one after another, each ended by the end token, cut into windows of ``window``
    tokens (the last one kept when it has at least two)."""
    end = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
    stream: list[int] = []
    for text in documents:
        stream += tokenizer.encode(text, add_bos=False) + ([] if end is None else [end])
    cut = [stream[i : i + window] for i in range(0, len(stream), window)]
    return [w for w in cut if len(w) >= _MIN_WINDOW]


def _write_shard(path: Path, windows: list[list[int]], documents: int) -> None:
    """A shard's windows (``tokens``, ``offsets``) and its document count, written atomically."""
    from safetensors.torch import save_file

    lengths = torch.tensor([len(w) for w in windows], dtype=torch.long)
    tensors = {
        "tokens": torch.tensor([t for w in windows for t in w], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata={"documents": str(documents)})


def _read_shard(path: Path) -> tuple[list[list[int]], int]:
    """(windows, documents) of a shard; UsageError for one that cannot be read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tokens, offsets = f.get_tensor("tokens").tolist(), f.get_tensor("offsets").tolist()
            documents = int((f.metadata() or {}).get("documents", "0"))
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise UsageError(f"{path} is not a readable shard ({err}): remove it and run again") from None
    return [tokens[a:b] for a, b in zip(offsets, offsets[1:], strict=False)], documents


def _check_settings(shards: Path, settings: dict) -> None:
    """Record ``settings`` in ``shards``, or check that the shards already there were made with them."""
    path = shards / _SETTINGS
    if path.is_file():
        try:
            found = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UsageError(f"{path} is not readable JSON: {err}") from None
        changed = [k for k in settings if found.get(k) != settings[k]]
        if changed:
            k = changed[0]
            raise UsageError(
                f"{shards} holds shards made with {k} {found.get(k)!r}, not {settings[k]!r}: give the same "
                "settings to continue, or another --out"
            )
        return
    shards.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(settings, indent=2) + "\n")


class _Unique:
    """Documents not met before, in any source read through it (their digests kept); ``repeated`` counts the
    ones skipped."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self.repeated = 0

    def __call__(self, documents: Iterator[str]) -> Iterator[str]:
        for document in documents:
            digest = hashlib.blake2b(document.encode(), digest_size=16).digest()
            if digest in self.seen:
                self.repeated += 1
                continue
            self.seen.add(digest)
            yield document


def _chunks(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    """``documents`` in lists of ``size`` (the last one shorter)."""
    chunk: list[str] = []
    for document in documents:
        chunk.append(document)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def build_text_dataset(target: str, out: str | Path, config: TextConfig) -> dict:
    """The data set of token windows of ``config.sources`` for ``target`` (a model SPEC: its tokenizer and
    sizes) in directory ``out`` (module docstring); returns its meta data. Resumes from the shards of an
    earlier run with the same settings."""
    from verispec.models.registry import load_model

    started = time.perf_counter()
    out = Path(out)
    shards = out / "shards"
    _check_settings(shards, config.settings(target))
    model, tokenizer = load_model(target, precision="auto")  # as generate runs it
    sources = [TextSource.parse(spec) for spec in config.sources]
    windows: list[list[int]] = []
    recorded = []
    unique = _Unique()  # across every source
    for number, source in enumerate(sources):
        count, documents, tokens, repeated_before = 0, 0, 0, unique.repeated
        bar = tqdm(desc=f"text {source.name}", unit="shard", disable=not config.progress)
        for index, chunk in enumerate(_chunks(unique(source.documents()), SHARD_DOCUMENTS)):
            path = shards / f"{number:02d}-{index:05d}.safetensors"
            if not path.is_file():
                _write_shard(path, _windows(chunk, tokenizer, config.window), len(chunk))
            found, read = _read_shard(path)
            windows += found
            count, documents, tokens = count + 1, documents + read, tokens + sum(map(len, found))
            bar.update(1)
        bar.close()
        if not documents:
            raise UsageError(f"text source {source.name!r} holds no document ({', '.join(SUFFIXES)} files)")
        recorded.append(
            {**asdict(source), "path": None if source.path is None else str(source.path)}
            | {"description": source.description, "documents": documents}
            | {"repeated": unique.repeated - repeated_before, "tokens": tokens, "shards": count}
        )
    order = list(range(len(windows)))
    random.Random(config.seed).shuffle(order)
    held = set(order[: max(1, round(config.heldout_fraction * len(order)))])
    splits: dict[str, list] = {"train": [], "heldout": []}
    for i, window in enumerate(windows):
        splits["heldout" if i in held else "train"].append((window, 0, None))
    meta = {
        "target": str(target),
        **target_sizes(model),
        "text": {
            "sources": recorded,
            "window": config.window,
            "heldout_fraction": config.heldout_fraction,
            "seed": config.seed,
        },
    }
    return write_dataset(out, splits, meta, started)

"""A suffix cache kept in a file across runs (``--suffix-cache FILE``, ``--suffix-budget N`` of ``generate``,
``batch`` and ``serve``): the choice checked before any model loads, the cache loaded at start and saved,
atomically, at exit.

The check (:func:`check_suffix_choice`) refuses, in one line each: a budget that is not an integer >= 1, a
drafter whose kind shares no cache across requests (naming those that do), a path where no file can be
written, and a file that exists but is not a suffix cache (read, not indexed). The tokenizer the file was
saved for is checked when the cache loads (:func:`open_suffix_cache`), once the target's tokenizer is known
and before anything is generated or written: a file is never saved over unless it loaded.

A server's tenants (one per API key) keep a file each in a private directory beside ``FILE``
(:mod:`verispec.server.tenants`); a server without keys, or sharing one cache (``--share-suffix-cache``),
keeps ``FILE``.
"""

from __future__ import annotations

from pathlib import Path

from verispec.drafting.registry import DRAFTERS, drafter_names
from verispec.drafting.suffix_cache import DEFAULT_BUDGET, SuffixCache
from verispec.errors import UsageError
from verispec.files import check_writable
from verispec.inputs import check_int

__all__ = ["check_file", "check_suffix_choice", "open_suffix_cache"]


def check_suffix_choice(drafter: str, path: str | None, budget: int | None) -> None:
    """UsageError (one line) unless a suffix cache file ``path`` and ``budget`` (None: not given) suit
    ``drafter`` (module docstring), before any model loads."""
    if path is None and budget is None:
        return
    kind = DRAFTERS.get(drafter)
    if kind is None or not kind.shared_cache:
        flag = "--suffix-cache" if path is not None else "--suffix-budget"
        shared = drafter_names(lambda k: k.shared_cache)
        raise UsageError(f"{flag} keeps the cache of a drafter that shares one across requests: give "
                         f"--drafter {shared} (not {drafter})")  # fmt: skip
    if budget is not None:
        check_int(budget, "--suffix-budget", 1, hint=" (tokens)")
    if path is not None:
        check_file(Path(path))


def check_file(path: Path) -> None:
    """UsageError unless a cache can be saved at ``path`` and what is there already (if anything) is one."""
    check_writable(path)
    if path.exists():
        SuffixCache.check(path)


def open_suffix_cache(path: str | Path | None, budget: int | None, vocabulary: str) -> SuffixCache:
    """The cache saved at ``path`` when it exists (for the tokenizer ``vocabulary``, else a UsageError), with
    ``budget`` (None: the saved one); else an empty cache of ``budget`` (None: the default)."""
    if path is not None and Path(path).exists():
        return SuffixCache.load(path, budget, vocabulary=vocabulary)
    return SuffixCache(DEFAULT_BUDGET if budget is None else budget, vocabulary=vocabulary)

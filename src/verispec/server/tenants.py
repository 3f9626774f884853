"""The server's suffix caches, one per tenant: a suffix drafter's request drafts from its tenant's cache of
earlier outputs, never from another tenant's (what a cache holds never changes an output's distribution, but
a request resembling earlier outputs finishes faster: a timing side channel, closed by keeping tenants
apart).

A tenant is an API key (``--api-key``, repeatable), known by a hash of it (:func:`tenant_id`), never by the
key. A server without a key, or told to share (``--share-suffix-cache``), has one tenant and one cache. With
``--suffix-cache FILE``, each tenant's cache loads from its file at start and is saved there at shutdown
(:func:`~verispec.drafting.suffix_files.tenant_path`: ``FILE.<id>.npz``; ``FILE`` for the one shared cache).
Every cache is thread-safe (its own lock): the scheduler's thread drafts from it and adds to it while
requests are submitted from others. /metrics shows their sum (no label per tenant: a bounded label set,
and nothing said of one tenant's use).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from verispec.drafting.suffix_cache import SuffixCache
from verispec.drafting.suffix_files import check_file, open_suffix_cache, tenant_id, tenant_path

__all__ = ["SHARED", "SuffixTenants"]

SHARED = "shared"  # the one tenant of a server without keys or sharing its cache


class SuffixTenants:
    """The suffix caches of a server's tenants. keys: the API keys (each a tenant unless ``share``); path:
    the file the caches are kept in (None: memory only); budget: each cache's tokens (None: the saved one,
    else the default)."""

    def __init__(self, keys: Sequence[str], share: bool, path: str | None, budget: int | None) -> None:
        self._ids = {} if share else {key: tenant_id(key) for key in keys}
        tenants = sorted(set(self._ids.values())) or [SHARED]
        self.path, self.budget = path, budget
        self.files: dict[str, Path | None] = {
            tenant: None if path is None else Path(path) if tenant == SHARED else tenant_path(path, tenant)
            for tenant in tenants
        }
        self.caches: dict[str, SuffixCache] = {}

    def check(self) -> None:
        """UsageError unless every tenant's file can be written and, where it exists, is a cache."""
        for file in self.files.values():
            if file is not None:
                check_file(file)

    def open(self, vocabulary: str) -> None:
        """Load every tenant's cache (from its file where it exists) for the tokenizer ``vocabulary``."""
        for tenant, file in self.files.items():
            self.caches[tenant] = open_suffix_cache(file, self.budget, vocabulary)

    def cache(self, key: str | None) -> SuffixCache:
        """The cache of the tenant whose key a request gave (``None``: no key, the shared cache)."""
        return self.caches[self._ids.get(key, SHARED) if key is not None else SHARED]

    def save(self) -> None:
        """Save every tenant's cache to its file (atomically), where it has one."""
        for tenant, cache in self.caches.items():
            file = self.files[tenant]
            if file is not None:
                cache.save(file)

    def stats(self) -> dict[str, int]:
        """The caches' :meth:`~verispec.drafting.suffix_cache.SuffixCache.stats` summed, and their count."""
        total = {"caches": len(self.caches), "tokens": 0, "sequences": 0, "evictions": 0, "budget": 0}
        for cache in list(self.caches.values()):
            for name, value in cache.stats().items():
                total[name] += value
        return total

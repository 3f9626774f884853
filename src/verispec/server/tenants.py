"""The server's suffix caches, one per tenant: a suffix drafter's request drafts from its tenant's cache of
earlier outputs, never from another tenant's (what a cache holds never changes an output's distribution, but
a request resembling earlier outputs finishes faster: a timing side channel, closed by keeping tenants
apart).

A tenant is an API key (``--api-key``, repeatable), known by its id (:func:`tenant_id`): an HMAC of the key
under a secret salt, never the key, and never a hash anyone can compute from a guessed key. A server without
a key, or told to share (``--share-suffix-cache``), has one tenant and one cache. With ``--suffix-cache
FILE``, each cache loads from its file at start and is saved there at shutdown: the one shared cache in
``FILE``, the tenants' in their own directory ``FILE.tenants/`` (:func:`tenants_dir`), made with mode 0o700:
the salt, made once and kept in ``salt`` (:func:`installation_salt`, 0o600), and each tenant's ``<id>.npz``
(0o600; what it holds is that tenant's outputs). Nobody but the server's user can list, read or replace them;
the salt makes the ids of a later server the same. Without a file, the ids are keyed by a salt of this
process alone. Every cache is thread-safe (its own lock): the scheduler's thread drafts from it and adds to
it while requests are submitted from others. The server shows no tenant's figures, nor their sum, in
/metrics (:mod:`verispec.server.metrics`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from verispec.drafting.suffix_cache import SuffixCache
from verispec.drafting.suffix_files import check_file, open_suffix_cache
from verispec.errors import UsageError
from verispec.files import atomic_write, check_writable

__all__ = ["SHARED", "SuffixTenants", "installation_salt", "tenant_id", "tenants_dir"]

SHARED = "shared"  # the one tenant of a server without keys or sharing its cache
SALT = "salt"  # the file of the tenants' directory that holds the salt of their ids
SALT_BYTES = 32
SECRET = 0o600  # a tenant's file and the salt: the server's user's alone
PRIVATE = 0o700  # the tenants' directory


def tenants_dir(path: str | Path) -> Path:
    """The directory of the tenants' caches kept beside ``path`` (``--suffix-cache``): ``FILE.tenants``."""
    path = Path(path)
    return path.with_name(f"{path.name}.tenants")


def tenant_id(key: str, salt: bytes) -> str:
    """A tenant's id: the HMAC-SHA256 of its API key under ``salt`` (32 hex digits), which file names and
    logs may show."""
    return hmac.new(salt, key.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:32]


def _read_salt(directory: Path) -> bytes | None:
    """The salt kept in ``directory``, None where there is none yet; UsageError for a file that is not one."""
    file = directory / SALT
    try:
        salt = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise UsageError(f"cannot read {file}: {err.strerror or err}") from None
    if len(salt) != SALT_BYTES:
        raise UsageError(f"{file} is not a salt of {SALT_BYTES} bytes (delete it: the tenants' caches "
                         "then start empty)")  # fmt: skip
    return salt


def installation_salt(directory: Path) -> bytes:
    """The salt of the tenants' ids kept in ``directory``, made (mode 0o600, the directory 0o700) the first
    time; the directory's mode set to 0o700 if it was another."""
    try:
        directory.mkdir(mode=PRIVATE, exist_ok=True)
        os.chmod(directory, PRIVATE)  # mkdir's mode less the umask, or an older directory's
    except OSError as err:
        raise UsageError(f"cannot make {directory} private: {err.strerror or err}") from None
    salt = _read_salt(directory)
    if salt is None:
        salt = secrets.token_bytes(SALT_BYTES)
        atomic_write(directory / SALT, salt, mode=SECRET)
    return salt


class SuffixTenants:
    """The suffix caches of a server's tenants. keys: the API keys (each a tenant unless ``share``); path:
    the file the caches are kept beside (None: memory only); budget: each cache's tokens (None: the saved
    one, else the default)."""

    def __init__(self, keys: Sequence[str], share: bool, path: str | None, budget: int | None) -> None:
        self.keys = () if share else tuple(dict.fromkeys(keys))
        self.path = None if path is None else Path(path)
        self.budget = budget
        self.files: dict[str, Path | None] = {}  # tenant → its file (None: memory only), once opened
        self.caches: dict[str, SuffixCache] = {}  # tenant → its cache, once opened
        self._ids: dict[str, str] = {}  # key → tenant

    @property
    def directory(self) -> Path | None:
        """The tenants' directory: where there are tenants (keys, not shared) and a file, else None."""
        return tenants_dir(self.path) if self.keys and self.path is not None else None

    def check(self) -> None:
        """UsageError unless every cache can be saved and what its file holds, where it exists, is a cache
        (before a model loads: nothing is made)."""
        directory = self.directory
        if self.path is None:
            return
        if directory is None:
            check_file(self.path)
        elif not directory.exists():
            check_writable(directory)  # its parent takes a new directory
        else:
            check_writable(directory / SALT)
            salt = _read_salt(directory)
            for key in self.keys:
                if salt is not None:  # without one, no file there is a tenant's yet
                    check_file(directory / f"{tenant_id(key, salt)}.npz")

    def open(self, vocabulary: str) -> None:
        """Load every tenant's cache (from its file where it exists) for the tokenizer ``vocabulary``."""
        directory = self.directory
        salt = secrets.token_bytes(SALT_BYTES) if directory is None else installation_salt(directory)
        self._ids = {key: tenant_id(key, salt) for key in self.keys}
        for tenant in sorted(set(self._ids.values())) or [SHARED]:
            file = self.path if directory is None else directory / f"{tenant}.npz"
            self.files[tenant] = file
            self.caches[tenant] = open_suffix_cache(file, self.budget, vocabulary)

    def tenant(self, key: str | None) -> str:
        """The tenant of a request that gave ``key`` (``None``: no key, the shared cache's)."""
        return self._ids.get(key, SHARED) if key is not None else SHARED

    def cache(self, key: str | None) -> SuffixCache:
        """The cache of the tenant whose key a request gave (``None``: no key, the shared cache)."""
        return self.caches[self.tenant(key)]

    def save(self) -> None:
        """Save every tenant's cache to its file (atomically; a tenant's readable by the server's user
        alone), where it has one."""
        for tenant, cache in self.caches.items():
            file = self.files[tenant]
            if file is not None:
                cache.save(file, mode=None if tenant == SHARED else SECRET)

    def stats(self) -> dict[str, int]:
        """The caches' :meth:`~verispec.drafting.suffix_cache.SuffixCache.stats` summed, and their count."""
        total = {"caches": len(self.caches), "tokens": 0, "sequences": 0, "evictions": 0, "budget": 0}
        for cache in list(self.caches.values()):
            for name, value in cache.stats().items():
                total[name] += value
        return total

"""What ``verispec serve`` serves, as one frozen, validated :class:`ServerConfig`: light to import (no torch,
no transformers), so that the command line refuses a bad flag before anything loads."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from verispec.choice import ModelChoice
from verispec.drafting.registry import DRAFTERS, drafter_names
from verispec.errors import UsageError
from verispec.inputs import check_int
from verispec.options import DEFAULT_K, DraftLength
from verispec.server.tenants import SuffixTenants

__all__ = [
    "MAX_REPLICAS",
    "MMAP_THRESHOLD",
    "RayDeployment",
    "ServerConfig",
    "exposed",
    "listen",
    "return_large_frees",
]

MAX_REPLICAS = 1024  # replicas of one server on Ray Serve (beyond any cluster here)


@dataclass(frozen=True, kw_only=True)
class ServerConfig(ModelChoice):
    """What ``verispec serve`` serves (the models and drafter, then these); validated with UsageError."""

    k: DraftLength = DEFAULT_K  # the K of requests that do not name one (its text parsed on construction)
    max_batch: int = 8
    max_queue: int = 64
    api_key: str | tuple[str, ...] | None = None  # a key, or several: each a tenant (its own suffix cache)
    allow_drafters: tuple[str, ...] = ()  # drafters requests may choose besides the server's own
    share_suffix_cache: bool = False  # one suffix cache for every tenant (server/tenants.py)
    model_name: str | None = None  # the model id clients name (default: the target's name)
    max_connections: int = 512  # open connections; beyond, the oldest idle one closes (or the new one)
    keep_alive: float = 5.0  # seconds an idle keep-alive connection stays open
    header_timeout: float = 10.0  # seconds for a request's headers to arrive
    body_timeout: float = 30.0  # seconds for a request's body to arrive
    max_body: int = 4 << 20  # bytes of a request's body

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("max_batch", 1), ("max_queue", 0), ("max_connections", 1), ("max_body", 1)):
            value = getattr(self, name)
            check_int(value, name.replace("_", "-"), low)
        for name in ("keep_alive", "header_timeout", "body_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
                raise UsageError(f"{name.replace('_', '-')} must be seconds in (0, 86400], got {value!r}")
        object.__setattr__(self, "k", DraftLength.parse(self.k))
        if any(not key.strip() for key in self.api_keys) or self.api_key == ():
            raise UsageError("the API key is empty")
        for name in self.allow_drafters:
            kind = DRAFTERS.get(name)
            if kind is None or (kind.needs_draft_model and name != self.drafter):
                choices = drafter_names(lambda kind: not kind.needs_draft_model)
                raise UsageError(
                    f"--allow-drafters: {name[:40]!r} cannot be chosen by requests; choose from {choices} "
                    "(one with a draft model: only as the server's own)"
                )
        self.tenants().check()

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys a request may give (none: every request is served)."""
        return (self.api_key,) if isinstance(self.api_key, str) else self.api_key or ()

    def tenants(self) -> SuffixTenants:
        """The suffix caches of the tenants that the keys and ``share_suffix_cache`` make, not yet loaded."""
        return SuffixTenants(
            self.api_keys, self.share_suffix_cache, self.suffix_cache_file, self.suffix_budget
        )

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        return Path(self.target).stem if Path(self.target).suffix else self.target


@dataclass(frozen=True, kw_only=True)
class RayDeployment:
    """``verispec serve --ray``: how many replicas of the server, on which Ray (``address``: a cluster's,
    ``auto`` or HOST:PORT; None: a Ray started here), with how many threads each (None: the cluster's CPUs
    shared out); validated with UsageError."""

    replicas: int = 1
    address: str | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        check_int(self.replicas, "--replicas", 1, MAX_REPLICAS)
        if self.address is not None and not self.address.strip():
            raise UsageError("--address is empty (auto, or the head's HOST:PORT)")


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), the stdlib's (no torch); UsageError when it
    cannot be had."""
    if not 0 <= port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        raise UsageError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as err:  # its message names the address again: the errno's words alone
        raise UsageError(f"cannot listen on {host}:{port}: {os.strerror(err.errno or 0)}") from None


def exposed(address: str) -> bool:
    """Whether a bound ``address`` (an IP) takes connections from other machines: anything but loopback."""
    return not ipaddress.ip_address(address.split("%")[0]).is_loopback


# blocks of at least this many bytes come from mmap and go back to the system when freed (glibc's mallopt)
MMAP_THRESHOLD = 4 * 1024 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def return_large_frees() -> bool:
    """A server's large short-lived buffers (a forced run's logits, 65 rows of the vocabulary: 12.6 MB for
    SmolLM2) given back to the system as they are freed: glibc raises its mmap threshold to the largest block
    freed so far (up to 32 MB), after which such blocks come from, and stay in, each thread's arena (measured
    on a 2,500-word ``const``: the server's memory +160 to +185 MB, +118 with the threshold held at
    :data:`MMAP_THRESHOLD` (docs/bench/hostile-2026-12-07); decoding's speed unchanged within the noise of
    library runs in turns). Smaller blocks keep the arena's fast reuse. Returns whether the C library took it
    (glibc's ``mallopt``; elsewhere nothing changes)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))

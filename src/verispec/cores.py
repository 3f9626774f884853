"""How many threads a command's models use: ``--threads N``, else the cores this process may actually use.

torch's own default is the CPUs of the process's affinity mask (``taskset``, a container's cpuset), but not a
container's CPU quota (cgroups' ``cpu.max``, ``cpu.cfs_quota_us``): a container limited to 2 CPUs on a 64-core
host would run 64 threads in 2 CPUs' time, each parallel loop waiting for threads that are not running. So
the default is the smaller of the affinity mask and the quota rounded up, unless ``OMP_NUM_THREADS`` says
otherwise. It is applied before torch loads (through ``OMP_NUM_THREADS``, which torch and the children a
command starts — a server, Ray workers — read), so that checking a command's arguments never loads torch;
where torch is already loaded (a command run in-process), ``--threads`` sets its count directly and the
default leaves it as it is. (torch reads no more threads from OMP_NUM_THREADS than the machine has cores.)
Light to import: no torch.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from verispec.inputs import check_int

__all__ = ["MAX_THREADS", "available_cores", "cgroup_quota", "use_threads"]

_CGROUP = Path("/sys/fs/cgroup")
MAX_THREADS = 1024  # the most threads a command takes: beyond any machine's cores here, within a C int


def cgroup_quota(root: Path = _CGROUP) -> float | None:
    """The CPUs this process's cgroup may use per unit of time (cgroup v2 ``cpu.max``, or v1's quota over
    its period), None where there is no limit or no cgroup file."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cores(root: Path = _CGROUP) -> int:
    """The cores this process may use: its affinity mask, capped by its cgroup's CPU quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_quota(root)
    return max(1, min(cores, math.ceil(quota))) if quota else max(1, cores)


def use_threads(threads: int | None) -> None:
    """A command's models use ``threads`` threads (None: :func:`available_cores`, unless OMP_NUM_THREADS is
    set); UsageError for a count below 1 (module docstring)."""
    if threads is not None:
        check_int(threads, "--threads", 1, MAX_THREADS)
    if "torch" in sys.modules:
        if threads is not None:
            sys.modules["torch"].set_num_threads(threads)
        return
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(available_cores()))

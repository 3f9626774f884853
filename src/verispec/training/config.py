"""How a learned drafter is trained: :class:`TrainConfig`, light to import (no torch) so that the command
line declares its flags from the defaults (the training itself: :mod:`verispec.training.train`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from verispec.drafting.registry import DRAFTERS, EAGLE
from verispec.errors import UsageError
from verispec.inputs import check_seed

__all__ = ["CE_TARGETS", "KINDS", "THROUGH_TARGET", "TrainConfig"]

KINDS = tuple(name for name, kind in DRAFTERS.items() if kind.trained is not None)  # trained kinds
# kinds trained through the target's own layers (their gradient flows through it): on its float32 weights,
# whatever precision it otherwise runs in, since the native kernels compute no gradients
THROUGH_TARGET = frozenset(
    name for name, kind in DRAFTERS.items() if kind.trained is not None and kind.trained.through_target
)
CE_TARGETS = ("token", "distribution")  # the target's next token, or its distribution on the draft vocabulary


@dataclass(frozen=True)
class TrainConfig:
    """How a drafter is trained (see :mod:`verispec.training.train`); validated with UsageError."""

    kind: str = EAGLE
    steps: int = 2000
    batch_tokens: int = 2048
    window: int = 256
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    draft_vocab: int = 8192
    ce_weight: float = 0.1
    ce_target: str = "token"
    noise: float = 0.05
    unroll: int = 1
    grad_clip: float = 0.5
    eval_every: int = 50
    eval_tokens: int = 4096
    checkpoint_every: int = 50
    seed: int = 0
    # a drafter file to start from (fine-tuning on new data), its draft vocabulary kept; "": none
    init: str = ""
    layers: int = 1  # decoder layers of the head (more than init's: the new ones start as no-ops)
    heads: int = 4  # Medusa heads
    exit_layer: int = 8  # the layer a trained exit reads
    lookahead: int = 3  # lookahead tokens

    def __post_init__(self) -> None:
        from verispec.drafting.learned.eagle import MAX_LAYERS
        from verispec.drafting.learned.lookahead import MAX_LOOKAHEAD
        from verispec.drafting.learned.medusa import MAX_HEADS

        if not isinstance(self.init, str):
            raise UsageError(f"init must be a drafter file path (a string), got {self.init!r}")
        if self.kind not in KINDS:
            raise UsageError(f"unknown drafter kind {self.kind!r}; verispec trains {', '.join(KINDS)}")
        if self.ce_target not in CE_TARGETS:
            raise UsageError(f"ce_target must be one of {', '.join(CE_TARGETS)}, got {self.ce_target!r}")
        for name in (
            "steps",
            "batch_tokens",
            "window",
            "draft_vocab",
            "eval_every",
            "eval_tokens",
            "checkpoint_every",
        ):
            _check(name, getattr(self, name), int, 1)
        for name in ("warmup", "unroll"):
            _check(name, getattr(self, name), int, 0)
        check_seed(self.seed)
        for name, high in (("layers", MAX_LAYERS), ("heads", MAX_HEADS), ("lookahead", MAX_LOOKAHEAD)):
            _check(name, getattr(self, name), int, 1)
            if getattr(self, name) > high:
                raise UsageError(f"{name} must be at most {high}, got {getattr(self, name)!r}")
        _check("exit_layer", self.exit_layer, int, 1)
        if self.init and self.kind != EAGLE:
            raise UsageError(f"init (fine-tuning a trained drafter) is for eagle heads, not {self.kind}")
        if self.batch_tokens < self.window:
            raise UsageError(f"batch_tokens ({self.batch_tokens}) must be at least window ({self.window})")
        for name in ("weight_decay", "ce_weight", "noise"):
            _check(name, getattr(self, name), float, 0)
        for name in ("lr", "grad_clip"):
            _check(name, getattr(self, name), float, 0)
            if getattr(self, name) == 0:
                raise UsageError(f"{name} must be > 0, got {getattr(self, name)!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based): linear warmup, then cosine decay to 10 %."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def _check(name: str, value: object, kind: type, low: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float) if kind is float else int)
        or not math.isfinite(value)
        or value < low
    ):
        what = "an integer" if kind is int else "a number"
        raise UsageError(f"{name} must be {what} >= {low}, got {value!r}")

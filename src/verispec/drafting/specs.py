"""How a drafter choice is spelled where no model is needed to read it: the draft SPECs that name the target's
own weights (``layers:N``, an early exit; ``self:PRECISION`` and ``layers:N:PRECISION``, a self-draft) and the
algorithms a draft of another tokenizer drafts with (``--cross-tokenizer``). Light (no torch): the registry
checks a choice with them, and the drafters that read them (:mod:`verispec.drafting.draft_model`,
:mod:`verispec.drafting.cross_tokenizer`) import them from here, not from the registry that builds them.
"""

from __future__ import annotations

from verispec.errors import UsageError

__all__ = ["CROSS_TOKENIZER", "EARLY_EXIT", "SELF", "check_algorithm", "early_exit_layers", "self_draft"]

CROSS_TOKENIZER = ("auto", "tli", "string")  # how a draft of another tokenizer drafts (--cross-tokenizer)
EARLY_EXIT = "layers:"  # the draft SPEC of an early exit: ``layers:N``, the target's own first N layers
SELF = "self:"  # the draft SPEC of the target's own weights in a lower precision: ``self:PRECISION``


def early_exit_layers(spec: str) -> int | None:
    """N for the draft SPEC ``layers:N`` (an early exit: the target's first N layers, sharing its cache),
    None for any other SPEC (``layers:N:PRECISION`` included: see :func:`self_draft`); UsageError when the
    count is not an integer."""
    if not spec.startswith(EARLY_EXIT) or spec.count(":") > 1:
        return None
    count = spec[len(EARLY_EXIT) :]
    if not count.isdigit():
        raise UsageError(f"an early-exit draft is written {EARLY_EXIT}N with N an integer, got {spec!r}")
    return int(count)


def self_draft(spec: str) -> tuple[int | None, str] | None:
    """(N or None, PRECISION) for a draft SPEC of the target's own weights packed again in a lower
    precision: ``self:PRECISION`` (every layer) or ``layers:N:PRECISION`` (the first N, an early exit with a
    cache of its own); None for any other SPEC; UsageError for a malformed one."""
    if spec.startswith(SELF):
        return None, spec[len(SELF) :]
    if not spec.startswith(EARLY_EXIT) or spec.count(":") != 2:
        return None
    _, count, precision = spec.split(":")
    if not count.isdigit():
        raise UsageError(f"a self-draft is written {EARLY_EXIT}N:PRECISION with N an integer, got {spec!r}")
    return int(count), precision


def check_algorithm(name: str) -> None:
    """UsageError, one line, unless ``name`` is one of :data:`CROSS_TOKENIZER`."""
    if name not in CROSS_TOKENIZER:
        raise UsageError(f"cross-tokenizer must be one of {', '.join(CROSS_TOKENIZER)}, got {name!r}")

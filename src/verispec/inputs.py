"""Untrusted input, checked at the doors (the server's bodies, ``verispec batch``'s lines, prompts), so that a
hostile value is a caller's mistake in one line (:class:`~verispec.errors.UsageError`), never a traceback
from deep inside: JSON text (:func:`parse_json`: nesting too deep for the parser, an integer too long to
convert) and text that is not valid Unicode (:func:`check_text`: a lone surrogate, which JSON's ``\\ud800``
escapes can carry and no tokenizer encodes); and :func:`is_int`, the one test of an integer argument (a bool
is not one), :func:`check_int`, the one check of an integer in a range, and :func:`check_seed`, of a seed;
:func:`did_you_mean`, the hint after a name not known."""

from __future__ import annotations

import difflib
import json
import numbers
from collections.abc import Iterable
from typing import Any, TypeGuard

from verispec.errors import UsageError

__all__ = ["check_int", "check_prompt", "check_seed", "check_text", "did_you_mean", "is_int", "parse_json"]


def is_int(value: object, *, integral: bool = False) -> TypeGuard[int]:
    """Whether ``value`` is an integer: an ``int`` and not a bool (``True`` is an int to Python, never a
    count to verispec); ``integral``: any ``numbers.Integral`` (NumPy's integers too), bools still not."""
    kind = numbers.Integral if integral else int
    return isinstance(value, kind) and not isinstance(value, bool)


def check_int(
    value: object, name: str, low: int = 0, high: int | None = None, *, integral: bool = False, hint: str = ""
) -> int:
    """``value`` when it is an integer (:func:`is_int`; ``integral``: NumPy's too) in [``low``, ``high``]
    (``high`` None: no bound above); else UsageError "NAME must be an integer >= LOW (HINT), got VALUE" (or
    "in [LOW, HIGH]"), the one wording of every such check."""
    if is_int(value, integral=integral) and value >= low and (high is None or value <= high):
        return value
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise UsageError(f"{name} must be an integer {bound}{hint}, got {value!r}")


def check_seed(value: object, name: str = "seed", below: int = 2**63) -> None:
    """UsageError unless ``value`` is a seed: an integer in [0, ``below``); ``below`` a power of two, 2**63
    (what torch and NumPy take) or less where seeds derived from it are offset above it."""
    if not is_int(value) or not 0 <= value < below:
        raise UsageError(f"{name} must be an integer in [0, 2**{below.bit_length() - 1}), got {value!r}")


def did_you_mean(given: str, known: Iterable[str]) -> str:
    """The hint after a name not known, ``" (did you mean X?)"``: X the name of ``known`` closest to ``given``
    (an unknown flag, drafter or model; underscores read as dashes, a name that ``given`` begins or that
    begins with it first); "" when none is close."""
    names = list(known)
    plain = given.replace("_", "-")
    starts = [
        n for n in names if plain != n and len(plain) > 2 and (n.startswith(plain) or plain.startswith(n))
    ]
    close = starts[:1] or difflib.get_close_matches(plain, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def parse_json(text: str | bytes) -> Any:
    """The value of the JSON ``text``; UsageError "not JSON (why)" in one line otherwise."""
    try:
        return json.loads(text)
    except RecursionError:
        raise UsageError("not JSON (nested too deeply)") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"not JSON ({err})") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"not JSON (not UTF-8: {err.reason} at byte {err.start})") from None
    except ValueError as err:  # int("9" * 5000): the interpreter's limit on converting digits
        if "integer string conversion" not in str(err):
            raise
        raise UsageError("not JSON (an integer of more than 4300 digits)") from None


def check_prompt(text: str) -> str:
    """A text prompt as it is when it is valid Unicode and not blank; UsageError (one line) else."""
    if not check_text(text, "the prompt").strip():
        raise UsageError("the prompt is empty")
    return text


def check_text(text: str, what: str) -> str:
    """``text`` when it is valid Unicode; UsageError naming ``what`` and the first lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        raise UsageError(
            f"{what} holds a lone surrogate (U+{code:04X}) at character {err.start}: not valid Unicode"
        ) from None
    return text

"""What a request constrains its output to, as a frozen spec checked once: a JSON schema, any JSON object, a
regular expression or a grammar (Lark, or GBNF converted to Lark by llguidance); compiled by llguidance, and
a fresh per-sequence state made from it for each request (:func:`verispec.grammar.matcher.start_state`: this
module stays light, no torch), checked there against the tokenizer before anything is generated: a grammar
that cannot start (a schema that only refers to itself: llguidance's "NoExtensionBias") or dead-ends within
its forced start is refused then, as :class:`InvalidConstraint`, not after a stream has begun."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from verispec.errors import UsageError
from verispec.inputs import parse_json

__all__ = ["CHECKED_START", "KINDS", "Constraint", "InvalidConstraint", "first_line"]

KINDS = ("json_schema", "json_object", "regex", "grammar")  # json_object: any JSON object, no text
COMPACT_JSON = {"whitespace_flexible": False}
"""llguidance's JSON options unless a schema gives its own ``"x-guidance"``: no whitespace outside strings (a
small model allowed JSON's whitespace may spend its tokens on newlines; ``{"whitespace_flexible": true}`` in
a schema's ``"x-guidance"`` allows it)."""
_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "grammar": "grammar"}
CHECKED_START = 64  # forced tokens a new state walks from the start, checking that a token follows them
LONGEST = 2**32 - 1  # the longest string length a schema's grammar counts (llguidance's regexes: 32 bits)


class InvalidConstraint(UsageError):
    """A constraint that cannot be generated from: its text refused, or its grammar allowing no output from
    the start (one line, the caller's mistake; a server names the request's ``response_format``)."""


@dataclass(frozen=True)
class Constraint:
    """``kind`` one of :data:`KINDS`; ``text`` the schema (JSON text), the regex or the grammar (empty for
    ``json_object``). Checked on construction: a bad schema, regex or grammar is a one-line UsageError."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"unknown constraint {self.kind!r}: choose from {', '.join(KINDS)}")
        if not isinstance(self.text, str) or (self.kind == "json_object") == bool(self.text):
            need = "no text" if self.kind == "json_object" else "its text"
            raise UsageError(f"a {self.kind} constraint takes {need}")
        if self.kind == "json_schema":
            try:
                schema = parse_json(self.text)
            except UsageError as err:
                raise InvalidConstraint(f"invalid JSON schema: {err}") from None
            if not isinstance(schema, dict):
                raise InvalidConstraint("invalid JSON schema: not a JSON object")
            beyond = _length_beyond(schema)  # llguidance says "regex parse error: decimal literal invalid"
            if beyond is not None:
                key, value = beyond
                raise self.invalid(f"{key} {value} is more than a grammar counts (at most {LONGEST})")
        import llguidance

        problem = llguidance.LLMatcher.validate_grammar(self.grammar)
        if problem:
            raise self.invalid(first_line(problem))

    @classmethod
    def of(
        cls,
        json_schema: Mapping[str, Any] | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
    ) -> Constraint | None:
        """The one constraint given by keyword (``json_schema``: a dict or its JSON text; ``regex``;
        ``grammar``: Lark or GBNF text), or None for none; UsageError for more than one."""
        given = {"json_schema": json_schema, "regex": regex, "grammar": grammar}
        chosen = [kind for kind, value in given.items() if value is not None]
        if len(chosen) > 1:
            raise UsageError(f"give one of json_schema, regex and grammar, not {' and '.join(chosen)}")
        if not chosen:
            return None
        value = given[chosen[0]]
        if chosen[0] == "json_schema" and isinstance(value, Mapping):
            value = json.dumps(dict(value))
        if not isinstance(value, str):
            raise UsageError(
                f"{chosen[0]} must be text (a schema: a JSON object), got {type(value).__name__}"
            )
        return cls(chosen[0], value)

    @cached_property
    def grammar(self) -> str:
        """llguidance's grammar text for this constraint (never raises: :meth:`__post_init__` checks it)."""
        import llguidance

        kind, text = self.kind, self.text
        if kind in ("json_object", "json_schema"):  # compact JSON unless the schema says otherwise
            schema = json.loads(text) if text else {"type": "object"}
            kind, text = "json_schema", json.dumps({"x-guidance": COMPACT_JSON, **schema})
        try:
            return llguidance.grammar_from(kind, text)  # type: ignore[arg-type]
        except ValueError as err:  # a schema llguidance cannot take, or GBNF it cannot convert
            raise self.invalid(first_line(str(err))) from None

    def invalid(self, why: str) -> InvalidConstraint:
        """The one-line error of a constraint of this kind that cannot be used: ``why``, after its kind."""
        return InvalidConstraint(f"invalid {_NAMES[self.kind]}: {why}")


def first_line(message: str) -> str:
    """llguidance's message in one line: its first, and the reason a regex parser gives lines below it
    ("error: unclosed character class") under a picture of where."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "rejected"
    why = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {why}" if why and why not in lines[0] else lines[0]


def _length_beyond(schema: object) -> tuple[str, float] | None:
    """The first ``minLength`` or ``maxLength`` anywhere in ``schema`` beyond :data:`LONGEST` (key, value)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("minLength", "maxLength"):
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > LONGEST:
                    return key, int(value) if value == int(value) else value  # 1e12: 1000000000000
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None

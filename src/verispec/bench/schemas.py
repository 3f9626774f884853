"""The bench's check of a constrained output, independent of the grammar engine that produced it: the text
parsed as JSON by the standard library and validated against its schema by ``jsonschema``."""

from __future__ import annotations

import json

import jsonschema  # type: ignore[import-untyped]

__all__ = ["valid_json"]


def valid_json(text: str, schema: str) -> bool:
    """Whether ``text`` is one JSON value (surrounding whitespace allowed) valid against ``schema`` (its
    JSON text)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return jsonschema.Draft202012Validator(json.loads(schema)).is_valid(value)

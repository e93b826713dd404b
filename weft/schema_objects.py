"""What a JSON Schema's objects may hold beyond their `properties`: `JsonSchemaMode`.

JSON Schema leaves an object open unless it says `additionalProperties: false`: a model may add
any key, and a constrained completion that keeps adding keys runs to `max_tokens`. Libraries that
build schemas from classes (Pydantic, instructor, langchain, litellm) seldom say it. weft closes
such objects by default, as vLLM's default JSON backend does; `strict` is OpenAI's strict mode.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class JsonSchemaMode(StrEnum):
    """CLOSED (default): an object schema that lists `properties` and says nothing of others gets
    `additionalProperties: false`. STRICT: OpenAI's strict mode, every such object closed and every
    property required. OPEN: JSON Schema's own meaning."""

    CLOSED = "closed"
    STRICT = "strict"
    OPEN = "open"


# keywords whose value is a schema of values the document holds, a list of them, or a map of names to
# them (not `not`, `if` or `contains`: closing an object there would change what they test)
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "then", "else",
        "unevaluatedItems")  # fmt: skip
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# siblings that bring properties of their own: an object beside them is left as it is
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref")


def apply_mode(schema: Any, mode: JsonSchemaMode) -> Any:
    """`schema` with its objects closed as `mode` says (a new schema; `schema` is not changed)."""
    return schema if mode == JsonSchemaMode.OPEN else _close(schema, mode == JsonSchemaMode.STRICT, True)


def _close(schema: Any, strict: bool, here: bool) -> Any:
    """`here`: this schema may be closed (not a branch of an allOf, whose siblings add properties)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ONE:
            out[key] = _close(value, strict, True)
        elif key in _LIST and isinstance(value, list):
            out[key] = [_close(v, strict, True) for v in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_close(v, strict, False) for v in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: _close(v, strict, True) for name, v in value.items()}
        else:
            out[key] = value  # const, enum, default, examples, ...: values, not schemas
    if here and _closable(out):
        out.setdefault("additionalProperties", False)
        if strict:
            out["required"] = list(out["properties"])
    return out


def _closable(schema: dict[str, Any]) -> bool:
    """An object schema that lists its properties, says nothing of others, requires none beyond
    them, and has no sibling that brings properties of its own. (`{"type": "object"}` alone stays
    any object.)"""
    kind = schema.get("type", "object")
    properties = schema.get("properties")
    required = schema.get("required", [])
    return (
        (kind == "object" or (isinstance(kind, list) and "object" in kind))
        and isinstance(properties, dict)
        and "unevaluatedProperties" not in schema
        and isinstance(required, list)
        and all(name in properties for name in required)
        and not any(k in schema for k in _COMPOSED)
    )

"""JSON Schema objects closed by default, OpenAI's strict mode, and JSON Schema's open meaning on
request (`weft/schema_objects.py`): the transformed schemas, what the compiled constraint accepts,
and what the bundled model generates under each."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from weft import LLM, SamplingParams, bundled_model_path
from weft.schema_objects import JsonSchemaMode, apply_mode


class Address(BaseModel):
    city: str
    zip: str | None = None


class User(BaseModel):  # a plain model: no extra="forbid", as instructor and langchain users write it
    name: str
    age: int
    tags: list[str]
    home: Address | None = None


SCHEMA = User.model_json_schema()


class Short(BaseModel):  # bounded, so that the bundled model (it writes Shakespeare) finishes
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)
    nick: str | None = Field(default=None, max_length=6)


def test_closed_mode_closes_every_object_that_lists_properties():
    closed = apply_mode(SCHEMA, JsonSchemaMode.CLOSED)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Address"]["additionalProperties"] is False
    assert closed["required"] == SCHEMA["required"]  # optional properties stay optional
    assert "additionalProperties" not in SCHEMA  # the caller's schema is not changed
    assert apply_mode(SCHEMA, JsonSchemaMode.OPEN) is SCHEMA


def test_strict_mode_requires_every_property():
    strict = apply_mode(SCHEMA, JsonSchemaMode.STRICT)
    assert strict["required"] == ["name", "age", "tags", "home"]
    assert strict["$defs"]["Address"]["required"] == ["city", "zip"]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # any object: nothing listed to close it to
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True},  # it says so
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
        {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},  # b would be unsatisfiable
        {"type": "object", "properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]},
        {"type": "string", "properties": {"a": {}}},
    ],
)
def test_objects_that_say_otherwise_or_gain_properties_elsewhere_stay_as_given(schema):
    """(An allOf branch stays open too: closed, it would forbid the keys its siblings add.)"""
    assert apply_mode(schema, JsonSchemaMode.CLOSED) == schema


def test_only_schemas_of_values_are_walked():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {}}}},  # a key named so
        "not": {"type": "object", "properties": {"y": {}}},
        "if": {"properties": {"kind": {"const": "a"}}},
        "then": {"properties": {"z": {}}},
        "default": {"type": "object", "properties": {}},
    }
    closed = apply_mode(copy.deepcopy(schema), JsonSchemaMode.CLOSED)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["not"] == schema["not"] and closed["if"] == schema["if"]
    assert closed["default"] == schema["default"]
    assert closed["then"]["additionalProperties"] is False
    items = apply_mode({"type": "array", "items": {"properties": {"q": {}}}}, JsonSchemaMode.CLOSED)
    assert items["items"]["additionalProperties"] is False


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(bundled_model_path(), show_progress=False)


def _accepts(llm: LLM, params: SamplingParams, document: dict) -> bool:
    backend = llm.engine.grammars.backend
    assert params.structured is not None
    matcher = backend.compile(params.structured).template.deep_copy()
    tokens = backend.tokenizer.tokenize_str(json.dumps(document))
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


def test_the_compiled_constraint_accepts_what_each_mode_means(llm):
    base = {"name": "a", "age": 3, "tags": []}
    extra = {**base, "nickname": "b"}
    full = {**base, "home": {"city": "c", "zip": None}}
    closed = SamplingParams(json_schema=User)
    strict = SamplingParams(json_schema=User, json_schema_mode="strict")
    open_ = SamplingParams(json_schema=User, json_schema_mode="open")
    assert _accepts(llm, closed, base) and not _accepts(llm, closed, extra)
    assert _accepts(llm, open_, base) and _accepts(llm, open_, extra)
    assert _accepts(llm, strict, full) and not _accepts(llm, strict, base)
    assert not _accepts(llm, strict, {**full, "nickname": "b"})


@pytest.mark.parametrize("mode", ["closed", "strict"])
def test_generated_objects_hold_no_keys_beyond_the_schema(llm, mode):
    schema = Short.model_json_schema()
    params = [
        SamplingParams(json_schema=Short, json_schema_mode=mode, temperature=1.0, seed=s, max_tokens=200)
        for s in range(6)
    ]
    closed = apply_mode(schema, JsonSchemaMode(mode))
    for out in llm.generate(["A user:"] * len(params), params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        document = json.loads(completion.text)
        jsonschema.validate(document, closed)
        jsonschema.validate(document, schema)  # and so the schema as given
        if mode == "strict":
            assert set(document) == set(schema["properties"])

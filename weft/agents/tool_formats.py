"""Tool-call formats of the model families, told apart by their chat templates.

A format says how a reply lays out its calls: the text that opens them, what separates two calls,
what closes them, and one call's shape (a JSON object with the name and the arguments, or a tag
naming the function around the arguments). Every format here is exact: the grammar built from it
(weft/agents/tool_grammar.py) and the reader of replies (weft/agents/tool_reader.py) share it, so a
reply the grammar allowed is always read back.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from weft.schema_objects import JsonSchemaMode, apply_mode


class CallShape(StrEnum):
    JSON = "json"  # {"name": "NAME", "<arguments_key>": {...}}
    TAG = "tag"  # <function=NAME>{...}</function>
    XML = "xml"  # <function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function> (Qwen3-Coder)
    HARMONY = "harmony"  # a message to functions.NAME (gpt-oss: weft/agents/harmony.py)


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    name: str
    opener: str  # before the first call ("" where the call opens itself)
    separator: str  # between two calls
    closer: str  # after the last call
    shape: CallShape = CallShape.JSON
    arguments_key: str = "arguments"
    at_start: bool = False  # calls only as the whole reply, never after text (Llama 3.x)
    markers: tuple[str, ...] = ()  # substrings of a chat template that identify this format
    short_ids: bool = False  # the template takes only 9-character alphanumeric call ids (Mistral)

    def call_prefix(self, name: str) -> str:
        """The text of a call up to its arguments."""
        if self.shape == CallShape.TAG:
            return f"<function={name}>"
        if self.shape == CallShape.XML:
            return f"<function={name}>\n"
        return f'{{"name": {_json(name)}, "{self.arguments_key}": '

    @property
    def name_lead(self) -> str:
        """The text of a call before its name."""
        return '{"name": ' if self.shape == CallShape.JSON else "<function="

    @property
    def call_suffix(self) -> str:
        return "}" if self.shape == CallShape.JSON else "</function>"

    @property
    def trigger(self) -> str:
        """The fixed text every run of calls starts with, up to its first whitespace: once the
        model writes it, the rest of the reply is held to the format."""
        return (self.opener or self.name_lead).rstrip()


FORMATS: dict[str, ToolCallFormat] = {
    f.name: f
    for f in (
        # gpt-oss's harmony: calls are messages of their own, `<|channel|>commentary
        # to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (weft/agents/harmony.py)
        ToolCallFormat(
            "harmony",
            "",
            "<|start|>assistant",
            "",
            shape=CallShape.HARMONY,
            markers=("<|channel|>", "<|message|>", "<|start|>"),
        ),
        # Qwen3-Coder (and Qwen3.5): a tag per call and per parameter, values as plain text; its
        # template also holds "<tool_call>" and "<function=", so it is told apart first
        ToolCallFormat(
            "qwen3_coder",
            "<tool_call>\n",
            "\n</tool_call>\n<tool_call>\n",
            "\n</tool_call>",
            shape=CallShape.XML,
            markers=("<tool_call>", "<parameter=example_parameter_1>"),
        ),
        # Hermes 2 Pro / 3, Qwen2.5, Qwen3
        ToolCallFormat(
            "hermes",
            "<tool_call>\n",
            "\n</tool_call>\n<tool_call>\n",
            "\n</tool_call>",
            markers=("<tool_call>",),
        ),
        # Mistral Nemo (and the other v3-tokenizer Mistral models)
        ToolCallFormat("mistral", "[TOOL_CALLS][", ", ", "]", markers=("[TOOL_CALLS]",), short_ids=True),
        # Llama 3.1 / 3.2 / 3.3: the reply is a JSON call (or calls separated by "; ") or text
        ToolCallFormat(
            "llama3_json",
            "",
            "; ",
            "",
            arguments_key="parameters",
            at_start=True,
            markers=('"parameters": dictionary of argument name',),
        ),
        # functionary v3.1 (Llama 3.1 based)
        ToolCallFormat("functionary_v3_1", "", "", "", shape=CallShape.TAG, markers=("<function=",)),
        # Phi-4-mini: a JSON list of calls between "<|tool_call|>" and "<|/tool_call|>"; its template
        # reads the tools from the system message, between "<|tool|>" and "<|/tool|>"
        ToolCallFormat(
            "phi4_mini", "<|tool_call|>[", ", ", "]<|/tool_call|>", markers=("<|tool|>", "<|/tool|>")
        ),
        # Granite 3.x: "<|tool_call|>" and a JSON list of calls
        ToolCallFormat("granite", "<|tool_call|>[", ", ", "]", markers=("<|tool_call|>",)),
        # firefunction v2
        ToolCallFormat("firefunction_v2", "functools[", ", ", "]", markers=("functools[",)),
    )
}


def detect_tool_format(chat_template: str | None) -> ToolCallFormat | None:
    """The format a chat template teaches its model, or None when no known format is found."""
    if not chat_template:
        return None
    for fmt in FORMATS.values():
        if all(marker in chat_template for marker in fmt.markers):
            return fmt
    return None


def tool_format(name: str) -> ToolCallFormat:
    """A format by name (`--tool-call-parser`); a ValueError lists the known ones."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function tool: its name and the JSON Schema of its arguments."""

    name: str
    parameters: dict[str, Any]
    strict: bool = False

    @classmethod
    def of(cls, tool: Any) -> ToolSpec:
        """From OpenAI's shape, `{"type": "function", "function": {"name", "parameters", "strict"}}`,
        the inner `function` object, or an object with those attributes."""
        if not isinstance(tool, dict):
            tool = tool.model_dump() if hasattr(tool, "model_dump") else vars(tool)
        function = tool.get("function", tool)
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool needs a function name, got {tool!r}")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON Schema object")
        return cls(name, parameters, bool(function.get("strict")))

    def arguments_schema(self, mode: JsonSchemaMode) -> dict[str, Any]:
        """The arguments' schema, its objects closed as the tool's `strict` or `mode` says."""
        return apply_mode(self.parameters, JsonSchemaMode.STRICT if self.strict else mode)


XML_PARAMETER_CLOSE = "\n</parameter>\n"  # ends a parameter's value in the XML call shape


def text_options(schema: Any) -> list[str] | None:
    """The strings a property's value is one of (its `enum` or `const`, all strings), else None."""
    if not isinstance(schema, dict):
        return None
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        return options
    return None


def is_text(schema: Any) -> bool:
    """Whether a property's value is a string, written as its plain text in the XML call shape."""
    if text_options(schema) is not None:
        return True
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind == "string" or kind == ["string"]


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)

"""The grammar of a reply that may call tools, in llguidance's Lark dialect.

Under `tool_choice="auto"` the model writes free text; once it writes its family's opener (the
trigger) the rest of the reply is held to the format: one call or several, each naming one of the
tools, its arguments valid against that tool's schema, JSON written compactly. A trigger that is a
single token of the vocabulary (Qwen's `<tool_call>`) is matched as that token; otherwise the text
before it is a lazy lexeme that ends at the trigger's first occurrence. A reply that never writes the
trigger is unconstrained text, so armed-but-not-triggered decoding costs one cheap mask per token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from weft.agents.tool_formats import (
    XML_PARAMETER_CLOSE,
    CallShape,
    ToolCallFormat,
    ToolSpec,
    is_text,
    text_options,
)
from weft.schema_objects import JsonSchemaMode

# How a JSON value inside a Lark grammar is written: as weft writes JSON elsewhere
# (weft/structured/llguidance_backend.py), compact, so that more of it is forced.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TEXT_RULE = "TEXT: /(.|\\n)*/"
EMPTY = '""'  # a rule body that matches the empty text


def lark_json(schema: Mapping[str, Any]) -> str:
    """`%json {...}` for a schema, written in weft's JSON style."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE}, ensure_ascii=False)


def lark_literal(text: str, special_tokens: Mapping[str, int]) -> str:
    """`text` as Lark terminals: the special tokens in it as `<[id]>`, the rest as strings."""
    parts: list[str] = []
    rest = text
    while rest:
        hits = [(rest.find(s), s) for s in special_tokens if s and s in rest]
        if not hits:
            parts.append(json.dumps(rest, ensure_ascii=False))
            break
        at, token = min(hits, key=lambda h: (h[0], -len(h[1])))
        if at:
            parts.append(json.dumps(rest[:at], ensure_ascii=False))
        parts.append(f"<[{special_tokens[token]}]>")
        rest = rest[at + len(token) :]
    return " ".join(parts)


def tool_call_lark(
    fmt: ToolCallFormat,
    tools: Sequence[ToolSpec],
    special_tokens: Mapping[str, int],
    *,
    parallel: bool = True,
    mode: JsonSchemaMode = JsonSchemaMode.CLOSED,
    answer: str | None = None,
    start: str = "start",
) -> str:
    """The Lark rules of a reply that is text (or `answer`, a rule body such as `%json {...}`) or,
    once the trigger is written, calls to `tools` in `fmt`. `special_tokens`: the vocabulary's added
    tokens (text -> id). `start`: the name of the top rule (to embed the reply in a larger grammar)."""
    if not tools:
        raise ValueError("tool calls need at least one tool")
    lit = lambda text: lark_literal(text, special_tokens)  # noqa: E731
    trigger = fmt.trigger
    rules, more = _call_rules(fmt, tools, special_tokens, parallel, mode)
    closer = f" {lit(fmt.closer)}" if fmt.closer else ""
    # the calls written after the trigger: the first call's prefix without the trigger's text
    firsts = []
    for i, t in enumerate(tools):
        head = (fmt.opener + fmt.call_prefix(t.name))[len(trigger) :]
        firsts.append(f"tc_first_{i}: {lit(head)} tc_args_{i} {lit(fmt.call_suffix)}")
    rules += firsts
    rules.append(f"tc_rest: ({' | '.join(f'tc_first_{i}' for i in range(len(tools)))}){more}{closer}")
    trigger_lit = lit(trigger)
    if fmt.at_start or answer is not None:
        tag = special_tokens.get("<|python_tag|>")
        opening = f"<[{tag}]>? " if tag is not None and fmt.at_start else ""
        text = answer if answer is not None else "TEXT_NB\nTEXT_NB: /([^{](.|\\n)*)?/"
        rules.append(f"{start}: tc_text | {opening}{trigger_lit} tc_rest")
        rules.append(f"tc_text: {text}")
    elif trigger_lit.startswith("<["):  # the trigger is one token: free text ends where it appears
        rules.append(f"{start}: TEXT | TEXT {trigger_lit} tc_rest")
        rules.append(TEXT_RULE)
    else:
        rules.append(f"{start}: TEXT | tc_head tc_rest")
        rules.append(f"tc_head[lazy]: TEXT {trigger_lit}")
        rules.append(TEXT_RULE)
    return "\n".join(rules) + "\n"


def forced_call_lark(
    fmt: ToolCallFormat,
    tools: Sequence[ToolSpec],
    special_tokens: Mapping[str, int],
    *,
    parallel: bool = True,
    mode: JsonSchemaMode = JsonSchemaMode.CLOSED,
    start: str = "start",
) -> str:
    """The Lark rules of a reply that is calls and nothing else (`tool_choice` "required", or one
    named function: `tools` is then that one), in the model's own format: its opener, each call's
    prefix with the function's name, the arguments under that tool's schema, its suffix, the
    closer; as the model was trained to write them, and no text before or after."""
    if not tools:
        raise ValueError("tool calls need at least one tool")
    lit = lambda text: lark_literal(text, special_tokens) if text else ""  # noqa: E731
    rules, more = _call_rules(fmt, tools, special_tokens, parallel, mode)
    # (a space may come first: SentencePiece tokenizers start a reply's first word with one)
    body = ['" "?', lit(fmt.opener), f"tc_call{more}", lit(fmt.closer)]
    rules.append(f"{start}: {' '.join(part for part in body if part)}")
    return "\n".join(rules) + "\n"


def _call_rules(
    fmt: ToolCallFormat,
    tools: Sequence[ToolSpec],
    special_tokens: Mapping[str, int],
    parallel: bool,
    mode: JsonSchemaMode,
) -> tuple[list[str], str]:
    """The rules of one call (`tc_call`: one of the tools, its arguments under its schema) and what
    may follow a call (more calls, where `parallel` allows)."""
    lit = lambda text: lark_literal(text, special_tokens)  # noqa: E731
    if fmt.shape == CallShape.XML:
        rules = [
            rule for i, t in enumerate(tools) for rule in _xml_arguments(i, t.arguments_schema(mode), lit)
        ]
    else:
        rules = [f"tc_args_{i}: {lark_json(t.arguments_schema(mode))}" for i, t in enumerate(tools)]
    rules += [
        f"tc_call_{i}: {lit(fmt.call_prefix(t.name))} tc_args_{i} {lit(fmt.call_suffix)}"
        for i, t in enumerate(tools)
    ]
    rules.append(f"tc_call: {' | '.join(f'tc_call_{i}' for i in range(len(tools)))}")
    more = (
        f" ({lit(fmt.separator)} tc_call)*"
        if parallel and fmt.separator
        else (" tc_call*" if parallel else "")
    )
    return rules, more


def _xml_arguments(i: int, schema: Mapping[str, Any], lit: Callable[[str], str]) -> list[str]:
    """The rules of tool `i`'s arguments as tagged parameters (`CallShape.XML`): each property in the
    schema's order, `<parameter=KEY>`, its value on its own lines, `</parameter>`; the required ones
    always, the others where the model writes them. A string's value is its plain text (ending at
    the first closing tag; an enum's or const's value one of its strings), any other is JSON under
    the property's schema (with the root's definitions, for `$ref`s)."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    close = lit(XML_PARAMETER_CLOSE)
    rules, items = [], []
    for j, (key, sub) in enumerate(properties.items()):
        value = f"tc_v_{i}_{j}"
        options = text_options(sub)
        if options is not None:
            alternatives = " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
            rules.append(f"{value}: ({alternatives}) {close}")
        elif is_text(sub):
            rules.append(f"{value}[lazy]: /(.|\\n)*/ {close}")
        else:
            rules.append(f"{value}_json: {lark_json({**shared, **sub})}")
            rules.append(f"{value}: {value}_json {close}")
        head = lit(f"<parameter={key}>\n")
        item = f"{head} {value}"
        items.append(item if key in required else f"({item})?")
    rules.append(f"tc_args_{i}: {' '.join(items) or EMPTY}")
    return rules


def grammar_text(rules: str) -> str:
    """A whole llguidance Lark grammar from rules that define `start`."""
    return "%llguidance {}\n" + rules

"""A chat call's tools and formats, shared by `LLM.chat` and the server: which tool-call format and
reasoning section the model family has, and the plan of each reply (weft/agents/reply.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weft.agents.reasoning import ReasoningFormat, detect_reasoning_format, reasoning_format
from weft.agents.reply import ForcedCall, ReplyPlan, forced_call, plan_reply
from weft.agents.tool_formats import ToolCallFormat, ToolSpec, detect_tool_format, tool_format
from weft.schema_objects import JsonSchemaMode


@dataclass(frozen=True, slots=True)
class AgentFormats:
    """The model family's tool-call format (for `tool_choice="auto"`) and reasoning section."""

    tool_calls: ToolCallFormat | None = None
    reasoning: ReasoningFormat | None = None

    @classmethod
    def of(
        cls, chat_template: str | None, tool_parser: str | None = None, reasoning_parser: str | None = None
    ) -> AgentFormats:
        """Each by name, "none" for none, or None: detected from the chat template."""
        tools = detect_tool_format(chat_template) if tool_parser is None else None
        if tool_parser not in (None, "none"):
            tools = tool_format(tool_parser)
        reasoning = detect_reasoning_format(chat_template) if reasoning_parser is None else None
        if reasoning_parser not in (None, "none"):
            reasoning = reasoning_format(reasoning_parser)
        return cls(tools, reasoning)


@dataclass(frozen=True, slots=True)
class ChatTools:
    """What one chat call asks of its replies."""

    formats: AgentFormats
    added_tokens: Mapping[str, int]
    tools: tuple[ToolSpec, ...] = ()
    choice: str | None = "auto"  # "auto", "required" or a function's name
    mode: JsonSchemaMode = JsonSchemaMode.CLOSED
    forced: tuple[dict[str, Any], ForcedCall] | None = field(default=None)

    @classmethod
    def of(
        cls,
        tokenizer: Any,
        chat_template: str | None,
        tools: Sequence[Any] | None,
        tool_choice: str | dict[str, Any] = "auto",
        tool_parser: str | None = None,
        mode: JsonSchemaMode = JsonSchemaMode.CLOSED,
    ) -> ChatTools:
        """`tool_choice`: "auto", "required" or `{"type": "function", "function": {"name": ...}}`."""
        formats = AgentFormats.of(chat_template or tokenizer.chat_template, tool_parser)
        specs = tuple(ToolSpec.of(t) for t in tools or ())
        choice = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else tool_choice
        if choice not in ("auto", "none", "required") and not isinstance(tool_choice, dict):
            raise ValueError(f"tool_choice must be auto, none, required or a named function, got {choice!r}")
        forced = None
        if specs and choice not in ("auto", "none"):
            forced = forced_call(specs, None if choice == "required" else choice, mode)
        elif not specs and choice not in ("auto", "none"):
            raise ValueError("tool_choice needs tools")
        return cls(formats, tokenizer.added_tokens, specs, choice, mode, forced)

    @property
    def active(self) -> bool:
        """Whether replies are read as messages: tools were given, or there is a reasoning section."""
        return bool(self.tools) or self.formats.reasoning is not None

    def plan(
        self, prompt: str, parallel_tool_calls: bool = True, constraint: dict[str, Any] | None = None
    ) -> ReplyPlan:
        """The plan of a reply to `prompt` (its rendered text); `constraint`: the answer's."""
        forced = self.forced
        return plan_reply(
            constraint=forced[0] if forced else dict(constraint or {}),
            forced=forced[1] if forced else None,
            tools=self.tools if self.choice == "auto" else (),
            tool_format=self.formats.tool_calls,
            reasoning=self.formats.reasoning,
            prompt=prompt,
            added_tokens=self.added_tokens,
            mode=self.mode,
            parallel_tool_calls=parallel_tool_calls,
            forced_tools=[t for t in self.tools if forced and forced[1].function in (None, t.name)],
        )

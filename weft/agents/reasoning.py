"""Reasoning kept apart from the answer: the `<think>...</think>` section of DeepSeek-R1 distills
and Qwen3.

A reply is read as reasoning up to the end marker and content after it. Whether the reply starts
inside the section depends on the prompt: R1's template opens `<think>` in the generation prompt,
Qwen3's model writes it itself (and `enable_thinking: false` closes an empty one in the prompt).
An output constraint (a JSON schema, tool calls) holds only after the section ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from weft.agents.harmony import is_harmony
from weft.agents.tool_grammar import lark_literal
from weft.agents.tool_reader import marker_start_at_end


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"

    def opens_inside(self, prompt: str) -> bool:
        """Whether a reply to `prompt` starts inside the section (the prompt opened it last)."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def split(self, text: str, inside: bool, finished: bool = True) -> tuple[str | None, str, int]:
        """(reasoning, content, held) of a reply: reasoning is None when the reply has no section;
        `held`: trailing characters of the reasoning that may be the start of the end marker (while
        the reply is still being written)."""
        if not inside:
            stripped = text.lstrip()
            if not stripped.startswith(self.start):
                maybe_start = not finished and self.start.startswith(stripped)
                return (None, "", 0) if maybe_start and stripped else (None, text, 0)
            text = stripped[len(self.start) :]
        at = text.find(self.end)
        if at < 0:
            held = 0 if finished else marker_start_at_end(text, self.end)
            return text, "", held
        return text[:at], text[at + len(self.end) :].lstrip("\n"), 0

    def lark(
        self,
        inside: bool,
        answer: str,
        special_tokens: Mapping[str, int],
        start: str = "start",
        budget: int | None = None,
    ) -> str:
        """Rules for a reply whose answer (rule `answer`) follows the reasoning section; with
        `budget`, the section's text is at most that many tokens, then the end marker is forced
        (where the marker is one token: `takes_budget`)."""
        end = lark_literal(self.end, special_tokens)
        if end.startswith("<["):  # one token ends the section; the vocabulary's others may occur in it
            others = sorted(i for t, i in special_tokens.items() if t not in (self.start, self.end))
            piece = f"RS_TEXT | <[{','.join(map(str, others))}]>" if others else "RS_TEXT"
            if budget is None:
                think = f"rs_think: rs_piece* {end}\nrs_piece: {piece}\nRS_TEXT: /(.|\\n)+/"
            else:  # one lexeme of at most `budget` tokens (no special tokens inside it), then the marker
                think = f"rs_think: rs_body {end}\nrs_body[max_tokens={budget}]: /(.|\\n)*/"
        else:  # the section's text ends at the end marker's first occurrence
            think = f"rs_think[lazy]: RS_TEXT {end}\nRS_TEXT: /(.|\\n)*/"
        think += '\nrs_gap: "\\n"*'
        if inside:
            return f"{start}: rs_think rs_gap {answer}\n{think}\n"
        opener = lark_literal(self.start, special_tokens)
        return f"{start}: {answer} | {opener} rs_think rs_gap {answer}\n{think}\n"


def takes_budget(fmt: ReasoningFormat, special_tokens: Mapping[str, int]) -> bool:
    """Whether a thinking budget can hold the section: its end marker is one token of the vocabulary
    (a marker written as text could also be written inside the section)."""
    return fmt.end in special_tokens


REASONING_FORMATS = {name: ReasoningFormat(name) for name in ("deepseek_r1", "qwen3")}
# gpt-oss's analysis channel (its replies are read as harmony messages: weft/agents/harmony.py)
REASONING_FORMATS["harmony"] = ReasoningFormat("harmony", "<|channel|>analysis<|message|>", "<|end|>")


def detect_reasoning_format(chat_template: str | None) -> ReasoningFormat | None:
    """The thinking section a chat template knows of (it strips or opens `</think>`; harmony's
    analysis channel), or None."""
    if is_harmony(chat_template):
        return REASONING_FORMATS["harmony"]
    if chat_template and "</think>" in chat_template:
        return REASONING_FORMATS["deepseek_r1"]
    return None


def reasoning_format(name: str) -> ReasoningFormat:
    """A format by name (`--reasoning-parser`); a ValueError lists the known ones."""
    if name not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning format {name!r}; known: {', '.join(REASONING_FORMATS)}")
    return REASONING_FORMATS[name]

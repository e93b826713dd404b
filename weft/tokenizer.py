"""Tokenizer wrapper, incremental detokenizer, stop strings and chat templates."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from weft.config import ConfigError, read_optional_json

Message = dict[str, Any]


def check_text(text: str, name: str) -> None:
    """Raise ValueError naming `name` unless `text` is valid Unicode (a lone surrogate, such as
    "\ud800", cannot be encoded, tokenized or sent anywhere)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid Unicode text: it holds the lone surrogate {text[exc.start]!r} at index "
            f"{exc.start}; remove it or decode the text correctly"
        ) from None


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TokenTexts(dict[int, str]):
    """Token id -> the text of that token alone (special tokens included), decoded on first use. A
    dict, so that `map(texts.__getitem__, ids)` looks up many ids without a Python call each."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class Tokenizer:
    """A `tokenizers` tokenizer plus what tokenizer_config.json says about special tokens and the
    chat template."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template: str | None = _chat_template(config)
        self.bos_token_id = self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.token_texts = TokenTexts(self)  # token id -> its text alone, decoded on first use
        self.is_byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)  # GPT-2 style bytes

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{path}: file not found; weft needs a fast tokenizer (tokenizer.json)")
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise ConfigError(f"{path}: cannot be read as a tokenizer ({exc})") from None
        return cls(tokenizer, read_optional_json(model_dir / "tokenizer_config.json"))

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], source: str) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata (`weft/gguf_tokenizer.py`)."""
        from weft.gguf_tokenizer import tokenizer_from_gguf

        tokenizer, config = tokenizer_from_gguf(metadata, source)
        return cls(tokenizer, config)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """The vocabulary's added tokens (special or not), text -> id: each is one token that
        ordinary text never encodes to, so a grammar names it by id."""
        return {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.content}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (special tokens included), decoded once per id and cached:
        logprobs show it for every alternative of every position."""
        return self.token_texts[token_id]

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if self.chat_template is None:
            raise ValueError(
                "this model's tokenizer_config.json has no chat_template; use generate() with a plain "
                "prompt, or pass chat_template= to chat()"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )


def _chat_template(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def check_chat_messages(messages: Any) -> None:
    """Raise ValueError naming the field unless `messages` is a list of {"role": str, "content": ...}
    dicts whose content is a string, None, or a list of {"type": "text", "text": str} parts."""
    if not isinstance(messages, list):
        raise ValueError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {messages!r:.80}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        _check_content(message.get("content"), f"messages[{i}].content")


def _check_content(content: Any, name: str) -> None:
    if content is None:
        return
    if isinstance(content, str):
        return check_text(content, name)
    if not isinstance(content, list):
        raise ValueError(f"{name} must be a string or a list of text parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        if not isinstance(text, str):
            raise ValueError(f"{name}[{j}] must be a {{'type': 'text', 'text': str}} part, got {part!r:.80}")
        check_text(text, f"{name}[{j}].text")
    return None


# a template that writes a call's arguments with `tojson` (Qwen2.5, Llama 3.x, Hermes, Command R),
# walks them with `items` (Qwen3-Coder) or writes the calls whole with `tojson` (Granite): it takes
# them as an object, as transformers' documentation says; others concatenate the text
_ARGUMENTS_TO_JSON = re.compile(r"arguments['\"]?\]?\s*\|\s*(tojson|items)|tool_calls\b[^}%]*\|\s*tojson")


def _arguments_as_objects(message: Message) -> Message:
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_call_arguments_as_object(c) for c in calls]}


def _call_arguments_as_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        decoded = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": decoded}}


# a template that reads the tools from the system message, not from `tools` (Phi-4-mini's: the JSON
# text of the functions between <|tool|> and <|/tool|>)
_TOOLS_IN_SYSTEM = re.compile(r"message\[['\"]tools['\"]\]|message\.tools\b")


def _tools_in_system(messages: list[Message], tools: list[Any]) -> list[Message]:
    """The messages with the tools' functions as JSON text on the first system message (a system
    message of no text put first where there is none), as such a template reads them."""
    functions = [t.get("function", t) if isinstance(t, dict) else t for t in tools]
    text = json.dumps(functions, ensure_ascii=False)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "tools": text}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": text}, *messages]


def render_chat_template(
    template: str, messages: list[Message], add_generation_prompt: bool = True, **context: Any
) -> str:
    """Render a Hugging Face chat template in a sandboxed jinja2 environment, after checking the
    messages (`check_chat_messages`). Tool calls' `arguments` given as JSON text (OpenAI's shape)
    reach a template that writes them with `tojson` as the object they encode; `tools` reach a
    template that reads them from the system message there (`_tools_in_system`)."""
    check_chat_messages(messages)
    if _ARGUMENTS_TO_JSON.search(template):
        messages = [_arguments_as_objects(m) for m in messages]
    tools = context.get("tools")
    if tools and _TOOLS_IN_SYSTEM.search(template) and not any("tools" in m for m in messages):
        messages = _tools_in_system(messages, list(tools))
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    context = {**context, "add_generation_prompt": add_generation_prompt}
    try:
        compiled = env.from_string(template)
        return compiled.render(messages=messages, **context)
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as exc:
        folded = _system_folded(messages)
        if folded is not None and isinstance(exc, jinja2.TemplateError):  # (Gemma's: no system role)
            try:
                return compiled.render(messages=folded, **context)
            except (jinja2.TemplateError, TypeError, KeyError, AttributeError):
                pass
        raise ValueError(f"chat template failed: {exc}") from None


def _system_folded(messages: list[Message]) -> list[Message] | None:
    """For a template without a system role, or with one only first (Gemma's): each system
    message's text put before the next user message's, as Gemma 3's own template does with the
    first (after the last user message's where none follows); None where this cannot be done."""
    folded: list[Message] = []
    pending: list[str] = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role == "system":
            if not isinstance(content, str):
                return None
            pending.append(content)
            continue
        if role == "user" and pending:
            if not isinstance(content, str):
                return None
            message, pending = {**message, "content": "\n\n".join([*pending, content])}, []
        folded.append(message)
    if len(folded) == len(messages):
        return None  # no system message: nothing to fold
    if pending:  # system text after the last user message: it goes after that message's text
        users = [i for i, m in enumerate(folded) if m.get("role") == "user"]
        if not users or not isinstance(folded[users[-1]].get("content"), str):
            return None
        last = folded[users[-1]]
        folded[users[-1]] = {**last, "content": "\n\n".join([last["content"], *pending])}
    return folded


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, a few tokens at a time.

    Decoding token by token breaks byte-level BPE and sentencepiece byte fallback (a character can
    span several tokens) and sentencepiece's leading-space handling. So each update decodes a short
    window twice, once up to the last emitted token and once up to the newest, and emits the
    difference; while the newest text ends in an incomplete character (U+FFFD), it waits.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_ids)
        self.read_offset = len(prompt_ids)
        self.prefix_offset = max(len(prompt_ids) - 6, 0)

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy that continues from the same point."""
        child = IncrementalDetokenizer(self.tokenizer, [], self.skip_special_tokens)
        child.token_ids = list(self.token_ids)
        child.read_offset, child.prefix_offset = self.read_offset, self.prefix_offset
        return child

    def update_one(self, token_id: int) -> str:
        return self.update([token_id])

    def update(self, new_token_ids: Sequence[int]) -> str:
        self.token_ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix) :]


@dataclass(frozen=True, slots=True)
class StopMatch:
    text: str  # the text up to the stop string (with it when included)
    stop: str


class StopStringMatcher:
    """Finds the first stop string in growing text, also when it spans tokens."""

    def __init__(self, stops: Sequence[str], include_in_output: bool) -> None:
        self.stops = tuple(stops)
        self.include = include_in_output
        self.holdback = max((len(s) for s in self.stops), default=1) - 1

    def check(self, text: str, num_new_chars: int) -> StopMatch | None:
        if not self.stops or num_new_chars == 0:
            return None
        start = max(0, len(text) - num_new_chars - self.holdback)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = text.find(stop, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        return StopMatch(text[: idx + len(stop)] if self.include else text[:idx], stop)

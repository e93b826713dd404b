"""Anthropic's Messages API on `weft serve` (/v1/messages, /v1/messages/count_tokens), through the
official `anthropic` client as Claude Code and the SDK call it: whole and streamed replies, forced
tool use and the tool result after it, token counts, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from test_server import API_KEY, MODEL, WEATHER

CLAUDE = "claude-code"  # a name weft does not serve: it answers with its one model, and echoes it
TOOL = {
    "name": WEATHER["function"]["name"],
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.fixture(scope="module")
def server(bundled_server):
    return bundled_server


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def test_a_message_and_its_stream(client):
    request = {
        "model": CLAUDE,
        "max_tokens": 12,
        "system": "Answer briefly.",
        "messages": [{"role": "user", "content": "Speak, speak."}],
        "extra_body": {"temperature": 0},  # (the client's own signature no longer has it)
    }
    message = client.messages.create(**request)
    assert message.type == "message" and message.role == "assistant" and message.model == CLAUDE
    (block,) = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason in ("end_turn", "max_tokens") and 0 < message.usage.output_tokens <= 12
    with client.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == block.text == final.content[0].text  # greedy: the same text, whole or streamed
    assert (
        final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens
    )


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_then_its_result(client, stream):
    request = {
        "model": CLAUDE,
        "max_tokens": 80,
        "messages": [{"role": "user", "content": "What is the weather in Verona?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    if stream:
        with client.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, TOOL["input_schema"])
    follow_up = client.messages.create(
        model=CLAUDE,
        max_tokens=8,
        tools=[TOOL],
        messages=[
            *request["messages"],
            {"role": "assistant", "content": [b.model_dump() for b in message.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
            },
        ],
    )
    assert follow_up.content and follow_up.usage.input_tokens > message.usage.input_tokens


def test_token_counts_are_those_of_the_prompt(client, server):
    messages = [{"role": "user", "content": "What is the weather in Verona?"}]
    counted = client.messages.count_tokens(model=CLAUDE, messages=messages, system="Be brief.", tools=[TOOL])
    chat = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, *messages],
        tools=[WEATHER],
        max_tokens=1,
    )
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_errors_come_in_anthropics_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=CLAUDE,
            max_tokens=8,
            messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
            ],
        )
    assert bad.value.body["type"] == "error" and "'image' block" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=CLAUDE, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    reply = httpx.post(f"{server.url}/v1/messages", json={"messages": []}, headers={"x-api-key": API_KEY})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_server_tools_are_left_out_with_a_warning(server):
    body = {
        "model": CLAUDE,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [TOOL, {"type": "web_search_20250305", "name": "web_search"}],
        "metadata": {"user_id": "u1"},
    }
    reply = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert "web_search_20250305" in reply.headers["x-weft-warning"]
    assert json.loads(reply.text)["type"] == "message"


def test_a_thinking_budget_is_taken(client):
    """`thinking` with `budget_tokens` (a model without a thinking section answers as it would)."""
    message = client.messages.create(
        model=CLAUDE,
        max_tokens=4,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "hi"}],
    )
    assert message.content and message.stop_reason in ("end_turn", "max_tokens")


def test_a_request_shaped_as_claude_codes(client):
    """What Claude Code 2.1 sends beside the basics: the beta route (`?beta=true`, `anthropic-beta`),
    system blocks with `cache_control`, a system message between the turns, adaptive thinking with
    `output_config.effort`, `context_management` and `metadata`; whole and streamed."""
    request = {
        "model": CLAUDE,
        "max_tokens": 6,
        "system": [
            {"type": "text", "text": "You are an agent."},
            {"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi.", "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "system", "content": "Available agent types: none."},
        ],
        "tools": [TOOL],
        "thinking": {"type": "adaptive"},
        "metadata": {"user_id": '{"device_id": "d", "session_id": "s"}'},
        "betas": ["claude-code-20250219", "context-management-2025-06-27", "effort-2025-11-24"],
        "extra_body": {
            "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        },
    }
    message = client.beta.messages.create(**request)
    assert message.content and message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.beta.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.content and final.usage.input_tokens == message.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError, match=r"output_config\.effort"):
        client.beta.messages.create(**{**request, "extra_body": {"output_config": {"effort": "extreme"}}})


def test_a_max_tokens_beyond_the_context_is_held_to_its_room(client):
    """Anthropic's clients send their own model's limit (Claude Code: 32,000): the reply stops where
    the context ends instead of the request failing (the chat API refuses such a max_tokens)."""

    def messages(repeats: int) -> list[dict]:
        return [{"role": "user", "content": "Speak, speak. " * repeats}]

    one, two = (client.messages.count_tokens(model=CLAUDE, messages=messages(n)).input_tokens for n in (1, 2))
    repeats = (1024 - 12 - one) // (two - one)  # the bundled model's context: 1,024 tokens; ~12 left
    counted = client.messages.count_tokens(model=CLAUDE, messages=messages(repeats)).input_tokens
    request = {"model": CLAUDE, "max_tokens": 32000, "messages": messages(repeats)}
    message = client.messages.create(**request, extra_body={"temperature": 0})
    assert message.usage.input_tokens == counted
    assert message.usage.output_tokens <= 1024 - counted and message.stop_reason in ("end_turn", "max_tokens")

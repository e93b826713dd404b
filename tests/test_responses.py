"""POST /v1/responses through the official openai client: the reply of the same chat, in the
Responses shape, whole and streamed, every body and event checked against OpenAI's own API
document (../shared/data/openai/openapi.yaml) and the server's; function tools, text.format,
reasoning items, previous_response_id over the in-memory store, and a 400 for every field weft
cannot honour."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from checkpoints import build_chat_checkpoint
from conftest import shared_data
from test_server import API_KEY, MODEL, Server, assert_matches_spec, load_openai_spec

from weft import LLM, SamplingParams, bundled_model_path
from weft.server.responses_endpoint import ResponseStore, StoredResponse, UnknownResponse

TESTS = Path(__file__).resolve().parent

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The forecast for a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
    "strict": True,
}
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
TOOL_CALL = "151657"  # <tool_call> in the Qwen2.5 vocabulary


@pytest.fixture(scope="module")
def server(bundled_server):
    return bundled_server


@pytest.fixture(scope="module")
def spec():
    return load_openai_spec()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(bundled_model_path(), show_progress=False)


def stream_events(server: Server, body: dict) -> list[dict]:
    """The events of a streamed response (`events_of`)."""
    with server.streaming("/v1/responses", {**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return events_of(r.read().decode())


def events_of(text: str) -> list[dict]:
    """A Responses event stream's events, checking the framing: `event: TYPE`, `data: {...}` whose
    type is TYPE, a blank line after each, sequence numbers counting from 0."""
    events = []
    for block in text.strip("\n").split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


EXTRAS = ("seed", "logit_bias")  # weft's extras: extra_body for the openai client


def create(client: openai.OpenAI, body: dict):
    extras = {k: body[k] for k in EXTRAS if k in body}
    return client.responses.create(**{k: v for k, v in body.items() if k not in EXTRAS}, extra_body=extras)


def check_events(spec, events: list[dict]) -> None:
    """Each event against its own schema in OpenAI's document (one of ResponseStreamEvent's)."""
    schemas = spec["components"]["schemas"]
    by_type = {}
    for ref in schemas["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        for kind in schemas[name]["properties"]["type"].get("enum", []):
            by_type[kind] = name
    for event in events:
        assert_matches_spec(spec, by_type[event["type"]], event)


# ---- the bundled model ---------------------------------------------------------------------------


def test_a_response_is_the_chat_reply_in_the_responses_shape(client, offline, server, spec):
    request = {
        "input": "ROMEO:",
        "instructions": "Answer in verse.",
        "max_output_tokens": 8,
        "temperature": 0,
    }
    response = client.responses.create(model=MODEL, **request)
    messages = [{"role": "system", "content": "Answer in verse."}, {"role": "user", "content": "ROMEO:"}]
    (expected,) = offline.chat(messages, SamplingParams(max_tokens=8, temperature=0))
    (c,) = expected.outputs
    assert response.output_text == c.text
    assert response.status == ("incomplete" if c.finish_reason == "length" else "completed")
    assert response.usage.input_tokens == len(expected.prompt_token_ids)
    assert response.usage.output_tokens == len(c.token_ids) and response.usage.total_tokens == len(
        expected.prompt_token_ids
    ) + len(c.token_ids)
    assert response.instructions == "Answer in verse." and response.model == MODEL
    raw = server.post("/v1/responses", {"model": MODEL, **request})
    assert raw.status_code == 200
    assert_matches_spec(spec, "Response", raw.json())
    assert raw.json()["output"][0]["content"][0]["text"] == c.text


def test_input_items_are_the_chat_messages(client, offline):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Who goes "}]},
        {"role": "user", "content": [{"type": "input_text", "text": "there?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "A friend."}]},
        {"role": "user", "content": "Stand."},
    ]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=6, temperature=0)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who goes "},
        {"role": "user", "content": "there?"},
        {"role": "assistant", "content": "A friend."},
        {"role": "user", "content": "Stand."},
    ]
    (expected,) = offline.chat(messages, SamplingParams(max_tokens=6, temperature=0))
    assert response.output_text == expected.outputs[0].text
    assert response.usage.input_tokens == len(expected.prompt_token_ids)


def test_a_streamed_response_is_the_whole_one_event_by_event(client, server, spec):
    request = {"model": MODEL, "input": "Speak!", "max_output_tokens": 10, "temperature": 0}
    whole = client.responses.create(**request)
    events = stream_events(server, request)
    check_events(spec, events)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 1
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in deltas)
    assert text == whole.output_text == events[-4]["text"] == events[-3]["part"]["text"]
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"] == whole.usage.model_dump(
        exclude_none=True
    )
    item_ids = {e["item_id"] for e in deltas} | {events[-2]["item"]["id"], final["output"][0]["id"]}
    assert len(item_ids) == 1
    # and through the client's own event types
    streamed = list(client.responses.create(**request, stream=True))
    assert streamed[-1].response.output_text == whole.output_text


def test_text_format_holds_a_json_schema_and_json_object(client):
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
    }
    response = client.responses.create(
        model=MODEL,
        input="Who are you?",
        text={"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}},
        max_output_tokens=80,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), person)
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"
    response = client.responses.create(
        model=MODEL,
        input="JSON please",
        text={"format": {"type": "json_object"}},
        max_output_tokens=80,
        extra_body={"logit_bias": {"95": 30}},  # '}': the object closes at once
    )
    assert response.status == "completed" and json.loads(response.output_text) == {}


def test_previous_response_id_continues_the_conversation(client, offline):
    params = SamplingParams(max_tokens=6, temperature=0)
    first = client.responses.create(
        model=MODEL, input="ROMEO:", instructions="Be brief.", max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        model=MODEL, input="JULIET:", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    # instructions are not carried over; the earlier turns are
    history = [
        {"role": "user", "content": "ROMEO:"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "JULIET:"},
    ]
    (expected,) = offline.chat(history, params)
    assert second.output_text == expected.outputs[0].text
    assert second.usage.input_tokens == len(expected.prompt_token_ids)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.retrieve(first.id)


def test_store_false_keeps_nothing(client, server):
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL, input="More", previous_response_id=response.id)
    assert error.value.body["param"] == "previous_response_id"
    assert server.post("/v1/responses/" + response.id, {}).status_code == 405
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{server.url}/v1/responses/{response.id}", headers=headers).status_code == 404


def test_the_store_keeps_only_the_last_responses():
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"resp_{i}", StoredResponse({"id": i}, []))
    assert len(store) == 2 and store.get("resp_2").body == {"id": 2}
    with pytest.raises(UnknownResponse, match="the last 2"):
        store.get("resp_0")
    nothing = ResponseStore(0)
    nothing.put("resp_x", StoredResponse({}, []))
    assert len(nothing) == 0


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        (
            {"input": [{"type": "reasoning", "encrypted_content": "gAAAA-not-weft", "summary": []}]},
            "input[0].encrypted_content",
        ),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0]"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "json_schema", "schema": OK_SCHEMA}}}, "text.format.name"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format",
        ),
    ],
)
def test_what_weft_cannot_honour_is_a_400_naming_it(server, fields, param):
    response = server.post("/v1/responses", {"model": MODEL, "input": "Hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "response_format" not in error["message"] and "max_completion_tokens" not in error["message"]


def test_what_real_clients_send_and_changes_nothing_is_taken(server):
    """Codex CLI's first request carries fields that change nothing weft generates: its
    `client_metadata`, `reasoning.summary`, `include` entries for built-in tools' outputs, and
    built-in tools among its functions. They are taken; the built-in tools are left out of the
    prompt and named in the `x-weft-warning` header, a tool_choice naming one is still a 400."""
    body = {
        "model": MODEL,
        "input": "Hi",
        "max_output_tokens": 4,
        "client_metadata": {"session": "abc"},
        "reasoning": {"summary": "auto"},
        "include": ["web_search_call.action.sources"],
        "tools": [{"type": "web_search"}, WEATHER],
        "prompt_cache_key": "k",
        "store": False,
    }
    response = server.post("/v1/responses", body)
    assert response.status_code == 200, response.text
    assert "web_search" in response.headers["x-weft-warning"]
    assert response.json()["status"] in ("completed", "incomplete")
    with server.streaming("/v1/responses", {**body, "stream": True}) as r:
        assert r.status_code == 200 and "web_search" in r.headers["x-weft-warning"]
        r.read()
    plain = server.post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4})
    assert "x-weft-warning" not in plain.headers


def test_the_server_logs_why_it_refused_a_request():
    """Every 400 is in the server's log with its path, status, param and message; so are the
    built-in tools it left out."""
    server = Server()
    try:
        assert (
            server.post("/v1/responses", {"model": MODEL, "input": "Hi", "background": True}).status_code
            == 400
        )
        tools = [{"type": "web_search"}]
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "tools": tools}
        assert server.post("/v1/responses", body).status_code == 200
        assert server.post("/v1/chat/completions", {"model": MODEL, "messages": "x"}).status_code == 400
    finally:
        server.stop()
    log = server.process.stdout.read() if server.process.stdout else ""
    assert "POST /v1/responses refused with 400 (param background): background:" in log, log
    assert "tools of type web_search were left out" in log, log
    assert "POST /v1/chat/completions refused with 400 (param messages)" in log, log


def test_the_openapi_document_describes_the_responses_routes(server):
    document = httpx.get(f"{server.url}/openapi.json").json()
    create = document["paths"]["/v1/responses"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ResponsesRequest")
    ok = create["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("ResponseObject") and "text/event-stream" in ok
    assert {"400", "401", "404"} <= set(create["responses"])
    stored = document["paths"]["/v1/responses/{response_id}"]
    assert set(stored) == {"get", "delete"} and "404" in stored["get"]["responses"]
    assert server.wait_idle()["weft_kv_blocks_used"] == 0


# ---- tools and reasoning: a tiny random model over the Qwen2.5 tokenizer -------------------------


@pytest.fixture(scope="module")
def qwen(qwen_chat):
    out, server = qwen_chat
    return server, LLM(str(out), max_model_len=2048)


def call_request(**fields) -> dict:
    return {
        "model": "chat",
        "input": "Weather in Paris?",
        "tools": [WEATHER],
        "logit_bias": {TOOL_CALL: 100},  # the model starts a call at once
        "parallel_tool_calls": False,
        "max_output_tokens": 200,
        "seed": 3,
        **fields,
    }


def test_a_function_call_whole_and_streamed(qwen, spec):
    server, _ = qwen
    whole = create(server.client(), call_request())
    assert whole.status == "completed"
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = stream_events(server, call_request())
    check_events(spec, events)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [a["item"]["type"] for a in added] == ["function_call"] and added[0]["item"][
        "name"
    ] == "get_weather"
    fragments = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(fragments) > 1 and "".join(fragments) == call.arguments  # the same seed
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == call.arguments and done["name"] == "get_weather"
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["arguments"] == call.arguments


def test_a_tool_result_continues_from_the_stored_call_or_from_items(qwen):
    server, llm = qwen
    client = server.client()
    first = create(client, call_request())
    (call,) = first.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    stop_calls = {"logit_bias": {TOOL_CALL: -100}, "max_output_tokens": 4}
    chained = create(client, call_request(input=[output], previous_response_id=first.id, **stop_calls))
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        output,
    ]
    manual = create(client, call_request(input=items, **stop_calls))
    assert chained.output[0].type == "message" and chained.output_text == manual.output_text
    # the template saw the call's arguments as an object and the tool's output after it
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                   "arguments": call.arguments}}
        ]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    function = {k: v for k, v in WEATHER.items() if k != "type"}
    prompt = llm.tokenizer.apply_chat_template(messages, tools=[{"type": "function", "function": function}])
    assert f'"arguments": {call.arguments}' in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt
    assert chained.usage.input_tokens == manual.usage.input_tokens == len(llm.tokenizer.encode(prompt))


def test_a_required_or_named_call(qwen):
    server, _ = qwen
    client = server.client()
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        response = create(client, call_request(tool_choice=choice, logit_bias=None))
        (call,) = response.output
        assert call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """The tiny Qwen2.5-vocabulary model with DeepSeek-R1's template: replies open inside <think>."""
    out = build_chat_checkpoint(tmp_path_factory.mktemp("responses-r1"), shared_data("tokenizers/qwen2.5"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    template = shared_data("chat_templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    server = Server("--model", str(out), "--served-model-name", "chat", "--max-model-len", "2048")
    yield server
    server.stop()


def test_reasoning_is_an_item_before_the_answer_whole_and_streamed(thinking, spec):
    request = {
        "model": "chat",
        "input": "Is it ok?",
        "text": {"format": {"type": "json_schema", "name": "ok", "schema": OK_SCHEMA, "strict": True}},
        "logit_bias": {"522": 100, "26865": 100, "29": 100},  # '</', 'think', '>': the section ends soon
        "max_output_tokens": 120,
        "seed": 0,
    }
    whole = create(thinking.client(), request)
    assert whole.status == "completed"
    reasoning, message = whole.output
    assert (
        reasoning.type == "reasoning"
        and reasoning.content[0].text
        and "</think>" not in reasoning.content[0].text
    )
    jsonschema.validate(json.loads(message.content[0].text), OK_SCHEMA)
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    events = stream_events(thinking, request)
    check_events(spec, events)
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thought, answer) == (reasoning.content[0].text, message.content[0].text)
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]


def test_chat_usage_counts_the_reasoning_tokens(thinking):
    """Chat completions report the thinking section's tokens in usage, as OpenAI's
    `completion_tokens_details.reasoning_tokens` (the reasoning text, tokenized again)."""
    reply = thinking.client().chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Is it ok?"}],
        max_tokens=60,
        seed=0,
        extra_body={"logit_bias": {"522": 100, "26865": 100, "29": 100}},  # the section ends soon
    )
    reasoning = reply.choices[0].message.model_extra["reasoning_content"]
    details = reply.usage.completion_tokens_details
    assert reasoning and details is not None and 0 < details.reasoning_tokens <= reply.usage.completion_tokens


def test_sealed_reasoning_comes_back_on_the_next_turn(thinking, spec):
    """`include: ["reasoning.encrypted_content"]` with `store: false` (Codex CLI's way): reasoning
    items carry the thinking as opaque `encrypted_content`, whole and streamed; handed back with
    no content, it is the thinking of the assistant turn that follows it, as the whole item is."""
    request = {
        "model": "chat",
        "input": "Is it ok?",
        "logit_bias": {"522": 100, "26865": 100, "29": 100},
        "max_output_tokens": 40,
        "seed": 0,
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    whole = create(thinking.client(), request)
    reasoning = whole.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    events = stream_events(thinking, request)
    check_events(spec, events)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["type"] == "reasoning" and done[0]["encrypted_content"] == reasoning.encrypted_content
    from weft.server.responses_request import ResponsesRequest

    sealed = {"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content}
    full = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": reasoning.content[0].text}],
    }
    turn = [{"role": "user", "content": "Is it ok?"}, None, {"role": "assistant", "content": "yes"}]
    as_sealed = ResponsesRequest(input=[turn[0], sealed, turn[2]]).messages()
    as_text = ResponsesRequest(input=[turn[0], full, turn[2]]).messages()
    assert as_sealed == as_text and as_sealed[1]["reasoning_content"] == reasoning.content[0].text
    plain = create(thinking.client(), {k: v for k, v in request.items() if k != "include"})
    assert plain.output[0].encrypted_content is None


def test_a_stream_that_fails_ends_with_error_and_response_failed(spec):
    from types import SimpleNamespace

    from weft.server.responses_endpoint import ResponseRun, Responses
    from weft.server.responses_request import ResponsesRequest

    responses = Responses.__new__(Responses)
    responses.service = SimpleNamespace(model_name="m")  # type: ignore[assignment]
    run = ResponseRun(ResponsesRequest(input="x"), None, None, "resp_1", [])  # type: ignore[arg-type]
    run.events.feed({"content": "partial"})
    events = []
    for block in responses.failed(run, RuntimeError("the engine stopped")):
        kind, data = block.strip("\n").split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {events[-1]['type']}"
    check_events(spec, events)
    error, failed = events
    assert error["message"] == "the engine stopped" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == "the engine stopped"
    assert failed["response"]["output"][0]["content"][0]["text"] == "partial"


def test_codex_clis_first_request_streams_a_whole_response(qwen, spec):
    """Codex CLI 0.171's first request as it sent it (tests/data/agents; paths and ids replaced),
    with `max_output_tokens` added so that a random model stops: its fields (client_metadata,
    prompt_cache_key, include of encrypted reasoning, reasoning.summary, store: false) accepted, its
    built-in tools (namespace, web_search) left out with a warning, and a whole event stream."""
    recorded = json.loads((TESTS / "data/agents/codex-0.171-first-request.json").read_text())
    body = {**recorded["body"], "model": "chat", "max_output_tokens": 8}
    server, _ = qwen
    with server.streaming(recorded["path"], body, headers=recorded["headers"]) as r:
        assert r.status_code == 200, r.read()
        assert "namespace, web_search" in r.headers["x-weft-warning"]
        events = events_of(r.read().decode())
    check_events(spec, events)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    final = events[-1]["response"]  # a random model: it stopped, or ran into max_output_tokens
    assert kinds[-1] == f"response.{final['status']}" and final["status"] in ("completed", "incomplete")
    assert final["status"] == "completed" or final["incomplete_details"]["reason"] == "max_output_tokens"
    assert final["usage"]["input_tokens"] > 5000 and final["usage"]["output_tokens"] <= 8

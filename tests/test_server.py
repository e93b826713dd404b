"""`weft serve` run as users run it: a live server on a loopback port with the bundled model,
driven by the official `openai` client (and by raw HTTP where the framing itself is tested);
responses checked against the OpenAI OpenAPI spec."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import yaml
from conftest import shared_data
from pydantic import BaseModel, Field
from serving import await_health

from weft import LLM, SamplingParams, bundled_model_path

API_KEY = "test-key"
MODEL = "weft-default"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *options: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "WEFT_API_KEY": API_KEY}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weft",
                "serve",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *(
                    ()
                    if "--model" in options
                    else ("--model", str(bundled_model_path()), "--served-model-name", MODEL)
                ),
                *options,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        await_health(self.url, self.process, 120)

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        http = httpx.Client(timeout=60, event_hooks={"response": [self._check_sync]})
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, http_client=http)

    def async_client(self) -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(timeout=60, event_hooks={"response": [self._check_async]})
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, http_client=http)

    def post(self, path: str, body: dict, key: str = API_KEY, **options) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        response = httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=60, **options)
        self.check(response)
        return response

    # ---- every JSON body the tests receive is checked against the server's own /openapi.json ----

    checked = 0  # bodies checked so far (test_every_body_received_matched_the_document reads it)
    _document: dict | None = None

    def check(self, response: httpx.Response) -> None:
        if "application/json" not in response.headers.get("content-type", ""):
            return  # streams (text/event-stream), /metrics
        if self._document is None:
            self._document = httpx.get(f"{self.url}/openapi.json").json()
        path, method = response.request.url.path, response.request.method.lower()
        operation = self._document["paths"].get(path, {}).get(method)
        if operation is None:
            return  # an unknown route (its 404 is checked where it is asked)
        listed = operation["responses"].get(str(response.status_code))
        assert listed is not None, f"{method} {path} answered {response.status_code}, not in its document"
        schema = listed["content"]["application/json"]["schema"]
        jsonschema.validate(response.json(), {**schema, "components": self._document["components"]})
        Server.checked += 1

    def _check_sync(self, response: httpx.Response) -> None:
        if "application/json" in response.headers.get("content-type", ""):  # never a stream's body
            response.read()
            self.check(response)

    async def _check_async(self, response: httpx.Response) -> None:
        if "application/json" in response.headers.get("content-type", ""):
            await response.aread()
            self.check(response)

    @contextmanager
    def streaming(self, path: str, body: dict, headers: dict | None = None):
        headers = {**(headers or {}), "Authorization": f"Bearer {API_KEY}"}
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{self.url}{path}", json=body, headers=headers) as r,
        ):
            yield r

    def metrics(self) -> dict[str, float]:
        """Every sample, parsed by prometheus_client's own text parser: `name{label="value"}`
        (the model_name label, on every vllm: sample, checked and left out of the key)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = dict(sample.labels)
                if sample.name.startswith("vllm:"):
                    assert labels.pop("model_name") == MODEL, sample
                shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                values[sample.name + (f"{{{shown}}}" if shown else "")] = sample.value
        return values

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """The metrics once nothing runs and no KV block is in use (or whatever they are at the end)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["weft_kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0
            if (idle and m["vllm:num_requests_waiting"] == 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture(scope="module")
def server(bundled_server):
    return bundled_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(bundled_model_path(), show_progress=False)


def load_openai_spec() -> dict:
    """OpenAI's own API document (../shared/data/openai/openapi.yaml), `nullable` as JSON Schema."""
    with open(shared_data("openai/openapi.yaml")) as f:
        document = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return _nullable(document)


@pytest.fixture(scope="module")
def spec():
    return load_openai_spec()


def _nullable(node):
    """The spec is OpenAPI 3.1 but keeps some 3.0 `nullable: true`; JSON Schema spells that as a
    null alternative."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable(value) for key, value in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


def assert_matches_spec(spec, name: str, body: dict) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(body)


# ---- completions ---------------------------------------------------------------------------------


def test_completion_logprobs_equal_offline_generation(client, offline, spec, server):
    response = client.completions.create(
        model=MODEL, prompt="ROMEO:", max_tokens=8, temperature=0, logprobs=3
    )
    (expected,) = offline.generate("ROMEO:", SamplingParams(max_tokens=8, temperature=0, logprobs=3))
    choice = response.choices[0]
    assert choice.text == expected.outputs[0].text
    want = [
        p[t].logprob for p, t in zip(expected.outputs[0].logprobs, expected.outputs[0].token_ids, strict=True)
    ]
    assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 3 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset == expected.outputs[0].text_offsets
    assert response.usage.completion_tokens == 8 and response.usage.prompt_tokens == len(
        expected.prompt_token_ids
    )
    raw = server.post("/v1/completions", {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 8, "logprobs": 3})
    assert_matches_spec(spec, "CreateCompletionResponse", raw.json())


def test_completion_echo_puts_the_prompt_and_its_logprobs_first(client, offline):
    response = client.completions.create(
        model=MODEL, prompt="ROMEO: I", max_tokens=4, temperature=0, logprobs=1, echo=True
    )
    choice = response.choices[0]
    prompt_ids = offline.tokenizer.encode("ROMEO: I")
    assert choice.text.startswith("ROMEO: I")
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 4
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(prompt_ids)] == len("ROMEO: I")


def test_completion_prompt_forms_and_choice_indices(client):
    response = client.completions.create(model=MODEL, prompt=["ROMEO:", "JULIET:"], n=2, max_tokens=3, seed=1)
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def read_events(response: httpx.Response) -> list[str]:
    """The data of each server-sent event, checking the framing: 'data: ...', a blank line after each."""
    text = response.text
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events[:3]
    return [e[len("data: ") :] for e in events]


def test_completion_stream_framing_usage_and_done(server):
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 6, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = read_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    whole = server.post("/v1/completions", {**body, "stream": False}).json()
    assert text == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


# ---- chat ----------------------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_chat_json_schema_output_validates(client, spec, server):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who are you?"}],
        max_tokens=60,
        logprobs=True,
        top_logprobs=2,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    raw = server.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "logprobs": True},
    )
    assert_matches_spec(spec, "CreateChatCompletionResponse", raw.json())


def test_chat_stream_role_first_usage_and_done(server, spec):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Speak!"}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = read_events(server.post("/v1/chat/completions", body))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    for chunk in chunks:
        assert_matches_spec(spec, "CreateChatCompletionStreamResponse", chunk)


def test_chat_n_streams_interleave(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Speak!"}], max_tokens=10, n=3, stream=True, seed=2
    )
    order = [chunk.choices[0].index for chunk in stream if chunk.choices]
    assert set(order) == {0, 1, 2}
    assert order != sorted(order), "the choices' chunks did not interleave"
    whole = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Speak!"}], max_tokens=10, n=3, seed=2
    )
    finished = {c.index: c.message.content for c in whole.choices}
    assert len(finished) == 3


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_forced_tool_call_arguments_validate(client, tool_choice):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Verona?"}],
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=80,
        seed=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"


def test_streamed_tool_call(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Time?"}],
        tools=[TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=40,
        stream=True,
    )
    calls = [c for chunk in stream if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "logprobs": 500}, "max_logprobs"),
        ("/v1/completions", {"prompt": "x", "n": 1000}, "n="),
        ("/v1/completions", {"prompt": "x " * 3000}, "max_model_len"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "("}}, "regex"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"jsonschema": {}}}, "jsonschema"),
        (
            "/v1/completions",
            {"prompt": "x", "guided_decoding_backend": "xgrammar", "guided_jsn": {}},
            "guided_jsn",
        ),
        ("/v1/completions", {"prompt": "x", "guided_grammar": "start: (", "max_tokens": 2}, "grammar"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "nonsense"}},
                },
            },
            "json_schema",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tools",
        ),
    ],
)
def test_bad_requests_are_400_in_the_openai_shape(server, path, body, fragment):
    response = server.post(path, {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert fragment in error["message"] or fragment == error["param"], error


def test_error_classes_through_the_client(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").completions.create(model=MODEL, prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-2
        )
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 401
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_metrics_and_the_api_documents_answer_without_the_key_and_a_405_says_allow(server):
    from prometheus_client.parser import text_string_to_metric_families

    metrics = httpx.get(f"{server.url}/metrics")  # a Prometheus scraper has no key
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert any(f.name == "vllm:num_requests_running" for f in text_string_to_metric_families(metrics.text))
    assert httpx.get(f"{server.url}/openapi.json").status_code == 200
    assert httpx.get(f"{server.url}/docs").status_code == 200
    wrong = httpx.get(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"


def test_body_limit_and_queue_limit():
    small = Server("--max-pending", "1", "--max-body-bytes", "20000")
    try:
        big = small.post("/v1/completions", {"model": MODEL, "prompt": "x" * 30000})
        assert big.status_code == 413 and "body" in big.json()["error"]["message"]
        chunks = (b'{"model": "%s", "prompt": "' % MODEL.encode(), b"x" * 30000, b'"}')
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        chunked = httpx.post(f"{small.url}/v1/completions", content=iter(chunks), headers=headers, timeout=60)
        assert chunked.status_code == 413 and "body" in chunked.json()["error"]["message"]  # no length
        body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with small.streaming("/v1/completions", body) as first:
            lines = first.iter_lines()  # kept: dropping the iterator closes the connection
            assert next(lines).startswith("data: ")
            second = small.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
            assert second.status_code == 503, (second.text, small.url)
            assert second.json()["error"]["type"] == "server_overloaded"
        assert small.wait_idle()["weft_kv_blocks_used"] == 0  # the stream left: its request was aborted
    finally:
        small.stop()


# ---- concurrency, cancellation, shutdown ---------------------------------------------------------


async def one_request(aclient: openai.AsyncOpenAI, i: int) -> str:
    """Request i of a mixed load: plain, constrained, logprobs, n > 1, streamed, some cancelled."""
    messages = [{"role": "user", "content": f"Tell me {i}"}]
    kind = i % 6
    if kind == 0:
        r = await aclient.completions.create(model=MODEL, prompt=f"ROMEO {i}:", max_tokens=12, logprobs=2)
        assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens
    elif kind == 1:
        r = await aclient.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    elif kind == 2:
        r = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, n=3)
        assert len(r.choices) == 3
    elif kind == 3:
        stream = await aclient.completions.create(model=MODEL, prompt="JULIET:", max_tokens=12, stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        assert text
    elif kind == 4:  # cancelled mid-stream
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
        )
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break
        await stream.close()
        return "cancelled"
    else:
        r = await aclient.completions.create(
            model=MODEL, prompt="KING:", max_tokens=8, extra_body={"guided_regex": "[a-z]{3,8}"}
        )
        assert re.fullmatch("[a-z]{3,8}", r.choices[0].text)
    return "done"


def test_64_concurrent_mixed_requests_finish_or_cancel_cleanly(server):
    async def run_all() -> list[str]:
        aclient = server.async_client()
        try:
            return await asyncio.gather(*(one_request(aclient, i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert results.count("cancelled") == sum(1 for i in range(64) if i % 6 == 4)
    m = server.wait_idle()
    assert m["weft_kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0
    assert m["vllm:num_requests_waiting"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert m['weft_requests_total{status="ok"}'] >= 64 - results.count("cancelled")
    assert m['vllm:request_success_total{finished_reason="abort"}'] >= results.count("cancelled")


def test_metrics_expose_engine_state_and_latency(server, client):
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True
    ).close()
    for _ in client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=5, stream=True):
        pass
    m = server.metrics()
    for name in (
        "weft_kv_blocks_total",
        "weft_kv_blocks_used",
        "weft_num_sequences_running",
        "weft_num_sequences_waiting",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in m, name
    assert m["weft_kv_blocks_total"] > 0 and m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["vllm:inter_token_latency_seconds_count"] >= 4
    assert m["vllm:e2e_request_latency_seconds_count"] >= 2
    assert m['vllm:request_success_total{finished_reason="length"}'] >= 2
    assert m["vllm:prefix_cache_queries_total"] >= m["vllm:prefix_cache_hits_total"] > 0
    assert not any(k.startswith("weft_") and k.split("{")[0].removeprefix("weft_") in VLLM_NAMED for k in m)


# what vLLM names, which weft publishes only under vLLM's name
VLLM_NAMED = (
    "num_requests_running",
    "num_requests_waiting",
    "prompt_tokens_total",
    "generation_tokens_total",
    "time_to_first_token_seconds_count",
    "prefix_cache_hit_rate",
)


def test_num_requests_running_counts_requests_not_sequences(server):
    """During one n=4 request, vllm:num_requests_running reads 1 (its four sequences run)."""
    body = {"model": MODEL, "prompt": "ROMEO:", "n": 4, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with server.streaming("/v1/completions", body) as response:
        lines = response.iter_lines()
        for _ in range(12):
            next(lines)
        m = server.metrics()
        assert m["vllm:num_requests_running"] == 1 and m["weft_num_sequences_running"] == 4
    server.wait_idle(timeout=5)


def test_disconnect_mid_stream_frees_blocks_at_once(server):
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with server.streaming("/v1/completions", body) as response:
        lines = response.iter_lines()
        next(lines)
        next(lines)
        assert server.metrics()["weft_kv_blocks_used"] > 0
    m = server.wait_idle(timeout=5)
    assert m["weft_kv_blocks_used"] == 0


def test_sigterm_drains_in_flight_requests_then_exits():
    s = Server()
    try:
        body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with s.streaming("/v1/completions", body) as response:
            lines = response.iter_lines()
            next(lines)
            s.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert s.process.wait(timeout=30) == 0
    finally:
        s.stop()


def test_serve_help_documents_its_options():
    result = subprocess.run(
        [sys.executable, "-m", "weft", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    for flag in ("--model", "--host", "--port", "--api-key", "--served-model-name", "--max-num-seqs"):
        assert flag in result.stdout
    assert Path(__file__).exists()


def test_a_port_in_use_is_an_error_not_a_silent_exit(server):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "weft", "serve", "--port", str(server.port), "--log-level", "error"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert "could not serve" in result.stdout and "address already in use" in result.stderr


def test_logit_bias_and_vllm_extras_reach_the_sampler(client, offline):
    target = offline.tokenizer.encode(" the", add_special_tokens=False)[0]
    biased = client.completions.create(
        model=MODEL, prompt="ROMEO:", max_tokens=4, logit_bias={str(target): 100}, seed=3
    )
    assert biased.choices[0].text == offline.tokenizer.decode([target] * 4)
    extras = client.completions.create(
        model=MODEL,
        prompt="ROMEO:",
        max_tokens=6,
        extra_body={"top_k": 1, "min_tokens": 6, "ignore_eos": True, "repetition_penalty": 1.2},
    )
    params = SamplingParams(max_tokens=6, top_k=1, min_tokens=6, ignore_eos=True, repetition_penalty=1.2)
    (expected,) = offline.generate("ROMEO:", params)
    assert extras.choices[0].text == expected.outputs[0].text and extras.usage.completion_tokens == 6


# ---- the contract at its edges: closed objects, strict mode, context limits ---------------------


class PlainUser(BaseModel):  # no extra="forbid": objects left open by JSON Schema, closed by weft
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)
    nick: str | None = Field(default=None, max_length=6)


@pytest.mark.parametrize("strict", [None, True])
def test_a_plain_pydantic_model_gives_no_extra_keys_and_strict_gives_every_key(client, strict):
    json_schema: dict = {"name": "user", "schema": PlainUser.model_json_schema()}
    if strict is not None:
        json_schema["strict"] = strict
    closed = {**PlainUser.model_json_schema(), "additionalProperties": False}
    for seed in range(3):
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "A user, please."}],
            max_tokens=120,
            seed=seed,
            temperature=1.0,
            response_format={"type": "json_schema", "json_schema": json_schema},
        )
        document = json.loads(response.choices[0].message.content)
        jsonschema.validate(document, closed)
        PlainUser.model_validate(document)
        if strict:
            assert set(document) == {"name", "age", "nick"}


def test_a_strict_tool_gets_every_argument(client):
    tool = {
        "type": "function",
        "function": {"name": "make_user", "parameters": PlainUser.model_json_schema(), "strict": True},
    }
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Make a user."}],
        max_tokens=120,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "make_user"}},
    )
    (call,) = response.choices[0].message.tool_calls
    assert set(json.loads(call.function.arguments)) == {"name", "age", "nick"}


def test_the_server_option_keeps_json_schemas_open_meaning_unless_strict():
    from weft.schema_objects import JsonSchemaMode
    from weft.server.chat import _constraint
    from weft.server.cli import add_arguments
    from weft.server.protocol import ChatCompletionRequest

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).json_schema_mode == "closed"
    assert parser.parse_args(["--json-schema-mode", "open"]).json_schema_mode == "open"
    schema = PlainUser.model_json_schema()
    for strict, mode, expected in [
        (False, JsonSchemaMode.OPEN, JsonSchemaMode.OPEN),
        (None, JsonSchemaMode.CLOSED, JsonSchemaMode.CLOSED),
        (True, JsonSchemaMode.OPEN, JsonSchemaMode.STRICT),
    ]:
        spec = {"name": "u", "schema": schema, **({} if strict is None else {"strict": strict})}
        body = ChatCompletionRequest(
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": spec},
        )
        constraint, _, field = _constraint(body, mode)
        assert field == "response_format"
        assert constraint["json_schema_mode"] == expected
        params = body.sampling_params(100, constraint)
        assert ('"additionalProperties": false' in params.structured.value) == (expected != "open")


def test_empty_messages_and_a_prompt_that_leaves_no_room_are_400_naming_the_field(server):
    response = server.post("/v1/chat/completions", {"model": MODEL, "messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    prompt = "x " * 470  # 940 tokens (more in a chat) of the bundled model's 1,024
    for path, body, field in [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 100}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 100},
         "max_tokens"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": prompt}], "max_completion_tokens": 100},
         "max_completion_tokens"),
    ]:  # fmt: skip
        response = server.post(path, {"model": MODEL, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field
        assert f"plus {field} (100)" in error["message"] and "max_model_len 1024" in error["message"]
    unset = server.post(
        "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    )
    assert unset.status_code == 200 and unset.json()["choices"][0]["finish_reason"] == "length"


NONSENSE = {"type": "nonsense"}


@pytest.mark.parametrize(
    ("path", "body", "param", "start"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be"),
        ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p", "top_p must be"),
        ("/v1/completions", {"prompt": "x", "guided_regex": ""}, "guided_regex", "guided_regex must be"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "("}, "guided_regex", "invalid regex: "),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens",
         "max_completion_tokens must be"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "top_logprobs must"),
        ("/v1/chat/completions",
         {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": NONSENSE}}},
         "response_format", "invalid json_schema: "),
        ("/v1/completions", {"prompt": "x", "smc": {"num_particles": 4}}, "smc",
         "smc needs an output constraint"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a|b", "smc": {"num_particles": 0}},
         "smc.num_particles", "smc.num_particles must be"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a|b", "smc": {"bogus": 1}}, "smc.bogus",
         "smc.bogus: "),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a|b", "top_k": 5, "smc": {}}, "top_k",
         "top_k cannot be used with smc"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a|b", "stream": True, "smc": {}}, "stream",
         "smc cannot be streamed"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a|b", "n": 3, "smc": {"num_particles": 64}},
         "smc.num_particles", "n=3 runs of smc.num_particles=64"),
    ],
)  # fmt: skip
def test_errors_name_the_requests_own_field(server, path, body, param, start):
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "x"}], **body}
    error = server.post(path, {"model": MODEL, **body}).json()["error"]
    assert error["param"] == param and error["message"].startswith(start), error
    assert "SamplingParams" not in error["message"]
    assert not error["message"][len(start) :].startswith(start)  # said once, not "invalid x: invalid x:"


NAMES = ["ROMEO", "JULIET", "KING HENRY", "QUEEN MARGARET"]


def test_smc_particles_and_their_weights_through_the_client(client, offline, server):
    """weft's `smc`: each choice carries its log_weight, the response each run's log-marginal;
    the same request offline gives the same particles and weights (same seed); every body matches
    the server's document (checked as it arrives)."""
    smc = {"num_particles": 4, "output": "weighted", "end_of_text": False}
    response = client.completions.create(
        model=MODEL, prompt=["\n\n", "ROMEO:\n"], n=2, max_tokens=8, seed=3,
        extra_body={"guided_choice": NAMES, "smc": smc},
    )  # fmt: skip
    assert sorted(c.index for c in response.choices) == list(range(16))
    params = SamplingParams(choice=NAMES, n=2, max_tokens=8, seed=3, smc=smc)
    expected = offline.generate(["\n\n", "ROMEO:\n"], params)
    got = sorted(response.choices, key=lambda c: c.index)
    want = [c for out in expected for c in out.outputs]
    assert [c.text for c in got] == [c.text for c in want]
    assert [c.model_extra["log_weight"] for c in got] == pytest.approx([c.log_weight for c in want])
    runs = response.model_extra["smc"]
    assert len(runs) == 4 and all(r["num_particles"] == 4 for r in runs)
    assert [r["log_marginal"] for r in runs] == pytest.approx(
        [r.log_marginal for o in expected for r in o.smc]
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Who speaks?"}], max_tokens=8, seed=1,
        extra_body={"guided_choice": NAMES, "smc": {"num_particles": 8}},
    )  # fmt: skip
    assert len(chat.choices) == 1 and chat.choices[0].message.content in NAMES
    assert chat.choices[0].model_extra["log_weight"] <= 0.0
    assert len(chat.model_extra["smc"]) == 1
    assert server.wait_idle()["weft_kv_blocks_used"] == 0


def test_a_malformed_body_is_not_blamed_on_a_field(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "x", ', headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] is None and error["message"].startswith("the body is not valid JSON")


def test_the_openapi_document_describes_the_errors_the_server_sends(server):
    document = httpx.get(f"{server.url}/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(document)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = document["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "400", "401", "404", "413", "503"} <= set(responses)
        error = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error.endswith("/ErrorResponse")
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    body = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0})
    schema = {"$ref": "#/components/schemas/ErrorResponse", "components": document["components"]}
    jsonschema.validate(body.json(), schema)  # the body the server sent, as the document says
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"error": {"type": "x"}}, schema)  # (the check can fail)


def test_the_load_generator_measures_a_server_at_a_base_url(server, tmp_path):
    """`weft bench serve --base-url URL --model NAME`: the workload against a running server (here
    weft's own), every request answered and every token counted."""
    from weft.bench import serve as bench

    config = Path(__file__).resolve().parents[1] / "weft" / "default_model" / "config.json"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "load.json"
    args = parser.parse_args(
        ["--base-url", f"{server.url}/v1", "--model", MODEL, "--api-key", API_KEY, "--config", str(config),
         "--concurrency", "1,3", "--requests-per-client", "2", "--prompt-len", "8", "--output-len", "6",
         "--ramp", "0", "--json", str(out)]
    )  # fmt: skip
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    jobs = bench._jobs(json.loads(config.read_text())["vocab_size"], 6, args)
    for row, level in zip(rows, (1, 3), strict=True):
        assert row["concurrency"] == level and row["requests"] == 2 * level
        assert row["output_tokens"] == sum(job.output_len for job in jobs[: 2 * level])
        assert row["output_tps"] > 0 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    with pytest.raises(SystemExit, match="http://"):
        bench.Target.of("127.0.0.1:8000", None, None)


def test_every_body_received_matched_the_document(server):
    """(Runs last: the bodies of this module's requests, through the openai clients and `post`,
    were each validated against /openapi.json as they arrived.)"""
    assert Server.checked >= 40, Server.checked


# ---- schemathesis: requests generated from the document itself, bounded and seeded -------------


@pytest.fixture(scope="module")
def small_server():
    """A server whose requests stay short whatever the generator asks (64-token context)."""
    s = Server("--max-model-len", "64", "--max-num-seqs", "32")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_document(small_server):
    import schemathesis

    return schemathesis.openapi.from_url(f"{small_server.url}/openapi.json")


def test_the_server_keeps_the_contract_its_document_states(api_document):
    """Every operation of /openapi.json with generated bodies, valid and not: no 5xx, and each
    status, content type and body as the document states. (Not checked: that every body the
    document allows is accepted. JSON Schema cannot state what the server also requires: a
    regex, grammar or schema that compiles, token ids inside the vocabulary, a prompt and
    max_tokens inside the context, min_tokens <= max_tokens.) The cases are drawn with hypothesis
    from schemathesis' strategies directly, without its pytest plugin (whose lazy parametrization
    breaks on pytest 9.2)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode

    failures = []
    operations = [result.ok() for result in api_document.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:
        cases = st.one_of(
            operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        )

        @given(case=cases)
        @settings(max_examples=15, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(
                headers={"Authorization": f"Bearer {API_KEY}"},
                # (the negative generator's nulls and booleans satisfy the anyOf of an Optional field)
                excluded_checks=[
                    schemathesis.checks.positive_data_acceptance,
                    schemathesis.checks.negative_data_rejection,
                ],
            )

        try:
            check()
        except Exception as exc:  # every operation is checked; all failures are reported together
            causes = getattr(exc, "exceptions", ())  # hypothesis' flaky failures group what they saw
            failures.append("\n".join([f"{operation.label}: {exc}", *(f"  {cause!r}" for cause in causes)]))
    assert not failures, "\n\n".join(failures)

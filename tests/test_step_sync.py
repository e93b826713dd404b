"""A step reads the device back exactly once: the sampled tokens (and their logprobs) in one
transfer (`to_host`). On CPU every tensor is on the "device", so the test counts every conversion of
a tensor to host values during `engine.step()` outside that one call; on a GPU each would be a
synchronization."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import weft.sample.transfer as transfer_module
from weft import LLM, SamplingParams

CONVERSIONS = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy", "__array__", "cpu")


@pytest.fixture(scope="module", params=[False, True], ids=["in-turn", "lookahead"])
def llm(tiny_llama, request) -> LLM:
    return LLM(
        str(tiny_llama), show_progress=False, device="cpu", dtype="float32", async_scheduling=request.param
    )


def counting(monkeypatch, counts: Counter) -> None:
    inside = []  # non-empty while the one transfer runs: its own conversion is the transfer

    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            if not inside:
                counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    to_host = transfer_module.to_host

    def counted_to_host(tensor):
        counts["to_host"] += 1
        inside.append(True)
        try:
            return to_host(tensor)
        finally:
            inside.pop()

    monkeypatch.setattr(transfer_module, "to_host", counted_to_host)


def test_each_step_reads_the_device_back_once(llm, monkeypatch):
    engine = llm.engine
    requests = {
        "greedy": SamplingParams(temperature=0, max_tokens=12),
        "top": SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, seed=1, max_tokens=12),
        "logprobs": SamplingParams(
            temperature=0.7, seed=2, logprobs=5, logprobs_mode="processed", max_tokens=12
        ),
        "regex": SamplingParams(regex="[a-z]{3,20}", temperature=0.8, seed=3, max_tokens=12),
        "penalties": SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, seed=4, max_tokens=12),
        "n": SamplingParams(n=2, seed=5, max_tokens=12, min_tokens=3, stop=["e"]),
        "prompt": SamplingParams(prompt_logprobs=3, logprobs=2, max_tokens=12),
    }
    for request_id, params in requests.items():
        engine.add_request(request_id, "First Citizen:", params)
    num_steps = 0
    while engine.has_unfinished_requests():
        counts: Counter = Counter()
        with monkeypatch.context() as patch:
            counting(patch, counts)
            engine.step()
        num_steps += 1
        assert counts["to_host"] <= 1, counts
        conversions = {k: v for k, v in counts.items() if k != "to_host"}
        assert conversions == {}, conversions
    assert num_steps >= 12

"""Per-field confidence of JSON outputs: leaf paths, values, character spans, and the logprobs of
the tokens that wrote each value."""

from __future__ import annotations

import json
import math

import pytest

from weft import LLM, CompletionOutput, Logprob, SamplingParams, field_logprobs
from weft.fields import json_leaf_spans


def completion_from_pieces(pieces: list[tuple[str, float]]) -> CompletionOutput:
    """A completion whose i-th token wrote pieces[i][0] with logprob pieces[i][1]."""
    text, offsets = "", []
    for piece, _ in pieces:
        offsets.append(len(text))
        text += piece
    logprobs = [{i: Logprob(lp, 1)} for i, (_, lp) in enumerate(pieces)]
    return CompletionOutput(0, text, list(range(len(pieces))), logprobs=logprobs, text_offsets=offsets)


def test_paths_values_and_spans_of_nested_json():
    text = (
        '{"name": "Ana \\"A\\" B", "items": [{"price": 12.5e1}, {"price": -3}], '
        '"ok": true, "x y": null, "e": ""}'
    )
    leaves = json_leaf_spans(text)
    assert set(leaves) == {"$.name", "$.items[0].price", "$.items[1].price", "$.ok", '$["x y"]', "$.e"}
    assert leaves["$.name"][0] == 'Ana "A" B' and text[slice(*leaves["$.name"][1:])] == 'Ana \\"A\\" B'
    assert leaves["$.items[0].price"] == (125.0, text.index("12.5e1"), text.index("12.5e1") + 6)
    assert leaves["$.ok"][0] is True and leaves['$["x y"]'][0] is None
    assert text[slice(*leaves["$.e"][1:])] == '""'  # an empty string's span is its quotes


def test_numbers_split_across_tokens_sum_their_tokens():
    pieces = [
        ('{"a": ', -0.1),
        ("12", -1.0),
        ("34", -2.0),
        (', "b": [', -0.2),
        ('"x', -0.5),
        ('y"', -0.25),
        ("]}", 0.0),
    ]
    fields = field_logprobs(completion_from_pieces(pieces))
    assert fields["$.a"].value == 1234 and fields["$.a"].num_tokens == 2
    assert fields["$.a"].logprob == pytest.approx(-3.0) and fields["$.a"].min_logprob == -2.0
    assert fields["$.b[0]"].value == "xy" and fields["$.b[0]"].logprob == pytest.approx(-0.75)


def test_without_logprobs_or_json_is_a_clear_error():
    with pytest.raises(ValueError, match="logprobs"):
        field_logprobs(CompletionOutput(0, '{"a": 1}', [1, 2]))
    with pytest.raises(ValueError, match="not valid JSON"):
        field_logprobs(completion_from_pieces([('{"a": ', -1.0), ("1 x", -1.0)]))
    whole = field_logprobs(completion_from_pieces([('{"a": ', -1.0), ("1}", -1.0)]))
    assert not whole.partial


@pytest.mark.parametrize(
    "last", ["tru", ", ", ', "c', ', "c": ', ', "c": "unfin', ', "c": [', ', "c": [1, ', ', "c": [1']
)
def test_a_truncated_json_text_gives_the_leaves_written_whole_and_says_it_is_partial(last):
    """A completion cut by max_tokens: what can be attributed is, and `partial` says the rest is
    missing."""
    pieces = [('{"a": ', -0.5), ("12", -1.0), (', "b": ', -0.25), ('"xy"', -0.5)]
    if last == "tru":
        pieces[-1] = ("tru", -0.5)
    else:
        pieces.append((last, -2.0))
    fields = field_logprobs(completion_from_pieces(pieces))
    assert fields.partial
    assert fields["$.a"].value == 12 and fields["$.a"].logprob == pytest.approx(-1.0)
    assert ("$.b" in fields) == (last != "tru")
    assert set(fields) <= {"$.a", "$.b", "$.c[0]"}


def test_field_logprobs_of_a_generated_json_object(tiny_llama):
    llm = LLM(str(tiny_llama), show_progress=False, device="cpu", dtype="float32")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "tags": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "maxItems": 2,
            },
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    out = llm.generate(
        "Output:", SamplingParams(json_schema=schema, logprobs=2, max_tokens=300, seed=3), use_tqdm=False
    )
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop"
    data = json.loads(completion.text)
    fields = field_logprobs(completion)
    assert fields["$.name"].value == data["name"]
    assert [fields[f"$.tags[{i}]"].value for i in range(len(data["tags"]))] == data["tags"]
    chosen = [p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs, strict=True)]
    assert completion.cumulative_logprob == pytest.approx(sum(chosen))
    for field in fields.values():
        assert field.logprob <= field.min_logprob <= 0 and math.isfinite(field.logprob)
        start, end = field.span
        assert completion.text[start:end]

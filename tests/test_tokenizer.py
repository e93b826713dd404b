"""Incremental detokenization and stop strings with the real tokenizers in ../shared/data."""

from __future__ import annotations

import pytest
from conftest import shared_data

from weft.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer, render_chat_template

FAMILIES = ["gpt2", "llama2", "llama3", "mistral", "qwen2.5", "smollm2", "phi3", "falcon", "pythia-gpt-neox"]
TEXTS = [
    "Hello world",
    " leading space and  double  spaces\n\n\ttabs",
    "emoji 🙂🎉👩‍👩‍👧 mixed with text",
    "中文字符和日本語のテキスト 한국어",
    "naïve café — “quotes” ½ €100",
    "     \n\n   whitespace runs   \n",
    "byte fallback: \u0007\u001b[0m \U0001f9ec \u2603",
    "code: def f(x):\n    return x ** 2  # 😀",
]


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizer(request) -> Tokenizer:
    return Tokenizer.from_dir(shared_data(f"tokenizers/{request.param}"))


def stream_decode(tok: Tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    pieces = [detok.update([t]) for t in output_ids]
    pieces.append(detok.flush())
    return "".join(pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    prompt_ids = tokenizer.encode("Prompt:")
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(prompt_ids + output_ids)
    prefix = tokenizer.decode(prompt_ids)
    assert full.startswith(prefix)
    assert stream_decode(tokenizer, prompt_ids, output_ids) == full[len(prefix) :]


def test_no_partial_characters_are_emitted(tokenizer):
    ids = tokenizer.encode("🙂🎉 你好", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    for token in ids:
        assert "\ufffd" not in detok.update([token])


def test_stop_string_spanning_tokens_is_found(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    matcher = StopStringMatcher(["fox jumps"], include_in_output=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    produced, match = "", None
    for token in ids:
        piece = detok.update([token])
        produced += piece
        match = matcher.check(produced, len(piece))
        if match:
            break
    assert match is not None and match.stop == "fox jumps"
    assert match.text.strip() == "The quick brown"  # sentencepiece adds a leading space


def test_stop_string_included_and_earliest_wins():
    matcher = StopStringMatcher(["END", "ab"], include_in_output=True)
    assert matcher.check("xxabEND", 7).text == "xxab"
    assert matcher.check("no stop here", 12) is None


def test_chat_template_renders_real_template():
    template = shared_data("chat_templates/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    text = render_chat_template(
        template, [{"role": "user", "content": "Hi there"}], add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_is_sandboxed():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match=r"unsafe|not safely|access"):
        render_chat_template(evil, [])


def test_chat_template_raise_exception_becomes_value_error():
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", [])


def test_a_template_without_a_system_role_gets_it_before_the_first_user_turn():
    """Gemma's templates refuse a system message; weft puts its text before the first user
    message's (as Gemma 3's own template does), so that OpenAI-style conversations run; a template
    that still refuses says why."""
    template = shared_data("chat_templates/google-gemma-2-2b-it.jinja").read_text()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = render_chat_template(template, messages, bos_token="<bos>")
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ValueError, match="System role not supported"):
        render_chat_template(template, [messages[0]], bos_token="<bos>")
    # a system message mid-conversation (Anthropic's clients send them) goes before the next user turn
    later = [
        *messages,
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "Now French."},
    ]
    text = render_chat_template(template, [*later, {"role": "user", "content": "Bye"}], bos_token="<bos>")
    assert text.endswith("<start_of_turn>user\nNow French.\n\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert "Be brief.\n\nHi" in text


def test_special_tokens_from_config():
    tok = Tokenizer.from_dir(shared_data("tokenizers/llama2"))
    assert tok.bos_token == "<s>" and tok.eos_token_id == 2
    assert tok.encode("hi")[0] == 1  # the post-processor adds BOS

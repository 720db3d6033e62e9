"""Tokenizer: same ids, text and chat prompts as transformers' AutoTokenizer."""
from __future__ import annotations

import unicodedata
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.shared.tokenizer import Tokenizer
from weft.testing.tiny_model import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "café naïve 日本語 🙂 — done.",
    "  leading spaces\n\n\ttabs and 2048 digits",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x + 1\n",
    "",
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather <b>&</b> café",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi there"}],
    "system_multi_turn": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "日本語?"}],
    "tool_calls_and_results": [
        {"role": "user", "content": "Weather in Paris and Nice?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": "{\"city\": \"Nice\"}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "18C"},
        {"role": "tool", "tool_call_id": "b", "content": "20C"},
        {"role": "assistant", "content": "Both mild."}],
    "content_parts": [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                                   {"type": "text", "text": "part two"}]}],
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), "tiny", request.param)


@pytest.fixture(scope="module")
def ours(checkpoint) -> Tokenizer:
    return Tokenizer.from_dir(checkpoint)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers_with_and_without_special_tokens(ours, hf, text):
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_equals_transformers(ours, hf, text, skip):
    ids = hf.encode(text)
    assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_bos_is_prepended_only_where_the_post_processor_adds_it(ours, checkpoint):
    ids = ours.encode("hello")
    if checkpoint.name.startswith("llama"):
        assert ours.bos_token_id is not None and ids[0] == ours.bos_token_id
    else:
        assert ours.bos_token_id is None and ids == ours.encode("hello", add_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_round_trip_returns_the_nfc_normalised_text(ours, text):
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_non_ascii_round_trips(ours):
    text = "Ein Mädchen aß crème brûlée in 東京 🚀🎉"
    assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(ours, hf, name, with_tools, add_generation_prompt):
    messages = CONVERSATIONS[name]
    tools = TOOLS if with_tools else None
    expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                      tokenize=False)
    assert ours.apply_chat_template(messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt) == expected


def test_tool_results_render_as_one_user_turn_of_tool_responses(ours):
    text = ours.apply_chat_template(CONVERSATIONS["tool_calls_and_results"], add_generation_prompt=False)
    assert ("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n"
            "<tool_response>\n20C\n</tool_response><|im_end|>\n") in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text


def test_unknown_role_raises_template_error(ours):
    with pytest.raises(jinja2.TemplateError, match="narrator"):
        ours.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_chat_template_jinja_file_overrides_tokenizer_config(checkpoint, tmp_path):
    for path in checkpoint.iterdir():
        if path.suffix == ".json":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content | upper }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "HI"


def test_ids_beyond_the_tokenizer_vocab_decode_to_nothing(ours):
    hello = ours.encode("hello", add_special_tokens=False)
    beyond = [ours.vocab_size, ours.vocab_size + 5, 151_000]
    assert ours.decode(beyond) == ""
    assert ours.decode(hello + beyond + hello) == ours.decode(hello + hello)


def test_qwen2_model_vocab_is_padded_past_the_tokenizer(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2pad"), "tiny", "qwen2")
    tokenizer = Tokenizer.from_dir(ckpt)
    assert tokenizer.vocab_size < 1024
    assert tokenizer.decode(list(range(tokenizer.vocab_size, 1024))) == ""


def test_eos_ids_are_im_end_then_endoftext(ours):
    assert ours.eos_token_ids == (ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>"))


def test_vocab_size_counts_added_tokens_like_len_of_transformers(ours, hf):
    assert ours.vocab_size == len(hf)


def test_missing_tokenizer_json_raises_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_bounded_equals_encode_and_only_counts_what_is_over(ours, text):
    """The GIL-releasing encoder (run off the router's event loop) gives the same ids."""
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ours.encode_bounded(text, len(ids), special) == (len(ids), ids)
        if ids:
            assert ours.encode_bounded(text, len(ids) - 1, special) == (len(ids), None)


def test_no_text_over_the_character_budget_fits(ours):
    """The budget's claim on the families we ship: the densest text there is (the longest
    vocabulary entries, decoded) still needs more tokens than its length allows."""
    budget = ours.char_budget
    assert budget.max_chars_per_token is not None
    longest = sorted(range(ours.vocab_size), key=lambda i: -len(ours.decode([i], skip_special_tokens=False)))[:64]
    dense = ours.decode(longest * 8, skip_special_tokens=False)
    max_len = len(ours.encode(dense, add_special_tokens=False))
    limit = budget.max_chars(max_len, dense.isascii())
    assert len(dense) <= limit  # it fits its own token count, so the bound did not refuse it

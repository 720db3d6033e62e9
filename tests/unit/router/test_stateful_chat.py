"""A stateful chat hop sends only its new messages' tokens (issue 17): the scheduler
prepends the session's context, so the router renders the continuation, never the whole
template again (no system prompt, no tools block). On SmolLM2's template (in the repo,
``weft.models.chat_templates``) over the tiny checkpoint's tokenizer (its eos is
``<|im_end|>`` as SmolLM2's): context + continuation is exactly the whole conversation
rendered; tools still drive the tool grammar; a template that rewrites earlier turns
falls back to the full rendering."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from services.router.prepare import ChatPrompt, RequestPreparer
from services.router.validation import Limits
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_tool_calling import CALL, GGUF_TEMPLATE, TOOLS, _checkpoint, _post_chat
from weft.models.chat_templates import SMOLLM2_TOOLS_TEMPLATE

# Renders the last message apart from the others: its earlier turns change once more follow.
LAST_APART_TEMPLATE = ("{% for m in messages %}{% if loop.last %}[last]{% endif %}<|im_start|>{{ m.role }}\n"
                       "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                       "<|im_start|>assistant\n{% endif %}")
TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "18C"}


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("smol"), SMOLLM2_TOOLS_TEMPLATE)


def preparer(model_dir: Path) -> tuple[RequestPreparer, Tokenizer]:
    tokenizer = Tokenizer.from_dir(model_dir)
    return RequestPreparer(tokenizer, Limits(("tiny",), 4096, tokenizer.vocab_size)), tokenizer


def ids(p: RequestPreparer, messages, tools=None, continuation: bool = False) -> list[int]:
    return asyncio.run(p.prompt_ids(ChatPrompt(tuple(messages), tools), continuation=continuation))


def test_a_stateful_tool_result_hop_sends_only_the_turn_not_the_tools_block(smol_dir):
    tools = tuple(TOOLS)
    status, text, sent, tokenizer = _post_chat(smol_dir, {
        "messages": [TOOL_RESULT], "tools": TOOLS, "session_id": "s", "hop_index": 1, "session_stateful": True})
    assert status == 200, text
    sent_text = tokenizer.decode(sent[0].prompt_token_ids, skip_special_tokens=False)
    assert sent_text == "\n<|im_start|>tool\n18C<|im_end|>\n<|im_start|>assistant\n"
    p, _ = preparer(smol_dir)
    whole = ids(p, [TOOL_RESULT], tools)  # what was sent before: the system + tools block again
    assert len(sent[0].prompt_token_ids) < len(whole) // 5
    assert sent[0].sampling.grammar is not None  # the tools still drive the tool-call grammar


@pytest.mark.parametrize("with_tools", [True, False])
def test_context_plus_continuation_is_the_whole_conversation_rendered(smol_dir, with_tools):
    p, tokenizer = preparer(smol_dir)
    tools = tuple(TOOLS) if with_tools else None
    first = [{"role": "user", "content": "Weather in Paris?"}]
    hop0 = ids(p, first, tools)
    reply = tokenizer.encode('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>',
                             add_special_tokens=False) + [tokenizer.token_to_id("<|im_end|>")]
    context = hop0 + reply  # what the scheduler recorded: hop 0's prompt + its output, end-of-turn included
    new = [TOOL_RESULT, {"role": "user", "content": "And Nice?"}]
    call_turn = {"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    whole = ids(p, [*first, call_turn, *new], tools)
    assert context + ids(p, new, tools, continuation=True) == whole


def test_no_default_system_prompt_is_injected_again(tmp_path):
    p, tokenizer = preparer(_checkpoint(tmp_path, GGUF_TEMPLATE))  # injects SmolLM's system prompt
    sent = tokenizer.decode(ids(p, [{"role": "user", "content": "Hi"}], continuation=True), skip_special_tokens=False)
    assert "SmolLM" not in sent and sent == "\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_falls_back_to_the_full_rendering_logged_once(tmp_path):
    p, tokenizer = preparer(_checkpoint(tmp_path, LAST_APART_TEMPLATE))
    with capture_logs() as logs:
        first = ids(p, [TOOL_RESULT], continuation=True)
        ids(p, [TOOL_RESULT], continuation=True)
    assert first == ids(p, [TOOL_RESULT])  # the full rendering, as before
    assert [e["event"] for e in logs].count("stateful_chat_full_render") == 1


def test_a_stateless_hop_still_renders_the_whole_template(smol_dir):
    status, text, sent, tokenizer = _post_chat(smol_dir, {
        "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "session_id": "s", "hop_index": 0})
    assert status == 200, text
    assert "<tools>" in tokenizer.decode(sent[0].prompt_token_ids, skip_special_tokens=False)
    assert json.loads(text)["object"] == "chat.completion"

"""Tool calling through the HTTP API with SmolLM2's templates on the tiny checkpoint (no
processes, no real model): an assistant turn that only calls tools (content null or
absent) is accepted and rendered, and SmolLM2's reply form, a JSON array inside one
``<tool_call>``, comes back as OpenAI tool calls, streamed or not."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.schema import TokenChunk, TokenRequest
from services.shared.tokenizer import Tokenizer
from weft.models.chat_templates import SMOLLM2_TOOLS_TEMPLATE
from weft.testing.tiny_model import make_tiny_checkpoint

MODEL = "tiny"
# tokenizer.chat_template of SmolLM2-135M-Instruct.Q4_1.gguf: concatenates message['content'].
GGUF_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _checkpoint(root: Path, template: str) -> Path:
    model_dir = make_tiny_checkpoint(root / MODEL)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("smol"), SMOLLM2_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("gguf"), GGUF_TEMPLATE)


class FakeDownstream:
    """Streams the tokens of ``reply`` one per chunk and records the requests."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.reply = "Hello"
        self.requests: list[TokenRequest] = []

    async def generate(self, request: TokenRequest, timeout_s: float):
        self.requests.append(request)
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
        for n, tok in enumerate(ids, 1):
            yield TokenChunk((tok,), (), "stop" if n == len(ids) else None, len(request.prompt_token_ids), 0, n, "e")


def _post_chat(model_dir: Path, body: dict, reply: str = "Hello") -> tuple[int, str, list[TokenRequest], Tokenizer]:
    """POST one chat completion; (status, body text, requests sent downstream, tokenizer)."""
    async def go():
        tokenizer = Tokenizer.from_dir(model_dir)
        fake = FakeDownstream(tokenizer)
        fake.reply = reply
        limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=2048)
        client = TestClient(TestServer(HttpApi(Generator(tokenizer, limits, fake), KeyStore({}), MODEL).app(1 << 20)))
        await client.start_server()
        try:
            resp = await client.post("/v1/chat/completions", json={"model": MODEL, **body})
            return resp.status, await resp.text(), fake.requests, tokenizer
        finally:
            await client.close()
    return asyncio.run(go())


def _tool_call_turn(content: str) -> dict:
    turn = {"role": "assistant", "tool_calls": [CALL]}
    if content != "absent":
        turn["content"] = None
    return turn


@pytest.mark.parametrize("content", ["null", "absent"])
def test_an_assistant_turn_with_only_tool_calls_is_accepted_by_a_template_that_reads_content(gguf_dir, content):
    """Was a 400 "'dict object' has no attribute 'content'": the template gets content ""."""
    messages = [{"role": "user", "content": "Weather?"}, _tool_call_turn(content),
                {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    status, text, sent, tokenizer = _post_chat(gguf_dir, {"messages": messages})
    assert status == 200, text
    prompt = tokenizer.decode(sent[0].prompt_token_ids, skip_special_tokens=False)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n18C<|im_end|>\n" in prompt


@pytest.mark.parametrize("content", ["null", "absent"])
def test_smollm2_template_renders_the_tool_call_turn_sent_downstream(smol_dir, content):
    messages = [{"role": "user", "content": "Weather?"}, _tool_call_turn(content),
                {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    status, text, sent, tokenizer = _post_chat(smol_dir, {"messages": messages, "tools": TOOLS})
    assert status == 200, text
    prompt = tokenizer.decode(sent[0].prompt_token_ids, skip_special_tokens=False)
    assert '<tools>[{"name": "get_weather", "parameters": ' in prompt
    assert prompt.endswith('<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<tool_call>[{"name": '
                           '"get_weather", "arguments": {"city": "Paris"}}]</tool_call><|im_end|>\n'
                           "<|im_start|>tool\n18C<|im_end|>\n<|im_start|>assistant\n")


def _sse(text: str) -> list[dict]:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _streamed_calls(deltas: list[dict]) -> list[dict]:
    """OpenAI's streamed calls put together: a call's first delta has its index, id and
    name; later ones with that index carry argument fragments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:
            assert d["id"] and d["type"] == "function" and d["function"]["name"]
            calls[d["index"]] = {"id": d["id"], "function": {"name": d["function"]["name"], "arguments": ""}}
        calls[d["index"]]["function"]["arguments"] += d["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True])
def test_smollm2s_array_reply_becomes_one_openai_tool_call_per_element(smol_dir, stream):
    reply = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "get_weather", "arguments": {"city": "Nice"}}]</tool_call>')
    status, text, _, _ = _post_chat(smol_dir, {"messages": [{"role": "user", "content": "Paris and Nice?"}],
                                               "tools": TOOLS, "stream": stream}, reply)
    assert status == 200, text
    if stream:
        chunks = _sse(text)
        calls = _streamed_calls([tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])])
        assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        message = json.loads(text)["choices"][0]["message"]
        calls, reason = message["tool_calls"], json.loads(text)["choices"][0]["finish_reason"]
        assert message["content"] is None
    assert reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Nice"})]


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_array_block_stays_content(smol_dir, stream):
    reply = '<tool_call>[{"name": "get_weather"}, "oops"]</tool_call>'
    status, text, _, _ = _post_chat(smol_dir, {"messages": [{"role": "user", "content": "x"}],
                                               "tools": TOOLS, "stream": stream}, reply)
    assert status == 200, text
    if stream:
        chunks = _sse(text)
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = json.loads(text)["choices"][0]
        content, reason = choice["message"]["content"], choice["finish_reason"]
        assert "tool_calls" not in choice["message"]
    assert content == reply and reason == "stop"

"""The in-process fake downstream and request helpers of the issue-15 HTTP tests
(``test_openai_agent_io.py``, ``test_openai_logprobs_n.py``): no processes, no model."""
from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer

from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.schema import TokenChunk, TokenRequest
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_http import MODEL

CHAT = ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
COMPLETION = ("/v1/completions", {"model": MODEL, "prompt": "Say:", "max_tokens": 8})
REPLY = "Hello there"
BLOCK = 4  # the fake's prefix-cache block size


class AgentFake:
    """Streams ``REPLY`` one token per chunk with logprob -0.5, alternatives (token, -0.5),
    (3, -1.5) cut to ``top_logprobs``, and prompt logprobs -1.0 when asked. Logs every
    request's start and first token, and reports cached tokens as a prefix cache would:
    the full blocks of a prompt some earlier request already produced a token for."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: list[TokenRequest] = []
        self.events: list[tuple[str, str]] = []
        self.cached_prompts: set[tuple[int, ...]] = set()
        self.cached: dict[str, int] = {}
        self.cancelled: list[str] = []
        self.all_cancelled = asyncio.Event()  # every request started so far was cancelled
        self.fail: Exception | None = None
        self.gate: asyncio.Event | None = None
        self.reply = REPLY

    async def generate(self, request: TokenRequest, timeout_s: float):
        self.requests.append(request)
        self.events.append(("start", request.request_id))
        if self.fail is not None:
            raise self.fail
        s, prompt = request.sampling, request.prompt_token_ids
        for _ in range(3):  # "prefill": hand the loop to anything else that could start now
            await asyncio.sleep(0)
        cached = len(prompt) // BLOCK * BLOCK if prompt in self.cached_prompts else 0
        self.cached[request.request_id] = cached
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)[: s.max_tokens]
        try:
            for n, tok in enumerate(ids, 1):
                if n == 2 and self.gate is not None:
                    await self.gate.wait()
                first = n == 1
                alts = ((tok, -0.5), (3, -1.5))[: s.top_logprobs]
                prompt_lps = (-1.0,) * (len(prompt) - 1) if first and s.prompt_logprobs is not None else ()
                prompt_top = (((4, -2.0),)[: s.prompt_logprobs],) * len(prompt_lps)
                last = n == len(ids)
                reason = ("length" if n == s.max_tokens else "stop") if last else None
                if first:
                    self.events.append(("token", request.request_id))
                    self.cached_prompts.add(prompt)
                yield TokenChunk((tok,), (-0.5,) if s.logprobs else (), reason, len(prompt), cached, n, "executor-1",
                                 top_logprobs=(alts,) if s.top_logprobs else (), prompt_logprobs=prompt_lps,
                                 prompt_top_logprobs=prompt_top if s.prompt_logprobs else ())
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled.append(request.request_id)
            if len(self.cancelled) == len(self.requests):
                self.all_cancelled.set()
            raise


class FakeEmbeddings:
    def __init__(self) -> None:
        self.calls: list[tuple[object, str]] = []

    def model_card(self) -> dict:
        return {"id": "mini", "object": "model", "created": 0, "owned_by": "weft"}

    async def handle(self, body, tenant):
        from aiohttp import web
        self.calls.append((body, tenant))
        return web.json_response({"object": "list", "data": []})


async def client_for(model_dir, embeddings=None):  # noqa: F811
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = AgentFake(tokenizer)
    limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)
    api = HttpApi(Generator(tokenizer, limits, fake), KeyStore({}), MODEL, embeddings=embeddings)
    client = TestClient(TestServer(api.app(1 << 22)))
    await client.start_server()
    return client, fake, tokenizer


def post(model_dir, cases, setup=None, embeddings=None):  # noqa: F811
    async def go():
        client, fake, tokenizer = await client_for(model_dir, embeddings)
        if setup:
            setup(fake)
        try:
            out = []
            for path, body in cases:
                resp = await client.post(path, json=body)
                out.append((resp.status, await resp.text()))
            return out, fake, tokenizer
        finally:
            await client.close()
    return asyncio.run(go())


def one(model_dir, endpoint, extra, setup=None):  # noqa: F811
    path, base = endpoint
    [(status, text)], fake, tokenizer = post(model_dir, [(path, {**base, **extra})], setup)
    return status, (json.loads(text) if not extra.get("stream") or status != 200 else sse(text)), fake, tokenizer


def sse(text: str) -> list[dict]:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]

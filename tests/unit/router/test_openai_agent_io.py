"""Issue 15 at the OpenAI HTTP door, against an in-process fake downstream (no processes,
no model): structured output, logprobs, echo, n completions, sampler fields, embeddings."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import xgrammar as xg
from aiohttp.test_utils import TestClient, TestServer
from xgrammar.testing import _is_grammar_accept_string

from services.router.auth import KeyStore
from services.router.errors import InvalidRequestError
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.scheduler_client import domain_error
from services.router.schema import TokenChunk, TokenRequest
from services.router.structured_output import MAX_GRAMMAR_CHARS
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_http import MODEL, model_dir  # noqa: F401  (fixture)

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


async def _client(model_dir, embeddings=None):  # noqa: F811
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = AgentFake(tokenizer)
    limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)
    api = HttpApi(Generator(tokenizer, limits, fake), KeyStore({}), MODEL, embeddings=embeddings)
    client = TestClient(TestServer(api.app(1 << 22)))
    await client.start_server()
    return client, fake, tokenizer


def _post(model_dir, cases, setup=None, embeddings=None):  # noqa: F811
    async def go():
        client, fake, tokenizer = await _client(model_dir, embeddings)
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


def _one(model_dir, endpoint, extra, setup=None):  # noqa: F811
    path, base = endpoint
    [(status, text)], fake, tokenizer = _post(model_dir, [(path, {**base, **extra})], setup)
    return status, (json.loads(text) if not extra.get("stream") or status != 200 else _sse(text)), fake, tokenizer


def _sse(text: str) -> list[dict]:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


# -- structured output ---------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("endpoint, extra, grammar", [
    (CHAT, {"response_format": {"type": "json_object"}}, ("json_object", "")),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}},
     ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    (COMPLETION, {"response_format": {"type": "json_object"}}, ("json_object", "")),
    (CHAT, {"guided_json": SCHEMA}, ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    (COMPLETION, {"guided_json": json.dumps(SCHEMA)}, ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    (CHAT, {"guided_regex": "[a-z]+"}, ("regex", "[a-z]+")),
    (COMPLETION, {"guided_grammar": 'root ::= "a"'}, ("ebnf", 'root ::= "a"')),
    (CHAT, {"structured_outputs": {"regex": "x+"}}, ("regex", "x+")),
    (CHAT, {"regex": "y+"}, ("regex", "y+")), (CHAT, {"ebnf": 'root ::= "b"'}, ("ebnf", 'root ::= "b"')),
    (COMPLETION, {"json_schema": SCHEMA}, ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
], ids=lambda v: str(v)[:40])
def test_each_structured_output_form_reaches_the_executor_as_its_grammar(model_dir, endpoint, extra, grammar):  # noqa: F811
    status, body, fake, _ = _one(model_dir, endpoint, extra)
    assert status == 200, body
    assert fake.requests[0].sampling.grammar == grammar


def test_guided_choice_is_a_regex_that_xgrammar_compiles_and_that_accepts_exactly_the_choices(model_dir):  # noqa: F811
    choices = ["yes", "no (maybe)", "a.b|c", 'q"uote', "new\nline"]
    status, body, fake, _ = _one(model_dir, CHAT, {"guided_choice": choices})
    assert status == 200, body
    kind, regex = fake.requests[0].sampling.grammar
    grammar = xg.Grammar.from_regex(regex)
    assert kind == "regex" and all(_is_grammar_accept_string(grammar, c) for c in choices)
    assert not any(_is_grammar_accept_string(grammar, w) for w in ("ye", "no", "aXb|c", "yesno", "a.b"))


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"), ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"), ({"guided_choice": ["a", 3]}, "guided_choice[1]"),
    ({"guided_choice": ["a"] * 257}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),  # two forms
    ({"guided_regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}}},
     "response_format.json_schema.schema"),  # a huge schema
], ids=lambda v: str(v)[:50])
def test_a_bad_structured_output_is_400_naming_the_field_and_nothing_goes_downstream(model_dir, extra, field):  # noqa: F811
    status, body, fake, _ = _one(model_dir, CHAT, extra)
    assert status == 400, body
    assert body["error"]["param"] == field, body
    assert fake.requests == []


def test_scheduler_client_maps_the_executors_grammar_refusal_to_a_field_error():
    err = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details="grammar.json_schema: unsupported keyword 'foo'")
    exc = domain_error(err)
    assert isinstance(exc, InvalidRequestError) and exc.field == "grammar.json_schema"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, field", [({"response_format": {"type": "json_schema", "json_schema": {
    "name": "c", "schema": SCHEMA}}}, "response_format"), ({"guided_regex": "(("}, "guided_regex")])
def test_a_grammar_the_executor_cannot_compile_is_400_naming_the_clients_field(model_dir, extra, field, stream):  # noqa: F811
    def setup(fake):
        fake.fail = InvalidRequestError("grammar.json_schema", "unsupported keyword 'foo'")
    status, body, _, _ = _one(model_dir, CHAT, {**extra, "stream": stream}, setup)
    assert status == 400, body
    assert body["error"]["param"] == field and "unsupported keyword 'foo'" in body["error"]["message"]


def test_other_executor_refusals_keep_their_field(model_dir):  # noqa: F811
    def setup(fake):
        fake.fail = InvalidRequestError("sampling.logit_bias", "bad")
    status, body, _, _ = _one(model_dir, CHAT, {"response_format": {"type": "json_object"}}, setup)
    assert status == 400 and body["error"]["param"] == "sampling.logit_bias"


# -- logprobs --------------------------------------------------------------------------
def test_chat_logprobs_carry_token_logprob_bytes_and_alternatives(model_dir):  # noqa: F811
    status, body, fake, tok = _one(model_dir, CHAT, {"logprobs": True, "top_logprobs": 2})
    assert status == 200, body
    assert (fake.requests[0].sampling.logprobs, fake.requests[0].sampling.top_logprobs) == (True, 2)
    content = body["choices"][0]["logprobs"]["content"]
    ids = tok.encode(REPLY, add_special_tokens=False)
    assert [c["token"] for c in content] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(c["token"] for c in content) == REPLY
    for c in content:
        assert c["logprob"] == -0.5 and c["bytes"] == list(c["token"].encode())
        assert [a["logprob"] for a in c["top_logprobs"]] == [-0.5, -1.5]
        assert c["top_logprobs"][0]["token"] == c["token"]
        assert c["top_logprobs"][1] == {"token": tok.decode([3], skip_special_tokens=False), "logprob": -1.5,
                                        "bytes": list(tok.decode([3], skip_special_tokens=False).encode())}


def test_chat_logprobs_stream_per_chunk_and_add_up_to_the_reply(model_dir):  # noqa: F811
    status, chunks, _, tok = _one(model_dir, CHAT, {"logprobs": True, "top_logprobs": 1, "stream": True})
    assert status == 200
    entries = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert len(entries) == len(tok.encode(REPLY, add_special_tokens=False))
    assert "".join(e["token"] for e in entries) == REPLY and all(len(e["top_logprobs"]) == 1 for e in entries)


def test_no_logprobs_asked_means_logprobs_null(model_dir):  # noqa: F811
    status, body, fake, _ = _one(model_dir, CHAT, {})
    assert body["choices"][0]["logprobs"] is None and not fake.requests[0].sampling.logprobs


@pytest.mark.parametrize("endpoint, extra, field", [
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"), (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"logprobs": 1}, "logprobs"), (COMPLETION, {"logprobs": 21}, "logprobs"),
    (COMPLETION, {"logprobs": True}, "logprobs"), (COMPLETION, {"logprobs": -1}, "logprobs"),
])
def test_bad_logprobs_are_400_naming_the_field(model_dir, endpoint, extra, field):  # noqa: F811
    status, body, fake, _ = _one(model_dir, endpoint, extra)
    assert status == 400 and body["error"]["param"] == field, body
    assert fake.requests == []


def test_completions_logprobs_have_tokens_offsets_and_top_dicts(model_dir):  # noqa: F811
    status, body, fake, tok = _one(model_dir, COMPLETION, {"logprobs": 1})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == body["choices"][0]["text"] == REPLY
    assert lp["token_logprobs"] == [-0.5] * len(lp["tokens"])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert all(d == {t: -0.5} for d, t in zip(lp["top_logprobs"], lp["tokens"]))
    assert fake.requests[0].sampling.prompt_logprobs is None  # no echo: the prompt is not scored


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_returns_the_prompt_then_the_completion_prompt_first_logprob_null(model_dir, stream):  # noqa: F811
    status, body, fake, tok = _one(model_dir, COMPLETION, {"echo": True, "logprobs": 1, "stream": stream})
    assert status == 200, body
    sent = fake.requests[0]
    assert sent.sampling.prompt_logprobs == 1
    choices = [c["choices"][0] for c in body] if stream else body["choices"]
    text = "".join(c["text"] for c in choices)
    assert text == "Say:" + REPLY
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    logprobs = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    prompt_len = len(sent.prompt_token_ids)
    assert tokens[:prompt_len] == [tok.decode([i], skip_special_tokens=False) for i in sent.prompt_token_ids]
    assert logprobs[0] is None and logprobs[1:prompt_len] == [-1.0] * (prompt_len - 1)
    assert logprobs[prompt_len:] == [-0.5] * len(tok.encode(REPLY, add_special_tokens=False))


def test_echo_with_max_tokens_0_scores_the_prompt_only(model_dir):  # noqa: F811
    """The log-likelihood eval pattern: one token is generated (the executor cannot do
    none) and dropped; the response is the prompt, its logprobs, and zero completion tokens."""
    status, body, fake, tok = _one(model_dir, COMPLETION, {"echo": True, "logprobs": 0, "max_tokens": 0})
    assert status == 200, body
    assert fake.requests[0].sampling.max_tokens == 1
    choice = body["choices"][0]
    assert choice["text"] == "Say:" and choice["finish_reason"] == "length"
    prompt_len = len(fake.requests[0].prompt_token_ids)
    assert choice["logprobs"]["token_logprobs"] == [None] + [-1.0] * (prompt_len - 1)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == prompt_len


def test_max_tokens_0_without_echo_is_still_400(model_dir):  # noqa: F811
    status, body, fake, _ = _one(model_dir, COMPLETION, {"max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"


# -- n completions ---------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_n_completions_fan_out_after_the_first_token_and_reuse_its_cached_prompt(model_dir, endpoint):  # noqa: F811
    status, body, fake, tok = _one(model_dir, endpoint, {"n": 3, "seed": 7})
    assert status == 200, body
    first = fake.requests[0].request_id
    assert fake.events[:2] == [("start", first), ("token", first)]  # the first ran alone until its token
    assert sorted(r.sampling.seed for r in fake.requests) == [7, 8, 9] and all(r.sampling.n == 1 for r in fake.requests)
    assert len({r.request_id for r in fake.requests}) == 3
    assert [fake.cached[r.request_id] > 0 for r in fake.requests] == [False, True, True]  # prefix cache hits
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    num_out = len(tok.encode(REPLY, add_special_tokens=False))
    prompt_len = len(fake.requests[0].prompt_token_ids)
    assert body["usage"]["prompt_tokens"] == prompt_len  # the prompt once
    assert body["usage"]["completion_tokens"] == 3 * num_out


def test_n_streamed_chunks_carry_their_index_and_each_choice_finishes(model_dir):  # noqa: F811
    status, chunks, _, _ = _one(model_dir, CHAT, {"n": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in mine) == REPLY
        assert mine[-1]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] > 0


def test_n_completions_of_several_prompts_are_indexed_prompt_major(model_dir):  # noqa: F811
    status, body, fake, _ = _one(model_dir, COMPLETION, {"prompt": ["a", "b b"], "n": 2, "echo": True})
    assert status == 200, body
    assert [(c["index"], c["text"][:3]) for c in body["choices"]] == [(0, "aHe"), (1, "aHe"), (2, "b b"), (3, "b b")]


def test_a_client_gone_mid_stream_cancels_every_completion(model_dir):  # noqa: F811
    async def go():
        client, fake, _ = await _client(model_dir)
        fake.gate = asyncio.Event()  # every completion stops after its first token
        try:
            path, base = CHAT
            resp = await client.post(path, json={**base, "n": 3, "stream": True})
            while len([e for e in fake.events if e[0] == "token"]) < 3:
                await resp.content.readline()
            resp.close()
            await asyncio.wait_for(fake.all_cancelled.wait(), 30)  # a hang fails, never blocks the suite
            assert len(fake.requests) == 3
            assert sorted(fake.cancelled) == sorted(r.request_id for r in fake.requests)
        finally:
            await client.close()
    asyncio.run(go())


@pytest.mark.parametrize("extra, field", [({"n": 10**6}, "n"), ({"n": 0}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
                                          ({"n": 2.5}, "n")])
def test_bad_n_is_400_naming_the_field(model_dir, extra, field):  # noqa: F811
    status, body, fake, _ = _one(model_dir, CHAT, extra)
    assert status == 400 and body["error"]["param"] == field, body
    assert fake.requests == []


def test_best_of_equal_to_n_is_served(model_dir):  # noqa: F811
    status, body, fake, _ = _one(model_dir, COMPLETION, {"n": 2, "best_of": 2})
    assert status == 200 and len(body["choices"]) == 2


# -- sampler fields --------------------------------------------------------------------
def test_sampler_fields_reach_the_downstream_request(model_dir):  # noqa: F811
    status, body, fake, _ = _one(model_dir, CHAT, {"logit_bias": {"17": -100, "5": 2.5}, "min_p": 0.1,
                                                   "repetition_penalty": 1.2, "presence_penalty": 0.5,
                                                   "frequency_penalty": -0.5})
    assert status == 200, body
    s = fake.requests[0].sampling
    assert s.logit_bias == ((5, 2.5), (17, -100.0))
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (0.1, 1.2, 0.5, -0.5)


@pytest.mark.parametrize("extra, field", [
    ({"logit_bias": {str(i): 1 for i in range(10**5)}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias.999999"), ({"logit_bias": {"x": 1}}, "logit_bias.x"),
    ({"logit_bias": {"-1": 1}}, "logit_bias.-1"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"), ({"logit_bias": [1]}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
], ids=lambda v: str(v)[:40])
def test_bad_sampler_fields_are_400_naming_the_field(model_dir, extra, field):  # noqa: F811
    status, body, fake, _ = _one(model_dir, CHAT, extra)
    assert status == 400 and body["error"]["param"] == field, body
    assert fake.requests == []


# -- tools -----------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_parallel_tool_calls_false_reaches_the_formats_grammar(model_dir):  # noqa: F811
    results, fake, _ = _post(model_dir, [(CHAT[0], {**CHAT[1], "tools": TOOLS, "tool_choice": "required",
                                                   "parallel_tool_calls": p}) for p in (True, False)])
    assert [s for s, _ in results] == [200, 200]
    parallel, single = (r.sampling.grammar for r in fake.requests)
    assert parallel[0] == single[0] == "structural_tag" and parallel != single


def test_tool_choice_none_forbids_the_call_marker_and_parses_nothing(model_dir):  # noqa: F811
    status, body, fake, _ = _one(model_dir, CHAT, {"tools": TOOLS, "tool_choice": "none"})
    kind, text = fake.requests[0].sampling.grammar
    assert status == 200 and kind == "structural_tag" and json.loads(text)["format"]["type"] == "any_text"
    assert body["choices"][0]["message"]["content"] == REPLY


# -- embeddings ------------------------------------------------------------------------
def test_embeddings_route_reaches_the_handler_and_its_model_is_listed(model_dir):  # noqa: F811
    emb = FakeEmbeddings()

    async def go():
        client, _, _ = await _client(model_dir, emb)
        try:
            resp = await client.post("/v1/embeddings", json={"model": "mini", "input": "x"})
            assert resp.status == 200
            models = await (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [MODEL, "mini"]
        finally:
            await client.close()
    asyncio.run(go())
    assert [body for body, _ in emb.calls] == [{"model": "mini", "input": "x"}]


def test_embeddings_without_an_embedding_model_is_404(model_dir):  # noqa: F811
    [(status, text)], _, _ = _post(model_dir, [("/v1/embeddings", {"model": "mini", "input": "x"})])
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"


CUT_CALLS = '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_ti'


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_by_max_tokens_keeps_its_complete_calls_and_says_length(model_dir, stream):  # noqa: F811
    def setup(fake):
        fake.reply = CUT_CALLS

    cut = len(Tokenizer.from_dir(model_dir).encode(CUT_CALLS, add_special_tokens=False))
    status, body, _, _ = _one(model_dir, CHAT, {"tools": TOOLS, "tool_choice": "required", "stream": stream,
                                                "max_tokens": cut}, setup)
    assert status == 200
    if stream:
        reasons = [c["choices"][0]["finish_reason"] for c in body if c.get("choices") and c["choices"][0]["finish_reason"]]
        names = [tc["function"]["name"] for c in body if c.get("choices")
                 for tc in c["choices"][0]["delta"].get("tool_calls") or () if "function" in tc and tc["function"].get("name")]
        assert reasons == ["length"] and names == ["get_time"]
    else:
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]


@pytest.mark.parametrize("stream", [False, True])
def test_n_completions_score_the_prompt_once_and_every_choice_echoes_its_logprobs(model_dir, stream):  # noqa: F811
    """Prompt logprobs bar the prefix cache, so n completions that each asked for them
    would each prefill the whole prompt: only the first asks, the others reuse its KV and
    are handed its prompt logprobs."""
    prompt = "word " * 12
    status, body, fake, _ = _one(model_dir, COMPLETION, {"prompt": prompt, "echo": True, "logprobs": 0, "n": 3,
                                                          "stream": stream})
    assert status == 200, body
    assert [r.sampling.prompt_logprobs for r in fake.requests] == [0, None, None]
    assert [fake.cached[r.request_id] > 0 for r in fake.requests] == [False, True, True]
    prompt_len = len(fake.requests[0].prompt_token_ids)
    by_index: dict[int, list] = {}
    for choice in ([c["choices"][0] for c in body] if stream else body["choices"]):
        if choice["logprobs"]:
            by_index.setdefault(choice["index"], []).extend(choice["logprobs"]["token_logprobs"])
    assert sorted(by_index) == [0, 1, 2]
    for lps in by_index.values():
        assert lps[:prompt_len] == [None] + [-1.0] * (prompt_len - 1)

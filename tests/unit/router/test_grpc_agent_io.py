"""Issue 15's fields at the public gRPC door, over a real grpc.aio server on loopback with
a scripted downstream (no mesh): grammars, logprobs, logit bias, min_p, penalties, n,
echo, tools / tool_choice / parallel_tool_calls, and calls parsed out of the stream."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from services.mesh.grpc_server import GrpcServer
from services.router.auth import KeyStore
from services.router.errors import InvalidRequestError
from services.router.generation import Generator, model_limits
from services.router.grpc_tools import ToolCallRelay
from services.router.schema import Sampling, TokenChunk, TokenRequest
from services.router.server import ROUTER_ERROR_RULES, RouterServicer, add_router_to_server
from services.router.tool_parsers import FORMATS
from services.router.validation import parse_chat_request
from services.shared.tokenizer import Tokenizer
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

MODEL = "tiny"
KEY = (("authorization", "Bearer sk-1"),)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = router_pb2.ToolDefinition(name="get_weather", description="Weather of a city", parameters_json=json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


class ScriptedDownstream:
    """Streams ``reply`` one token per chunk with two alternatives each, and the prompt's
    logprobs on the first chunk when asked; records every request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.reply = "Hello there"
        self.requests: list[TokenRequest] = []
        self.refuse_grammar = False  # answer as the executor does a grammar it cannot compile

    async def generate(self, request: TokenRequest, timeout_s: float):
        self.requests.append(request)
        if self.refuse_grammar:
            raise InvalidRequestError(f"grammar.{request.sampling.grammar[0]}", "cannot compile")
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)[: request.sampling.max_tokens]
        n_prompt = len(request.prompt_token_ids)
        for n, tok in enumerate(ids, 1):
            first = n == 1 and request.sampling.prompt_logprobs is not None
            yield TokenChunk(
                (tok,), (-0.5,), ("stop" if n == len(ids) else None), n_prompt, 0, n, "executor-7",
                top_logprobs=(((tok, -0.5), (3, -1.5)),),
                prompt_logprobs=tuple(-1.0 - i for i in range(n_prompt - 1)) if first else (),
                prompt_top_logprobs=tuple(((4, -0.25),) for _ in range(n_prompt - 1)) if first else ())


async def _call(model_dir, request: router_pb2.GenerateRequest, reply: str = "Hello there",
                refuse_grammar: bool = False):
    """(chunks, downstream) of one Generate call; raises the call's AioRpcError."""
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = ScriptedDownstream(tokenizer)
    fake.reply, fake.refuse_grammar = reply, refuse_grammar
    generator = Generator(tokenizer, model_limits(model_dir, tokenizer, [MODEL], max_model_len=512), fake)
    server = GrpcServer("weft.v1.Router", "127.0.0.1", 0, rules=ROUTER_ERROR_RULES)
    add_router_to_server(RouterServicer(generator, KeyStore({"sk-1": "acme"}), MODEL), server.server)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            return [c async for c in stub.Generate(request, metadata=KEY)], fake
    finally:
        await server.server.stop(0)


def run(model_dir, request, reply="Hello there", refuse_grammar=False):
    return asyncio.run(_call(model_dir, request, reply, refuse_grammar))


def chat(*messages: router_pb2.ChatMessage, **kwargs) -> router_pb2.GenerateRequest:
    msgs = messages or (router_pb2.ChatMessage(role="user", content="Weather in Paris?"),)
    return router_pb2.GenerateRequest(chat=router_pb2.ChatMessages(messages=msgs, add_generation_prompt=True), **kwargs)


@pytest.mark.parametrize("grammar, expected", [
    (common_pb2.Grammar(json_schema='{"type": "object"}'), ("json_schema", '{"type": "object"}')),
    (common_pb2.Grammar(json_object=True), ("json_object", "")),
    (common_pb2.Grammar(regex="[a-z]+"), ("regex", "[a-z]+")),
    (common_pb2.Grammar(ebnf='root ::= "yes" | "no"'), ("ebnf", 'root ::= "yes" | "no"')),
    (common_pb2.Grammar(structural_tag='{"type": "structural_tag"}'), ("structural_tag", '{"type": "structural_tag"}')),
])
def test_every_grammar_kind_reaches_the_downstream_request(model_dir, grammar, expected):
    _, fake = run(model_dir, router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(grammar=grammar)))
    assert fake.requests[0].sampling.grammar == expected


def test_sampler_fields_reach_the_downstream_request_and_unset_ones_take_https_defaults(model_dir):
    sampling = common_pb2.SamplingParams(logit_bias={5: -100.0, 2: 2.5}, min_p=0.1, repetition_penalty=1.2,
                                         presence_penalty=0.5, frequency_penalty=-0.5, logprobs=True,
                                         top_logprobs=2, prompt_logprobs=1)
    _, fake = run(model_dir, router_pb2.GenerateRequest(text="hi", sampling=sampling))
    s = fake.requests[0].sampling
    assert s.logit_bias == ((2, 2.5), (5, -100.0)) and s.min_p == pytest.approx(0.1)
    assert s.repetition_penalty == pytest.approx(1.2) and (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5)
    assert (s.logprobs, s.top_logprobs, s.prompt_logprobs, s.n) == (True, 2, 1, 1)
    _, fake = run(model_dir, chat())  # nothing set: what /v1/chat/completions makes of a body without them
    tokenizer = Tokenizer.from_dir(model_dir)
    http = parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                              model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)).sampling
    got = fake.requests[0].sampling
    for name in ("temperature", "top_p", "logit_bias", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "top_logprobs", "prompt_logprobs", "grammar", "n", "logprobs"):
        assert getattr(got, name) == getattr(http, name) == getattr(Sampling(), name), name


def test_logprobs_alternatives_and_prompt_logprobs_ride_the_chunks(model_dir):
    sampling = common_pb2.SamplingParams(logprobs=True, top_logprobs=2, prompt_logprobs=1, max_tokens=3)
    chunks, fake = run(model_dir, router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]),
                                                             sampling=sampling))
    assert [list(c.logprobs_delta) for c in chunks] == [[-0.5]] * 3
    for c in chunks:
        (alts,) = c.top_logprobs_delta
        assert list(alts.token_ids) == [c.token_ids_delta[0], 3] and list(alts.logprobs) == [-0.5, -1.5]
    assert list(chunks[0].prompt_logprobs) == [-1.0, -2.0]  # every prompt token after the first
    assert [list(p.token_ids) for p in chunks[0].prompt_top_logprobs] == [[4], [4]]
    assert not any(c.prompt_logprobs for c in chunks[1:])
    plain, _ = run(model_dir, router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=2)))
    assert not any(c.logprobs_delta or c.top_logprobs_delta or c.prompt_logprobs for c in plain)


def test_n_completions_are_separate_requests_whose_chunks_are_tagged_by_index(model_dir):
    sampling = common_pb2.SamplingParams(n=3, seed=7, max_tokens=16)
    num_tokens = len(Tokenizer.from_dir(model_dir).encode("Hello there", add_special_tokens=False))
    chunks, fake = run(model_dir, router_pb2.GenerateRequest(text="hi", sampling=sampling))
    assert len(fake.requests) == 3 and all(r.sampling.n == 1 for r in fake.requests)
    assert sorted(r.sampling.seed for r in fake.requests) == [7, 8, 9]  # each reproducible, all different
    assert len({r.request_id for r in fake.requests}) == 3
    for i in range(3):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text_delta for c in mine) == "Hello there"
        assert sum(len(c.token_ids_delta) for c in mine) == num_tokens
        assert mine[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_echo_puts_the_prompt_before_each_completions_text(model_dir):
    sampling = common_pb2.SamplingParams(n=2, max_tokens=16)
    chunks, _ = run(model_dir, router_pb2.GenerateRequest(text="Say: ", echo=True, sampling=sampling))
    for i in range(2):
        assert "".join(c.text_delta for c in chunks if c.index == i) == "Say: Hello there"


def test_a_tool_call_leaves_whole_once_and_its_markup_leaves_the_text(model_dir):
    request = chat(tools=[WEATHER])
    chunks, fake = run(model_dir, request, reply="Checking." + CALL)
    calls = [call for c in chunks for call in c.tool_calls]
    assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")
    assert "".join(c.text_delta for c in chunks) == "Checking."
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS  # HTTP's "tool_calls"
    sent = fake.requests[0]
    assert sent.sampling.grammar[0] == "structural_tag" and "get_weather" in sent.sampling.grammar[1]
    assert "get_weather" in Tokenizer.from_dir(model_dir).decode(sent.prompt_token_ids)  # tools rendered


def test_parallel_calls_each_leave_once(model_dir):
    second = CALL.replace("Paris", "Oslo")
    chunks, _ = run(model_dir, chat(tools=[WEATHER]), reply=CALL + "\n" + second)
    calls = [json.loads(call.arguments_json)["city"] for c in chunks for call in c.tool_calls]
    assert calls == ["Paris", "Oslo"] and "".join(c.text_delta for c in chunks) == ""
    assert len({call.id for c in chunks for call in c.tool_calls}) == 2


@pytest.mark.parametrize("request_, field", [
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(
        grammar=common_pb2.Grammar(regex="[a-z]+"))), "sampling.grammar.regex"),
    (chat(tools=[WEATHER]), "tool_choice"),  # the tools' structural tag
])
def test_a_grammar_the_executor_cannot_compile_is_named_as_the_client_sent_it(model_dir, request_, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(model_dir, request_, refuse_grammar=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: cannot be enforced"), err.value.details()


def test_tool_choice_none_parses_nothing_and_forbids_the_call_marker(model_dir):
    request = chat(tools=[WEATHER], tool_choice=router_pb2.ToolChoice(mode=router_pb2.ToolChoice.MODE_NONE))
    chunks, fake = run(model_dir, request, reply=CALL)  # (the fake ignores grammars)
    assert not any(c.tool_calls for c in chunks) and "".join(c.text_delta for c in chunks) == CALL
    kind, text = fake.requests[0].sampling.grammar
    assert kind == "structural_tag" and json.loads(text)["format"]["excludes"] == ["<tool_call>"]


def test_forced_function_and_no_parallel_calls_shape_the_grammar(model_dir):
    forced = chat(tools=[WEATHER, router_pb2.ToolDefinition(name="get_time")], parallel_tool_calls=False,
                  tool_choice=router_pb2.ToolChoice(mode=router_pb2.ToolChoice.MODE_FUNCTION,
                                                    function_name="get_time"))
    _, fake = run(model_dir, forced, reply=CALL)
    grammar = fake.requests[0].sampling.grammar[1]
    assert "get_time" in grammar and "get_weather" not in grammar


def test_beside_auto_the_callers_grammar_wins(model_dir):
    request = chat(tools=[WEATHER], sampling=common_pb2.SamplingParams(grammar=common_pb2.Grammar(regex="[a-z]+")))
    _, fake = run(model_dir, request, reply=CALL)
    assert fake.requests[0].sampling.grammar == ("regex", "[a-z]+")


def test_assistant_tool_calls_are_rendered_into_the_prompt(model_dir):
    history = (
        router_pb2.ChatMessage(role="user", content="Weather in Paris?"),
        router_pb2.ChatMessage(role="assistant", tool_calls=[router_pb2.ToolCall(
            id="call_1", name="get_weather", arguments_json='{"city": "Paris"}')]),
        router_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    )
    _, fake = run(model_dir, chat(*history, tools=[WEATHER]))
    prompt = Tokenizer.from_dir(model_dir).decode(fake.requests[0].prompt_token_ids)
    assert '"city": "Paris"' in prompt and "sunny" in prompt


@pytest.mark.parametrize("request_, field", [
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(grammar=common_pb2.Grammar())),
     "sampling.grammar"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(
        grammar=common_pb2.Grammar(json_object=False))), "sampling.grammar.json_object"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(
        grammar=common_pb2.Grammar(json_schema="{nope"))), "sampling.grammar.json_schema"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(
        grammar=common_pb2.Grammar(regex=""))), "sampling.grammar.regex"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(top_logprobs=2)), "sampling.top_logprobs"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(logprobs=True, top_logprobs=21)),
     "sampling.top_logprobs"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(prompt_logprobs=21)),
     "sampling.prompt_logprobs"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(logit_bias={5000: 1.0})),
     "sampling.logit_bias.5000"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(logit_bias={5: 101.0})),
     "sampling.logit_bias.5"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(min_p=1.5)), "sampling.min_p"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(presence_penalty=3)),
     "sampling.presence_penalty"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(frequency_penalty=-3)),
     "sampling.frequency_penalty"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(repetition_penalty=0)),
     "sampling.repetition_penalty"),
    (router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(n=100000)), "sampling.n"),
    (router_pb2.GenerateRequest(text="x", tools=[WEATHER]), "tools"),
    (chat(tools=[router_pb2.ToolDefinition(name="bad name")]), "tools[0].function.name"),
    (chat(tools=[router_pb2.ToolDefinition(name="f", parameters_json="{")]), "tools[0].parameters_json"),
    (chat(tools=[router_pb2.ToolDefinition(name="f", parameters_json='{"type": "string"}')]),
     "tools[0].function.parameters"),
    (chat(tools=[WEATHER], tool_choice=router_pb2.ToolChoice(mode=router_pb2.ToolChoice.MODE_FUNCTION)),
     "tool_choice.function_name"),
    (chat(tools=[WEATHER], tool_choice=router_pb2.ToolChoice(mode=router_pb2.ToolChoice.MODE_FUNCTION,
                                                             function_name="nope")), "tool_choice"),
    (chat(tool_choice=router_pb2.ToolChoice(mode=router_pb2.ToolChoice.MODE_REQUIRED)), "tool_choice"),
    (chat(tool_choice=router_pb2.ToolChoice(mode=9)), "tool_choice.mode"),
    (chat(tools=[WEATHER], tool_choice=router_pb2.ToolChoice(mode=router_pb2.ToolChoice.MODE_REQUIRED),
          sampling=common_pb2.SamplingParams(grammar=common_pb2.Grammar(regex="a"))), "tool_choice"),
    (chat(tools=[WEATHER], parallel_tool_calls=False,
          sampling=common_pb2.SamplingParams(grammar=common_pb2.Grammar(regex="a"))), "parallel_tool_calls"),
    (chat(echo=True), "echo"),
    (chat(router_pb2.ChatMessage(role="user", content="x", tool_calls=[router_pb2.ToolCall(name="f")])),
     "chat.messages[0].tool_calls"),
])
def test_bad_agent_io_fields_are_invalid_argument_naming_the_field(model_dir, request_, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(model_dir, request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "Sure." + CALL + "\n" + CALL.replace("Paris", "Oslo")),
    ("smollm2", 'Sure.<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'),
])
def test_the_relay_sends_each_call_once_whole_however_the_text_is_split(fmt, text):
    for step in (1, 3, len(text)):
        relay, out, calls = ToolCallRelay(FORMATS[fmt]), [], []
        for i in range(0, len(text), step):
            piece, got = relay.feed(text[i:i + step])
            out.append(piece)
            calls += got
        piece, got = relay.flush()
        out.append(piece)
        calls += got
        assert "".join(out) == "Sure." and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Oslo"]


@pytest.mark.parametrize("schema, field", [
    ('{"type": "object", "not": {}}', "sampling.grammar.json_schema.not"),
    ('{"type": "number", "maximum": NaN}', "sampling.grammar.json_schema"),
])
def test_a_grpc_schema_the_grammar_would_not_keep_is_refused_like_http(model_dir, schema, field):
    request = router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
        max_tokens=4, grammar=common_pb2.Grammar(json_schema=schema)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(model_dir, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()

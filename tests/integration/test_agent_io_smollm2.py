"""Issue 15's "done means", through the official ``openai`` client against SmolLM2-135M-Instruct
served by a real mesh (`weft up`, one executor): structured output, forced tool calls,
logprobs, echo (and max_tokens 0 scoring), n > 1, and /v1/embeddings.

Every constrained request is sampled three times at temperature 0.7 with distinct seeds and
once greedily (json_schema also twice at the default temperature 1.0), and every sample must
conform: the grammar, not luck, makes the output valid.
Requests of one kind are sent together so the engine batches them (and the grammar bitmask
is exercised across a batch). One mesh for the module; small max_tokens throughout.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.smollm2_mesh import SmolMesh, schema_errors, smollm2_mesh

SAMPLINGS = [{"temperature": 0.7, "seed": seed} for seed in (1, 2, 3)] + [{"temperature": 0.0}]
# Structured output also at OpenAI's default temperature (unset: 1.0), what most clients send.
SCHEMA_SAMPLINGS = SAMPLINGS + [{"seed": 11}, {"seed": 12}]

SCHEMAS: dict[str, dict] = {
    "nested_person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40},
                               "country": {"type": "string", "maxLength": 40}},
                "required": ["city", "country"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "priority": {"type": "integer", "enum": [1, 2, 3]},
            "escalate": {"type": "boolean"},
        },
        "required": ["sentiment", "priority", "escalate"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"product": {"type": "string", "maxLength": 30},
                                   "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
            },
            "tags": {"type": "array", "items": {"type": "string", "enum": ["urgent", "gift", "bulk"]},
                     "maxItems": 3},
        },
        "required": ["items", "tags"],
        "additionalProperties": False,
    },
    # Optional fields beside required ones: only the required ones must appear.
    "required_and_optional": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
            "genre": {"type": "string", "enum": ["drama", "comedy", "sci-fi"]},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["title", "year"],
        "additionalProperties": False,
    },
}
PROMPTS = {
    "nested_person": "Invent a person: their name, age and the city and country they live in. Answer in JSON.",
    "enums": "Classify this support ticket: 'My order arrived broken and nobody answers!' Answer in JSON.",
    "arrays": "List a small grocery order with quantities, and tag it. Answer in JSON.",
    "required_and_optional": "Describe a famous film: its title and year. Answer in JSON.",
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "description": "Current local time in an IANA time zone.",
    "parameters": {"type": "object",
                   "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TOOL_MESSAGES = [{"role": "user",
                  "content": "I'm flying to Tokyo tonight. What's the weather there, and what time is it?"}]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> SmolMesh:
    with smollm2_mesh(tmp_path_factory.mktemp("agent-io")) as served:
        yield served


def together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls concurrently (so the engine batches them); results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def test_the_test_validator_rejects_what_it_should():
    # schema_errors (smollm2_mesh.py) decides every structured-output test: it must be able to fail.
    schema = SCHEMAS["arrays"]
    assert schema_errors({"items": [{"product": "tea", "quantity": 2}], "tags": ["gift"]}, schema) == []
    assert schema_errors({"items": [], "tags": []}, schema)  # minItems
    assert schema_errors({"items": [{"product": "tea", "quantity": 0}], "tags": []}, schema)  # minimum
    assert schema_errors({"items": [{"product": "tea", "quantity": 1}], "tags": ["x"]}, schema)  # enum
    assert schema_errors({"items": [{"product": "tea", "quantity": 1}]}, schema)  # required
    assert schema_errors({"items": [{"product": "tea", "quantity": 1, "x": 1}], "tags": []}, schema)  # additional
    assert schema_errors({"sentiment": "positive", "priority": True, "escalate": False}, SCHEMAS["enums"])


# -- 1. response_format ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_conforms_on_every_sample(mesh, name):
    client, schema = mesh.openai(), SCHEMAS[name]
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}

    def ask(sampling):
        return client.chat.completions.create(
            model=mesh.model, messages=[{"role": "user", "content": PROMPTS[name]}],
            response_format=response_format, max_tokens=160, **sampling)

    for sampling, reply in zip(SCHEMA_SAMPLINGS, together([lambda s=s: ask(s) for s in SCHEMA_SAMPLINGS])):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (sampling, choice.message.content)
        value = json.loads(choice.message.content)
        assert schema_errors(value, schema) == [], (sampling, value)


def test_json_object_output_is_a_json_object_on_every_sample(mesh):
    client = mesh.openai()

    def ask(sampling):
        return client.chat.completions.create(
            model=mesh.model, response_format={"type": "json_object"}, max_tokens=96, **sampling,
            messages=[{"role": "user", "content": "Give the name and colour of three fruits as JSON."}])

    for sampling, reply in zip(SAMPLINGS, together([lambda s=s: ask(s) for s in SAMPLINGS])):
        assert reply.choices[0].finish_reason == "stop", (sampling, reply.choices[0].message.content)
        assert isinstance(json.loads(reply.choices[0].message.content), dict), sampling


class Ticket(BaseModel):
    summary: str = Field(max_length=60)
    category: Literal["billing", "delivery", "product", "other"]
    urgent: bool
    order_ids: list[int] = Field(max_length=3)


def test_the_openai_clients_parse_helper_returns_the_pydantic_object(mesh):
    # chat.completions.parse turns the model into a strict json_schema and parses the reply.
    client = mesh.openai()
    prompt = "Ticket: 'Order 1234 arrived broken, I want a refund today!' File it."

    def ask(sampling):
        return client.chat.completions.parse(model=mesh.model, messages=[{"role": "user", "content": prompt}],
                                            response_format=Ticket, max_tokens=96, **sampling)

    for sampling, reply in zip(SAMPLINGS, together([lambda s=s: ask(s) for s in SAMPLINGS])):
        assert isinstance(reply.choices[0].message.parsed, Ticket), (sampling, reply.choices[0].message.content)


def test_a_json_schema_that_is_not_a_schema_is_a_400_naming_the_field(mesh):
    with pytest.raises(openai.BadRequestError) as caught:
        mesh.openai().chat.completions.create(
            model=mesh.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}})
    assert "response_format" in (caught.value.body or {}).get("param", ""), caught.value.body


# -- 2. forced tool calls ----------------------------------------------------------------------------
def assert_valid_calls(message, names: set[str]) -> list[tuple[str, dict]]:
    assert message.tool_calls, f"no tool call parsed; content was {message.content!r}"
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in names, call.function.name
        arguments = json.loads(call.function.arguments)
        assert schema_errors(arguments, TOOL_SCHEMAS[call.function.name]) == [], (call.function.name, arguments)
        calls.append((call.function.name, arguments))
    return calls


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
], ids=["required", "named-get_time", "named-get_weather"])
def test_forced_tool_choice_yields_a_valid_call_on_every_sample(mesh, tool_choice, names):
    client = mesh.openai()

    def ask(sampling):
        return client.chat.completions.create(model=mesh.model, messages=TOOL_MESSAGES, tools=TOOLS,
                                              tool_choice=tool_choice, max_tokens=96, **sampling)

    for sampling, reply in zip(SAMPLINGS, together([lambda s=s: ask(s) for s in SAMPLINGS])):
        assert reply.choices[0].finish_reason == "tool_calls", (sampling, reply.choices[0].message)
        assert_valid_calls(reply.choices[0].message, names)
        assert not reply.choices[0].message.content, sampling  # only calls: the grammar allows no text


def test_parallel_tool_calls_false_yields_exactly_one_call(mesh):
    client = mesh.openai()

    def ask(sampling):
        return client.chat.completions.create(model=mesh.model, messages=TOOL_MESSAGES, tools=TOOLS,
                                              tool_choice="required", parallel_tool_calls=False,
                                              max_tokens=96, **sampling)

    for sampling, reply in zip(SAMPLINGS, together([lambda s=s: ask(s) for s in SAMPLINGS])):
        assert reply.choices[0].finish_reason == "tool_calls", sampling
        assert len(assert_valid_calls(reply.choices[0].message, set(TOOL_SCHEMAS))) == 1, sampling


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_streamed_forced_call_reassembles_to_the_unstreamed_one(mesh, tool_choice):
    client = mesh.openai()
    request = dict(model=mesh.model, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                   max_tokens=96, temperature=0)
    whole = client.chat.completions.create(**request)
    expected = assert_valid_calls(whole.choices[0].message, set(TOOL_SCHEMAS))

    assert not whole.choices[0].message.content  # a forced call leaves no text

    parts: dict[int, dict[str, str]] = {}
    finish_reasons, content = [], ""
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            finish_reasons += [choice.finish_reason] if choice.finish_reason else []
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                part = parts.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                part["id"] = delta.id or part["id"]  # OpenAI sends the id and name once, first
                if delta.function is not None:
                    part["name"] += delta.function.name or ""
                    part["arguments"] += delta.function.arguments or ""
    assert finish_reasons == ["tool_calls"] and content == ""
    assert sorted(parts) == list(range(len(parts))) and all(p["id"] for p in parts.values())
    streamed = [(parts[i]["name"], json.loads(parts[i]["arguments"])) for i in sorted(parts)]
    assert streamed == expected


# -- 5. logprobs, echo, n, embeddings ----------------------------------------------------------------
def test_chat_logprobs_and_top_logprobs(mesh):
    reply = mesh.openai().chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [alt.logprob for alt in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and sum(math.exp(t) for t in tops) <= 1 + 1e-4
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_completions_echo_with_logprobs_scores_the_prompt(mesh):
    prompt = "The capital of France is"
    reply = mesh.openai().completions.create(model=mesh.model, prompt=prompt, max_tokens=3, temperature=0,
                                             echo=True, logprobs=2)
    choice = reply.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None  # nothing precedes the first prompt token
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert len(logprobs.text_offset) == len(logprobs.tokens) and logprobs.text_offset[0] == 0
    assert logprobs.top_logprobs[0] is None
    for token, logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        # The two most likely alternatives, plus the token actually there when it is not among them.
        assert 2 <= len(top) <= 3 and top[token] == pytest.approx(logprob)
        assert len(top) == 2 or logprob < min(v for t, v in top.items() if t != token)


def test_echo_with_max_tokens_zero_scores_continuations_like_a_log_likelihood_eval(mesh):
    client = mesh.openai()

    def continuation_logprob(prompt: str, continuation: str) -> float:
        reply = client.completions.create(model=mesh.model, prompt=prompt + continuation, max_tokens=0,
                                          echo=True, logprobs=0, temperature=0)
        logprobs = reply.choices[0].logprobs
        assert reply.usage.completion_tokens == 0 and reply.choices[0].text == prompt + continuation
        assert len(logprobs.tokens) == reply.usage.prompt_tokens
        start = logprobs.text_offset.index(len(prompt))  # the continuation's first token
        return sum(logprobs.token_logprobs[start:])

    prompt = "The capital of France is"
    assert continuation_logprob(prompt, " Paris") > continuation_logprob(prompt, " London")
    assert continuation_logprob("Two plus two equals", " four") > continuation_logprob("Two plus two equals", " nine")


def test_embeddings_through_the_openai_client(mesh):
    texts = ["The cat sat on the mat.", "A cat was sitting on the rug.", "Stock prices fell sharply today."]
    reply = mesh.openai().embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    vectors = [item.embedding for item in sorted(reply.data, key=lambda item: item.index)]
    assert [len(v) for v in vectors] == [384] * 3 and reply.usage.prompt_tokens > 0

    def cosine(a, b):
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])


def test_streamed_n_two_interleaves_choices_by_index(mesh):
    request = dict(model=mesh.model, messages=[{"role": "user", "content": "Name a colour."}], n=2, max_tokens=8,
                   temperature=0)
    client = mesh.openai()
    whole = client.chat.completions.create(**request)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


def test_n_three_returns_three_choices(mesh):
    client = mesh.openai()
    messages = [{"role": "user", "content": "Write a one-line poem about the sea."}]
    sampled = client.chat.completions.create(model=mesh.model, messages=messages, n=3, max_tokens=16,
                                             temperature=1.0, seed=7)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert all(isinstance(c.message.content, str) and c.message.content for c in sampled.choices)
    assert len({c.message.content for c in sampled.choices}) > 1  # each choice samples on its own
    greedy = client.chat.completions.create(model=mesh.model, messages=messages, n=3, max_tokens=8, temperature=0)
    single = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=8, temperature=0)
    assert [c.message.content for c in greedy.choices] == [single.choices[0].message.content] * 3
    # The prompt is counted once; every choice's tokens are counted.
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 3 * single.usage.completion_tokens

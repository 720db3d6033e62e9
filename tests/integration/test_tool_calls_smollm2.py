"""Tool calls that SmolLM2-135M-Instruct, served by a real mesh, lost before issue 15's
robustness fixes (the formats in services/router/tool_parsers/):

- a forced call whose argument contains ``</tool_call>`` came back as content: the parser
  closed the block at the first close tag, inside the JSON string;
- ``tool_choice: "required"`` at temperature 1.0 (max_tokens 96) kept adding calls, some
  pretty-printed, until max_tokens cut the array, and no call came back (3 of 8 seeds).
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.smollm2_mesh import SmolMesh, schema_errors, smollm2_mesh
from tests.integration.test_agent_io_smollm2 import TOOL_MESSAGES, TOOL_SCHEMAS, TOOLS

NOTE = {"type": "function", "function": {
    "name": "annotate", "description": "Attach a note.",
    "parameters": {"type": "object", "properties": {"note": {"type": "string", "enum": ["see </tool_call> here"]}},
                   "required": ["note"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> SmolMesh:
    with smollm2_mesh(tmp_path_factory.mktemp("tool-calls")) as served:
        yield served


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_whose_argument_contains_the_end_tag_is_still_a_call(mesh, stream):
    # The enum makes the grammar write the end tag inside the argument string, deterministically.
    request = dict(model=mesh.model, messages=[{"role": "user", "content": "Annotate this."}], tools=[NOTE],
                   tool_choice={"type": "function", "function": {"name": "annotate"}}, max_tokens=64, temperature=0)
    if stream:
        chunks = list(mesh.openai().chat.completions.create(**request, stream=True))
        args = "".join(d.function.arguments or "" for c in chunks for ch in c.choices
                       for d in ch.delta.tool_calls or () if d.function)
        content = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    else:
        message = mesh.openai().chat.completions.create(**request).choices[0].message
        assert message.tool_calls, f"no tool call parsed; content was {message.content!r}"
        args, content = message.tool_calls[0].function.arguments, message.content or ""
    assert json.loads(args) == {"note": "see </tool_call> here"} and not content


# Seeds 17, 20 and 21 of 0-23 returned no call before the fixes (measured on 87ad285).
SEEDS = range(12, 24)


def test_required_at_temperature_one_returns_valid_calls_on_every_seed(mesh):
    client = mesh.openai()

    def ask(seed: int):
        return client.chat.completions.create(model=mesh.model, messages=TOOL_MESSAGES, tools=TOOLS,
                                              tool_choice="required", max_tokens=96, temperature=1.0, seed=seed)

    # All seeds at once: the executor decodes them in shared batch steps (54 s -> 24 s on a
    # 2-CPU box); each reply is still checked on its own.
    with ThreadPoolExecutor(max_workers=len(SEEDS)) as pool:
        replies = list(pool.map(ask, SEEDS))
    for seed, reply in zip(SEEDS, replies):
        message = reply.choices[0].message
        assert message.tool_calls, (seed, reply.choices[0].finish_reason, message.content)
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert schema_errors(arguments, TOOL_SCHEMAS[call.function.name]) == [], (seed, arguments)
        assert not message.content, seed  # a cut-off partial call is dropped, not returned as text


def test_streamed_required_replies_at_temperature_one_carry_the_unstreamed_calls(mesh):
    client = mesh.openai()

    def request(seed: int) -> dict:
        return dict(model=mesh.model, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="required",
                    max_tokens=96, temperature=1.0, seed=seed)

    def whole(seed: int):
        return client.chat.completions.create(**request(seed)).choices[0].message.tool_calls

    def streamed(seed: int) -> list[tuple[str, str]]:
        calls: dict[int, list[str]] = {}
        chunks = list(client.chat.completions.create(**request(seed), stream=True))
        for delta in (d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or ()):
            name, args = calls.setdefault(delta.index, ["", ""])
            calls[delta.index] = [name + (delta.function.name or ""), args + (delta.function.arguments or "")]
        return [tuple(calls[i]) for i in sorted(calls)]

    # Seeds 17, 20 and 21 lost their calls before the fixes. All six requests at once: the
    # executor decodes them in shared steps (a seeded sample does not depend on the batch).
    seeds = (17, 20, 21)
    with ThreadPoolExecutor(max_workers=2 * len(seeds)) as pool:
        wholes = [pool.submit(whole, seed) for seed in seeds]
        streams = [pool.submit(streamed, seed) for seed in seeds]
        for seed, w, st in zip(seeds, wholes, streams):
            calls = w.result()
            assert calls and st.result() == [(c.function.name, c.function.arguments) for c in calls], seed

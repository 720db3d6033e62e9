"""Issue 15's "done means" for agent frameworks, against SmolLM2-135M-Instruct served by a real
mesh (`weft up`, one executor): LangChain's ``ChatOpenAI.with_structured_output`` returns the
pydantic object, and a LangGraph ReAct agent completes a two-tool task end to end.

The frameworks talk to Weft exactly as to OpenAI: ``ChatOpenAI(base_url=..., api_key=...)``.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from pydantic import BaseModel, Field
from tokenizers import Tokenizer

from tests.integration.smollm2_mesh import SmolMesh, schema_errors, smollm2_mesh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> SmolMesh:
    with smollm2_mesh(tmp_path_factory.mktemp("agent-frameworks")) as served:
        yield served


def chat_model(mesh: SmolMesh, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(model=mesh.model, base_url=mesh.base_url, api_key=mesh.api_key, max_retries=0,
                      timeout=120, **{"temperature": 0, "max_tokens": 128, **kwargs})


# -- 3. with_structured_output -------------------------------------------------------------------
class City(BaseModel):
    """A city and facts about it."""
    name: str = Field(description="The city's name", max_length=40)
    country: str = Field(description="The country it is in", max_length=40)
    population_millions: float = Field(description="Population in millions", ge=0, le=100)
    climate: Literal["tropical", "dry", "temperate", "continental", "polar"]
    landmarks: list[str] = Field(description="Up to three famous landmarks", max_length=3)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_pydantic_object(mesh, method):
    # json_schema sends response_format (a strict schema); function_calling forces a call of a
    # "City" tool (tool_choice naming it, parallel_tool_calls false). Both must parse.
    prompt = "Describe Paris as JSON with the keys name, country, population_millions, climate, landmarks."
    samplings = ({}, {"temperature": 0.7, "seed": 5}, {"temperature": 0.7, "seed": 6})

    def ask(sampling: dict) -> dict:
        model = chat_model(mesh, **sampling).with_structured_output(City, method=method, include_raw=True)
        return model.invoke(prompt)
    with ThreadPoolExecutor(max_workers=len(samplings)) as pool:  # asked at once: one batch, not three runs
        results = list(pool.map(ask, samplings))
    for sampling, result in zip(samplings, results):
        assert result["parsing_error"] is None, (sampling, result["raw"])
        assert isinstance(result["parsed"], City), (sampling, result["raw"])
        if method == "function_calling":
            assert [call["name"] for call in result["raw"].tool_calls] == ["City"]


# -- 4. a LangGraph ReAct agent ---------------------------------------------------------------------
@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return json.dumps({"city": city, "temperature_c": 18, "sky": "cloudy"})


@tool
def get_time(city: str) -> str:
    """The current local time in a city."""
    return json.dumps({"city": city, "local_time": "21:05"})


AGENT_TOOLS = [get_weather, get_time]


def call_marker_token_ids(mesh: SmolMesh) -> list[int]:
    """The tokens SmolLM2's tool-call markup opens with ("<", " <", "</" in its vocabulary)."""
    tokenizer = Tokenizer.from_file(str(mesh.model_dir / "tokenizer.json"))
    return sorted({tokenizer.encode(text, add_special_tokens=False).ids[0]
                   for text in ("<tool_call>", " <tool_call>", "</tool_call>")})


def per_hop_model(mesh: SmolMesh):
    """The agent's model, chosen per hop from the conversation so far.

    SmolLM2-135M rarely decides to call a tool under ``tool_choice="auto"``, so the agent
    decides *whether* a tool is needed and the model decides *how*: while a tool of the task
    has not been called yet, the model is bound to the tools still uncalled with
    ``tool_choice="required"`` and ``parallel_tool_calls=False`` (Weft's grammar then
    guarantees one well-formed call; the model picks the tool and writes its arguments).
    Once every tool has answered, the model is bound to no tools and writes the answer from
    the tool results in the conversation. At that hop SmolLM2 tends to copy the previous
    ``<tool_call>[...]</tool_call>`` markup as text (with the tools still in the prompt under
    ``tool_choice="none"`` it does so too, or talks about the tools' JSON instead), so the
    final hop also sends ``logit_bias`` -100 on the tokens that markup opens with. This is
    create_react_agent's documented dynamic-model hook (a callable ``(state, runtime) ->
    model``), so the graph, the ToolNode and the message flow are LangGraph's own.
    """
    base = chat_model(mesh)
    answer = chat_model(mesh, max_tokens=48, logit_bias={token: -100 for token in call_marker_token_ids(mesh)})

    def select(state, runtime):
        called = {m.name for m in state["messages"] if isinstance(m, ToolMessage)}
        remaining = [t for t in AGENT_TOOLS if t.name not in called]
        if remaining:
            return base.bind_tools(remaining, tool_choice="required", parallel_tool_calls=False)
        return answer
    return select


def test_a_react_agent_completes_a_two_tool_task(mesh):
    agent = create_react_agent(per_hop_model(mesh), AGENT_TOOLS)
    task = "I'm in Tokyo. What's the weather here, and what time is it? Use the tools, then answer briefly."
    result = agent.invoke({"messages": [HumanMessage(task)]}, {"recursion_limit": 12})
    messages = result["messages"]

    calls = [call for m in messages if isinstance(m, AIMessage) for call in m.tool_calls]
    by_name = {t.name: t for t in AGENT_TOOLS}
    assert {c["name"] for c in calls} == set(by_name), calls
    for call in calls:
        schema = by_name[call["name"]].tool_call_schema.model_json_schema()
        assert schema_errors(call["args"], schema) == [], call
    # Every call got its tool's answer back before the final turn.
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert sorted(r.tool_call_id for r in results) == sorted(c["id"] for c in calls)
    assert all(r.status == "success" for r in results), [r.content for r in results]

    # One call per hop, each tool once: Human, (AI call, Tool result) x 2, AI answer.
    assert [type(m) for m in messages] == [HumanMessage] + [AIMessage, ToolMessage] * 2 + [AIMessage]
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert isinstance(final.content, str) and final.content.strip() and "tool_call" not in final.content
    # The answer is drawn from what the tools returned.
    assert any(fact in final.content for fact in ("18", "cloudy", "21:05")), final.content

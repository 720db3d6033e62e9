"""The whole mesh end to end: `weft up` (real NATS, real service processes, free
loopback ports) on the tiny checkpoint, driven through the official ``openai`` client,
raw HTTP and a raw gRPC client. One mesh per module; every wait is a condition polled
against a deadline."""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from tests.integration.launched_mesh import launched_mesh
from weft.launcher.mesh_state import MeshState, pid_alive, read_state
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

MODEL = "tiny"
API_KEY = "sk-e2e"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 16


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)  # polling interval, not synchronisation


def http_request(mesh: "Mesh", method: str, path: str, body: bytes | dict | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """One plain HTTP call (stdlib, no connection reuse); returns (status, JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", mesh.http_port, timeout=60)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


@dataclass
class Mesh:
    state: MeshState
    state_dir: Path
    model_dir: Path
    process: subprocess.Popen

    @property
    def http(self) -> str:
        return self.state.http_url

    @property
    def http_port(self) -> int:
        return self.state.instance("router").ports["router_http_port"]

    def openai(self, key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.http}/v1", api_key=key, max_retries=0, timeout=60)

    def executor_stats(self) -> dict[str, executor_pb2.GetStatsResponse]:
        stats = {}
        for inst in self.state.by_service("executor"):
            with grpc.insecure_channel(f"127.0.0.1:{inst.ports['executor_port']}") as channel:
                stats[inst.name] = executor_pb2_grpc.ExecutorStub(channel).GetStats(
                    executor_pb2.GetStatsRequest(), timeout=5)
        return stats

    def scheduler_executors(self) -> dict[str, scheduler_pb2.ExecutorInfo]:
        port = self.state.instance("scheduler").ports["scheduler_port"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = scheduler_pb2_grpc.SchedulerStub(channel).ListExecutors(scheduler_pb2.ListExecutorsRequest(), timeout=5)
        return {e.heartbeat.name: e for e in reply.executors}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Mesh:
    state_dir = tmp_path_factory.mktemp("mesh")
    model_dir = make_tiny_checkpoint(state_dir / "models" / MODEL)
    keys = state_dir / "keys.txt"
    keys.write_text(f"{API_KEY} acme\nsk-other globex\n")
    env = {"WEFT_EXECUTOR_BLOCK_SIZE": str(BLOCK_SIZE), "WEFT_EXECUTOR_NUM_THREADS": "1"}
    with launched_mesh(state_dir, Path(model_dir), 2, env, ["--keys-file", str(keys)], timeout_s=120) as (process, state):
        yield Mesh(state, state_dir, Path(model_dir), process)


# -- OpenAI client -----------------------------------------------------------------------
def test_openai_chat_non_streaming_returns_text_usage_and_executor(mesh):
    raw = mesh.openai().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0)
    reply = raw.parse()
    assert raw.headers["x-weft-executor"] in {"executor-0", "executor-1"}
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 8
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_openai_chat_streaming_yields_deltas_finish_and_usage(mesh):
    stream = mesh.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 12
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = mesh.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, temperature=0)
    assert text == whole.choices[0].message.content


def test_chat_accepts_tools_and_tool_messages(mesh):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    reply = mesh.openai().chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=6,
                                                  temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_completions_with_token_id_prompts_return_token_ids(mesh):
    client = mesh.openai()
    reply = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], [9, 10, 11]], max_tokens=5, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert len(choice.model_extra["token_ids"]) == 5
    assert reply.usage.prompt_tokens == 7 and reply.usage.completion_tokens == 10
    stream = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    streamed = [t for chunk in stream for c in chunk.choices for t in c.model_extra["token_ids"]]
    assert streamed == reply.choices[0].model_extra["token_ids"]


def test_greedy_output_through_the_mesh_equals_in_process_llm(mesh):
    from weft import LLM, SamplingParams

    prompts = [[3, 14, 15, 92, 65], list(range(100, 140)), [7] * 20]
    reply = mesh.openai().completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0,
                                             extra_body={"return_token_ids": True})
    through_mesh = [c.model_extra["token_ids"] for c in sorted(reply.choices, key=lambda c: c.index)]
    import torch

    threads = torch.get_num_threads()
    try:  # one thread, as the mesh's executors run: same reduction order in every matmul
        local = LLM(mesh.model_dir, block_size=BLOCK_SIZE, num_threads=1).generate(
            prompts, SamplingParams(max_tokens=16, temperature=0.0))
    finally:
        torch.set_num_threads(threads)
    assert through_mesh == [out.token_ids for out in local]


# -- gRPC ---------------------------------------------------------------------------------
def test_grpc_router_generate_streams_tokens_and_lists_models(mesh):
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(mesh.state.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(
            model=MODEL, token_ids=router_pb2.TokenIds(ids=[1, 2, 3, 4]),
            sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        chunks = list(stub.Generate(request, metadata=metadata, timeout=30))
        assert sum(len(c.token_ids_delta) for c in chunks) == 6
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert chunks[-1].usage.num_output_tokens == 6 and chunks[-1].executor.startswith("executor-")
        chat = router_pb2.GenerateRequest(chat=router_pb2.ChatMessages(
            messages=[router_pb2.ChatMessage(role="user", content="hi")], add_generation_prompt=True),
            sampling=common_pb2.SamplingParams(max_tokens=4))
        assert list(stub.Generate(chat, metadata=metadata, timeout=30))[-1].finish_reason != 0
        models = stub.ListModels(router_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
        assert models.models[0].id == MODEL and models.models[0].num_executors == 2
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        bad = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1]),
                                         sampling=common_pb2.SamplingParams(top_p=1.5))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, metadata=metadata, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()


# -- placement, cancellation -------------------------------------------------------------
def _indexed_blocks(mesh: Mesh, name: str) -> int:
    info = mesh.scheduler_executors().get(name)
    return info.num_indexed_blocks if info else 0


def _is_idle(mesh: Mesh, name: str) -> bool:
    info = mesh.scheduler_executors().get(name)
    return bool(info) and info.load.num_running == 0 and info.load.num_free_blocks == info.load.num_blocks


def test_requests_sharing_a_long_prefix_land_on_the_executor_holding_it(mesh):
    prefix = [(17 * i) % 900 + 50 for i in range(20 * BLOCK_SIZE)]  # 20 full blocks
    client = mesh.openai()
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prefix + [1], max_tokens=1)
    holder = raw.headers["x-weft-executor"]
    # The scheduler learns the blocks from the executor's kv events over NATS.
    wait_until(lambda: _indexed_blocks(mesh, holder) >= 20, 30, f"the scheduler to index {holder}'s blocks")
    # A load report taken while the first request still held its blocks would count
    # them as work in progress on the holder: wait until the scheduler sees it idle.
    wait_until(lambda: _is_idle(mesh, holder), 30, f"the scheduler to see {holder} idle")
    for suffix in ([2, 3], [4, 5, 6], [7]):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prefix + suffix, max_tokens=1)
        assert raw.headers["x-weft-executor"] == holder
        assert raw.parse().usage.prompt_tokens_details.cached_tokens >= 19 * BLOCK_SIZE


def test_client_disconnect_mid_stream_frees_the_executors_blocks(mesh):
    conn = http.client.HTTPConnection("127.0.0.1", mesh.http_port, timeout=60)
    body = {"model": MODEL, "prompt": list(range(60, 60 + 5 * BLOCK_SIZE)), "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **AUTH})
        resp = conn.getresponse()
        assert resp.status == 200
        executor = resp.getheader("x-weft-executor")
        events = 0
        while events < 3:
            events += resp.readline().startswith(b"data: ")
        busy = mesh.executor_stats()[executor]
        assert busy.num_running == 1 and busy.num_free_blocks < busy.num_blocks
    finally:
        conn.close()  # the client goes away mid-stream

    def freed():
        stats = mesh.executor_stats()[executor]
        return stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks

    wait_until(freed, 10, f"{executor} to free the aborted request's blocks")


# -- bad input, auth ---------------------------------------------------------------------
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", "body"),
    ("/v1/chat/completions", {**_CHAT, "model": "gpt-17"}, "model"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "user", "content": ["not", "parts"]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": 10**12}, "max_tokens"),
    ("/v1/chat/completions", {**_CHAT, "temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {**_CHAT, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(1, 1000)) * 3, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999], "max_tokens": 2}, "prompt[2]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("path, body, field", BAD_REQUESTS, ids=[f"{p}:{f}" for p, _, f in BAD_REQUESTS])
def test_bad_input_is_400_naming_the_field_and_the_next_request_is_served(mesh, path, body, field):
    status, reply = http_request(mesh, "POST", path, body, AUTH)
    assert status == 400, reply
    assert reply["error"]["param"] == field and reply["error"]["type"] == "invalid_request_error"
    assert http_request(mesh, "POST", "/v1/chat/completions", _CHAT, AUTH)[0] == 200


def test_with_keys_configured_requests_without_a_valid_key_get_401(mesh):
    assert http_request(mesh, "POST", "/v1/chat/completions", _CHAT)[0] == 401
    assert http_request(mesh, "POST", "/v1/chat/completions", _CHAT, {"Authorization": "Bearer nope"})[0] == 401
    assert http_request(mesh, "GET", "/v1/models")[0] == 401
    assert http_request(mesh, "POST", "/v1/chat/completions", _CHAT, AUTH)[0] == 200
    with pytest.raises(openai.AuthenticationError):
        mesh.openai(key="wrong").chat.completions.create(model=MODEL, messages=_CHAT["messages"], max_tokens=1)


# -- launcher ------------------------------------------------------------------------------
def test_weft_ps_lists_every_service_healthy_and_scale_adds_and_drains_executors(mesh):
    def weft(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "weft", *args, "--state-dir", str(mesh.state_dir)],
                              capture_output=True, text=True, timeout=120)

    ps = weft("ps")
    assert ps.returncode == 0, ps.stdout + ps.stderr
    table, settings = ps.stdout.split("\n\n", 1)  # instances, then the non-default settings
    names = [line.split()[0] for line in table.splitlines()[1:]]
    assert names == ["nats", "cachestore", "scheduler", "executor-0", "executor-1", "router"]
    assert all(" healthy " in line for line in table.splitlines()[1:])
    assert settings.startswith("settings")

    assert weft("scale", "executor=3").stdout.strip() == "executors: executor-0, executor-1, executor-2"
    assert "executor-2" in mesh.scheduler_executors()  # placed on from the moment scale returns
    drained = read_state(mesh.state_dir).instance("executor-2").pid
    assert weft("scale", "executor=2").stdout.strip() == "executors: executor-0, executor-1"
    assert not pid_alive(drained)


def _post_with_headers(mesh: Mesh, path: str, body: dict, key: str = API_KEY) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", mesh.http_port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def test_http_agent_hops_report_class_and_pause_and_hit_the_cache_per_tenant(mesh):
    """Session extension fields over HTTP: the response names the class and the pause
    decision; the next hop of the session hits the cache; another tenant never does."""
    prompt = [(11 * i + 5) % 900 + 20 for i in range(70)]
    hop0 = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "session_id": "http-agent", "program_id": "http-prog", "hop_index": 0,
            "expected_tool_ms": 500}
    status, headers, body = _post_with_headers(mesh, "/v1/completions", hop0)
    assert status == 200, body
    assert headers["x-weft-request-class"] == "agentic"
    assert headers["x-weft-pause"] in ("keep", "demote", "drop")
    out = body["choices"][0]["token_ids"]
    hop1 = {**hop0, "prompt": prompt + out + [42] * 8, "hop_index": 1, "expected_tool_ms": 0}
    status, _, body = _post_with_headers(mesh, "/v1/completions", hop1)
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64, body
    other = {**hop0, "session_id": "http-agent-other", "program_id": ""}
    status, _, body = _post_with_headers(mesh, "/v1/completions", other, key="sk-other")
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, body
    status, _, body = _post_with_headers(mesh, "/v1/completions", {**hop0, "hop_index": 7})
    assert status == 400 and body["error"]["param"] == "session.hop_index", body

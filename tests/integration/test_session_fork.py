"""Fork and join through a real mesh (`weft up` on the tiny checkpoint: NATS, two
executors, the scheduler with the keep pause policy, the router; loopback HTTP): a parent
hop, a fork into three children whose stateful hops run at once, and a join.

The children share the parent's KV by reference: each is placed on the executor that
holds the parent's blocks and its prefix cache serves them (``cached_tokens`` covers the
parent's context), and the pool's pinned blocks grow by the children's own tails, not by
three copies of the context. The join continues the parent from one child on the same
executor, and ends the other two (their pins go)."""
from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.integration.launched_mesh import launched_mesh
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import executor_pb2, executor_pb2_grpc

MODEL = "tiny"
API_KEY = "sk-fork"
BLOCK_SIZE = 16
PARENT_PROMPT = [(13 * i + 7) % 900 + 10 for i in range(192)]  # 12 full blocks
AGENT = {"expected_tool_ms": 60_000, "request_class": "agentic"}  # pins outlive the test


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("fork-mesh")
    model_dir = make_tiny_checkpoint(state_dir / "models" / MODEL)
    keys = state_dir / "keys.txt"
    keys.write_text(f"{API_KEY} acme\n")
    env = {"WEFT_EXECUTOR_BLOCK_SIZE": str(BLOCK_SIZE), "WEFT_EXECUTOR_NUM_THREADS": "1",
           "WEFT_SCHEDULER_PAUSE_POLICY": "keep"}
    with launched_mesh(state_dir, Path(model_dir), 2, env, ["--keys-file", str(keys)], timeout_s=120) as (_, state):
        yield state


def post(state, path: str, body: dict) -> tuple[int, dict, str]:
    """(status, JSON body, x-weft-executor) of one HTTP POST."""
    conn = http.client.HTTPConnection("127.0.0.1", state.instance("router").ports["router_http_port"], timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null"), resp.getheader("x-weft-executor") or ""
    finally:
        conn.close()


def hop(session_id: str, hop_index: int, prompt: list[int], stateful: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "session_id": session_id,
            "hop_index": hop_index, "session_stateful": stateful, **AGENT}


def used_blocks(state, executor: str) -> int:
    """Blocks neither free nor evictable on ``executor``: pinned (no hop runs now)."""
    inst = next(i for i in state.by_service("executor") if i.name == executor)
    with grpc.insecure_channel(f"127.0.0.1:{inst.ports['executor_port']}") as channel:
        stats = executor_pb2_grpc.ExecutorStub(channel).GetStats(executor_pb2.GetStatsRequest(), timeout=5)
    return stats.num_blocks - stats.num_free_blocks


def test_three_children_share_the_parents_kv_run_at_once_and_join_back(mesh):
    status, parent, parent_executor = post(mesh, "/v1/completions", hop("agent", 0, PARENT_PROMPT, False))
    assert status == 200, parent
    pinned_parent = used_blocks(mesh, parent_executor)
    status, fork, _ = post(mesh, "/v1/weft/sessions/agent/fork", {"n": 3})
    assert status == 200, fork
    assert fork["children"] == ["agent.f0", "agent.f1", "agent.f2"]
    context = fork["num_context_tokens"]
    assert context == len(PARENT_PROMPT) + parent["usage"]["completion_tokens"]

    new_tokens = [[20 + k] * 20 for k in range(3)]  # 20 tokens: each child's own tail spans a block
    with ThreadPoolExecutor(3) as pool:  # the three children's hops at once: none is refused busy
        children = list(pool.map(lambda k: post(mesh, "/v1/completions",
                                                hop(f"agent.f{k}", 1, new_tokens[k], True)), range(3)))
    for status, body, executor in children:
        assert status == 200, body
        assert executor == parent_executor  # placed by the overlap with the parent's blocks
        assert body["usage"]["prompt_tokens"] == context + 20
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(PARENT_PROMPT)  # served from its KV
    growth = used_blocks(mesh, parent_executor) - pinned_parent
    # Copies would pin 3 x 13 more blocks; shared, each child pins only its own tail.
    assert 0 < growth <= 3 * 2 < len(PARENT_PROMPT) // BLOCK_SIZE

    status, join, _ = post(mesh, "/v1/weft/sessions/agent/join", {"from": "agent.f1"})
    assert status == 200, join
    assert join["ended_children"] == ["agent.f0", "agent.f2"]
    child_context = context + 20 + children[1][1]["usage"]["completion_tokens"]
    assert join["num_context_tokens"] == child_context
    status, after, executor = post(mesh, "/v1/completions", hop("agent", 2, [30] * 4, True))
    assert status == 200, after
    assert executor == parent_executor and after["usage"]["prompt_tokens"] == child_context + 4
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] >= child_context // BLOCK_SIZE * BLOCK_SIZE
    status, ended, _ = post(mesh, "/v1/completions", hop("agent.f0", 2, [31] * 4, True))
    assert status == 400 and ended["error"]["param"] == "session.session_id"  # an ended child's context is gone


def test_a_hop_asking_three_completions_runs_three_branches_on_the_sessions_kv_and_joins_one(mesh):
    status, first, parent_executor = post(mesh, "/v1/completions", hop("multi", 0, PARENT_PROMPT, False))
    assert status == 200, first
    context = len(PARENT_PROMPT) + first["usage"]["completion_tokens"]
    status, body, executors = post(mesh, "/v1/completions",
                                   {**hop("multi", 1, [40] * 20, True), "n": 3, "temperature": 1.0, "seed": 7})
    assert status == 200, body
    assert [c["weft"]["session_id"] for c in body["choices"]] == ["multi", "multi.h1.n1", "multi.h1.n2"]
    assert executors == parent_executor  # every branch placed by the overlap with the session's blocks
    assert body["usage"]["prompt_tokens"] == context + 20  # each branch continued the session's context
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(PARENT_PROMPT)

    status, join, _ = post(mesh, "/v1/weft/sessions/multi/join", {"from": "multi.h1.n2"})
    assert status == 200, join
    assert join["ended_children"] == ["multi.h1.n1"]
    assert join["num_context_tokens"] == context + 20 + 4  # the branch's hop: 20 new tokens, 4 generated
    status, after, _ = post(mesh, "/v1/completions", hop("multi", 2, [41] * 4, True))
    assert status == 200 and after["usage"]["prompt_tokens"] == context + 24 + 4, after

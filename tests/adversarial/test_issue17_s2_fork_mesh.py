"""Issue 17 (session 2), a fork bomb on a real mesh (`weft up`, tiny checkpoint, one
executor, keep pause policy, pins that would outlive the test): forks of forks, a child
whose stream the client drops mid-hop, a join, then the client ends every session id it
ever named. The executor's used blocks return to their baseline: no pin leaks, none of a
dropped stream, none of the child the join absorbed."""
from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest

from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh
from tests.integration.test_session_fork import BLOCK_SIZE, MODEL, PARENT_PROMPT, hop, used_blocks
from weft.testing.tiny_model import make_tiny_checkpoint

KEY = "sk-bomb"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("fork-bomb")
    model_dir = make_tiny_checkpoint(state_dir / "models" / MODEL)
    keys = state_dir / "keys.txt"
    keys.write_text(f"{KEY} bomber\n")
    env = {"WEFT_EXECUTOR_BLOCK_SIZE": str(BLOCK_SIZE), "WEFT_EXECUTOR_NUM_THREADS": "1",
           "WEFT_SCHEDULER_PAUSE_POLICY": "keep"}
    with launched_mesh(state_dir, Path(model_dir), 1, env, ["--keys-file", str(keys)], timeout_s=120) as (_, state):
        yield state


def call(state, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", state.instance("router").ports["router_http_port"], timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def drop_mid_stream(state, body: dict) -> None:
    """Start a streamed hop, read its first event, hang up."""
    conn = http.client.HTTPConnection("127.0.0.1", state.instance("router").ports["router_http_port"], timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True, "max_tokens": 64}).encode(),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()
    conn.sock.close()
    conn.close()


def test_a_fork_bomb_then_ending_every_session_returns_the_pool_to_its_baseline(mesh):
    executor = mesh.by_service("executor")[0].name
    baseline = used_blocks(mesh, executor)
    status, body = call(mesh, "POST", "/v1/completions", hop("bomb", 0, PARENT_PROMPT, False))
    assert status == 200, body
    named = ["bomb"]
    status, fork = call(mesh, "POST", "/v1/weft/sessions/bomb/fork", {"n": 4})
    assert status == 200, fork
    named += fork["children"]
    for k, child in enumerate(fork["children"][1:], 1):
        assert call(mesh, "POST", "/v1/completions", hop(child, 1, [40 + k] * 20, True))[0] == 200
    status, grand = call(mesh, "POST", "/v1/weft/sessions/bomb.f1/fork", {"n": 4})
    assert status == 200, grand
    named += grand["children"]
    for k, child in enumerate(grand["children"]):
        assert call(mesh, "POST", "/v1/completions", hop(child, 2, [60 + k] * 20, True))[0] == 200
    drop_mid_stream(mesh, hop("bomb.f0", 1, [50] * 20, True))  # the client hangs up on a child
    wait_for(lambda: call(mesh, "POST", "/v1/weft/sessions/bomb/join",
                          {"from": "bomb.f2", "end_children": False})[0] == 200, 60,
             "the dropped child's claim to go and the join to succeed")
    assert used_blocks(mesh, executor) > baseline
    for sid in named:
        if sid != "bomb.f2":  # absorbed by the join: the client need not name it again
            status, body = call(mesh, "DELETE", f"/v1/weft/sessions/{sid}")
            assert status == 200, body
    wait_for(lambda: used_blocks(mesh, executor) == baseline, 30, "the pool to return to its baseline")

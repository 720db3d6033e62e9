"""Degradation rungs served by executor pools, through the real mesh (`weft up`): one
full-quality executor and one started with ``--kv-cache-dtype int8`` (``--extra-executor``;
its rung, kv_int8, derived from the flag), the scheduler's ladder pinned on kv_int8
(enter threshold 0). A request whose contract
accepts kv_int8 is served by the int8 pool and says so; one whose contract does not is
served at full quality by the other executor; with no degraded executor alive every
request is served on ``none``. (No timing thresholds: the ladder is pinned by config.)"""
from __future__ import annotations

import http.client
import json
import subprocess
import sys

import grpc
import pytest

from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh
from weft.v1 import common_pb2, events_pb2, scheduler_pb2, scheduler_pb2_grpc

FULL, INT8 = "executor-0", "executor-1"


def post(port: int, contract: dict | None = None, prompt: str = "degraded pools") -> tuple[int, dict, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    if contract is not None:
        body["contract"] = contract
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read() or b"null")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("degraded-pools")
    # 8 MiB of KV: the byte budget, not the cap of twice a full batch, sets both pools' sizes
    env = {"WEFT_EXECUTOR_NUM_THREADS": "1", "WEFT_EXECUTOR_KV_CACHE_MEMORY_BYTES": str(8 << 20),
           "WEFT_SCHEDULER_DEGRADATION_RUNGS": "none,kv_int8,shed",
           "WEFT_SCHEDULER_DEGRADATION_THRESHOLDS": "kv_int8=0:0"}
    with launched_mesh(state_dir, tiny_model_dir, 1, env, ["--extra-executor=--kv-cache-dtype int8"],
                       timeout_s=150) as (_, state):
        yield state, state_dir


def executors(state) -> dict[str, scheduler_pb2.ExecutorInfo]:
    port = state.instance("scheduler").ports["scheduler_port"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = scheduler_pb2_grpc.SchedulerStub(channel).ListExecutors(scheduler_pb2.ListExecutorsRequest(), timeout=5)
    return {e.heartbeat.name: e for e in reply.executors}


def test_each_executor_announces_the_rung_its_pool_serves(mesh):
    state, _ = mesh
    known = executors(state)
    rungs = {name: e.heartbeat.serves_rung for name, e in known.items()}
    assert rungs == {FULL: common_pb2.DEGRADATION_RUNG_NONE, INT8: common_pb2.DEGRADATION_RUNG_KV_INT8}
    # the same KV bytes hold more int8 blocks: it really runs the int8 cache
    assert known[INT8].heartbeat.num_blocks > known[FULL].heartbeat.num_blocks


def test_a_request_accepting_kv_int8_is_served_by_the_int8_pool_and_says_so(mesh):
    state, _ = mesh
    port = state.instance("router").ports["router_http_port"]
    for i in range(3):  # every one of them: placement never leaves the rung's pool
        status, headers, body = post(port, prompt=f"accepts every rung {i}")
        assert status == 200, body
        assert (headers["x-weft-executor"], headers["x-weft-degradation-rung"]) == (INT8, "kv_int8")
        assert body["usage"]["completion_tokens"] == 3
    status, headers, body = post(port, {"accepted_degrade_steps": ["kv_int8"]})
    assert status == 200, body
    assert (headers["x-weft-executor"], headers["x-weft-degradation-rung"]) == (INT8, "kv_int8")


@pytest.mark.parametrize("steps", [["none"], ["kv_compress", "smaller_model"]])
def test_a_request_whose_contract_refuses_kv_int8_is_served_at_full_quality(mesh, steps):
    state, _ = mesh
    port = state.instance("router").ports["router_http_port"]
    status, headers, body = post(port, {"accepted_degrade_steps": steps})
    assert status == 200, body
    assert (headers["x-weft-executor"], headers["x-weft-degradation-rung"]) == (FULL, "none")


def test_an_unknown_rung_name_is_a_400_naming_the_field(mesh):
    state, _ = mesh
    status, _, body = post(state.instance("router").ports["router_http_port"],
                           {"accepted_degrade_steps": ["kv_int8", "kv_fp4"]})
    assert status == 400, body
    assert body["error"]["param"] == "contract.accepted_degrade_steps[1]"


def test_with_no_degraded_executor_alive_requests_are_served_on_none(mesh):
    state, state_dir = mesh
    scale = subprocess.run([sys.executable, "-m", "weft", "scale", "executor=1", "--state-dir", str(state_dir)],
                           capture_output=True, text=True, timeout=120)  # drains the highest index: the int8 one
    assert scale.stdout.strip() == f"executors: {FULL}", scale.stdout + scale.stderr

    def int8_gone():
        e = executors(state).get(INT8)
        return e is None or e.heartbeat.state == events_pb2.EXECUTOR_STATE_DRAINING
    wait_for(int8_gone, 30, "the scheduler to stop placing on the drained int8 executor")
    port = state.instance("router").ports["router_http_port"]
    for contract in (None, {"accepted_degrade_steps": ["kv_int8"]}):
        status, headers, body = post(port, contract)
        assert status == 200, body
        assert (headers["x-weft-executor"], headers["x-weft-degradation-rung"]) == (FULL, "none")

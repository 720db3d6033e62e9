"""The unlucky operator against issue 15's other services, on one `weft up` mesh (tiny
model, one executor): the cachestore killed with SIGKILL under /v1/embeddings (503 with
Retry-After while chat keeps answering; embeddings again once it is back), the grammar
mask's cost on the executor's /metrics after constrained steps, and a router started with
an unknown --tool-call-parser (a usage error at start, not at the first request)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import ROOT, launched_mesh
from weft.launcher.mesh_state import pid_alive, read_state

ENV = {"WEFT_EXECUTOR_NUM_THREADS": "1", "WEFT_EXECUTOR_HEARTBEAT_INTERVAL_S": "0.25"}
EMBED = {"model": "all-MiniLM-L6-v2", "input": ["a city by the sea", "a town on the coast"]}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("issue15-operator-mesh")
    with launched_mesh(state_dir, tiny_model_dir, 1, ENV) as (_, state):
        yield state_dir, state


def _post(state, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=state.http_url, timeout=120) as client:
        return client.post(path, json=body)


def _chat_ok(state) -> bool:
    reply = _post(state, "/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "temperature": 0.0,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    return reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def _weft(state_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weft", *args, "--state-dir", str(state_dir)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)


def test_a_cachestore_killed_with_sigkill_is_503_with_retry_after_for_embeddings_only(mesh):
    """`weft chaos kill` is SIGKILL with the supervisor told to leave it down, so the outage
    lasts until `weft chaos restart` (a plain kill -9 is restarted within a second)."""
    state_dir, state = mesh
    first = _post(state, "/v1/embeddings", EMBED)
    assert first.status_code == 200, first.text
    assert [len(d["embedding"]) for d in first.json()["data"]] == [384, 384]
    cachestore = read_state(state_dir).instance("cachestore").pid
    assert _weft(state_dir, "chaos", "kill", "cachestore").returncode == 0
    assert not pid_alive(cachestore)
    for _ in range(3):  # the router's first call finds the connection gone, later ones no channel
        down = _post(state, "/v1/embeddings", EMBED)
        assert down.status_code == 503, down.text
        assert down.headers.get("retry-after"), down.headers
        assert down.json()["error"]["message"], down.text
    assert _chat_ok(state), "chat stopped answering without the cachestore"
    restarted = _weft(state_dir, "chaos", "restart", "cachestore")
    assert restarted.returncode == 0, restarted.stderr

    # Not at once: the router's cachestore channel may be in gRPC's reconnect backoff (the
    # scheduler's executor channels had the same fault, fixed in 9d8711d; the router's
    # CacheStoreClient is another part's file: reported).

    def embeds_again() -> bool:
        reply = _post(state, "/v1/embeddings", EMBED)
        assert reply.status_code in (200, 503), reply.text
        return reply.status_code == 200 and [len(d["embedding"]) for d in reply.json()["data"]] == [384, 384]

    wait_for(embeds_again, 120, "/v1/embeddings to answer again after the cachestore's restart")


def _grammar_mask_metric(state_dir, required: bool = True) -> tuple[float, float] | None:
    port = read_state(state_dir).instance("executor-0").ports["executor_metrics_port"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    values = {}
    for name in ("weft_executor_grammar_mask_seconds_sum", "weft_executor_grammar_mask_seconds_count"):
        match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        if match is None and not required:
            return None
        assert match, f"{name} missing from the executor's /metrics"
        values[name] = float(match.group(1))
    return values["weft_executor_grammar_mask_seconds_sum"], values["weft_executor_grammar_mask_seconds_count"]


def test_the_grammar_mask_cost_on_metrics_counts_constrained_steps_with_a_sane_value(mesh):
    state_dir, state = mesh
    # the grammar package (and its metrics) loads on a warm-up thread after the executor
    # serves: a CI run scraped before it had (the metric "missing")
    total_before, steps_before = wait_for(lambda: _grammar_mask_metric(state_dir, required=False), 60,
                                          "the executor's grammar warm-up to export its metrics")
    assert _chat_ok(state)  # free text: no mask steps
    assert _grammar_mask_metric(state_dir) == (total_before, steps_before)
    reply = _post(state, "/v1/chat/completions", {
        "model": "tiny", "max_tokens": 40, "temperature": 0.0, "messages": [{"role": "user", "content": "go"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}}}})
    assert reply.status_code == 200, reply.text
    json.loads(reply.json()["choices"][0]["message"]["content"])
    completion_tokens = reply.json()["usage"]["completion_tokens"]
    total, steps = _grammar_mask_metric(state_dir)
    # One observation per decode step with a constrained row: at least one, at most one per token.
    assert 1 <= steps - steps_before <= completion_tokens, (steps - steps_before, completion_tokens)
    # Seconds, not milliseconds or nanoseconds: a mask over the tiny vocabulary is well under
    # a second per step, and it is not free.
    per_step = (total - total_before) / (steps - steps_before)
    assert 0 < per_step < 1.0, per_step


def test_a_router_given_an_unknown_tool_call_parser_refuses_to_start_naming_the_flag(tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "services.router", "--model-dir", str(tiny_model_dir),
                          "--tool-call-parser", "qwen_xml", "--http-port", "0", "--grpc-port", "0",
                          "--metrics-port", "0", "--scheduler-address", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "tool_call_parser" in out.stderr and "hermes" in out.stderr and "Traceback" not in out.stderr, out.stderr

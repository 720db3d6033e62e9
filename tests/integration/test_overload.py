"""Overload by behaviour: a tenant flooding the mesh gets 429 with a retry hint, while
another tenant's requests, sent during the flood, are all admitted and complete.
(No timing thresholds: the per-tenant caps are what keep the other tenant's queue empty.)"""
from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import pytest

from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh

ROOT = Path(__file__).resolve().parents[2]
FLOOD, POLITE = "sk-flood", "sk-polite"
NUM_FLOOD = 24


def post(port: int, key: str, max_tokens: int, results: list, index: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        body = {"model": "tiny", "prompt": f"request {index} from {key}", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0}
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = json.loads(resp.read() or b"null")
        results[index] = (resp.status, dict(resp.getheaders()), payload)
    finally:
        conn.close()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("overload")
    (state_dir / "keys.txt").write_text(f"{FLOOD} flooder\n{POLITE} polite\n")
    env = {"WEFT_EXECUTOR_NUM_THREADS": "1", "WEFT_SCHEDULER_MAX_IN_FLIGHT": "8",
           "WEFT_SCHEDULER_MAX_QUEUE": "16", "WEFT_SCHEDULER_MAX_IN_FLIGHT_PER_TENANT": "2",
           "WEFT_SCHEDULER_MAX_QUEUE_PER_TENANT": "2"}
    with launched_mesh(state_dir, tiny_model_dir, 1, env, ["--keys-file", str(state_dir / "keys.txt")],
                       timeout_s=120, check_orphans=False) as (_, state):
        yield state


def test_flooding_tenant_gets_429s_while_the_other_tenant_is_served(mesh):
    port = mesh.instance("router").ports["router_http_port"]
    flood: list = [None] * NUM_FLOOD
    polite: list = [None] * 4
    threads = [threading.Thread(target=post, args=(port, FLOOD, 400, flood, i)) for i in range(NUM_FLOOD)]
    for t in threads:
        t.start()
    # The polite tenant's requests go out while the flood is in flight.
    wait_for(lambda: any(r is not None for r in flood), 60, "the first flood responses (the 429s)")
    polite_threads = [threading.Thread(target=post, args=(port, POLITE, 8, polite, i)) for i in range(4)]
    for t in polite_threads:
        t.start()
    for t in threads + polite_threads:
        t.join(150)
    assert all(r is not None for r in flood + polite), "a request did not come back"
    assert [status for status, _, _ in polite] == [200] * 4
    assert all(body["usage"]["completion_tokens"] == 8 for _, _, body in polite)
    refused = [(h, body) for status, h, body in flood if status == 429]
    served = [body for status, _, body in flood if status == 200]
    assert refused and served and len(refused) + len(served) == NUM_FLOOD
    headers, body = refused[0]
    assert int(headers["Retry-After"]) >= 1 and int(headers["retry-after-ms"]) > 0
    assert "flooder" in json.dumps(body) or "limit" in json.dumps(body)

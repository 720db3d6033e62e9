"""Overload by behaviour: a tenant flooding the mesh gets 429 with a retry hint, while
another tenant's requests, sent during the flood, are all admitted and complete.
(No timing thresholds: the per-tenant caps are what keep the other tenant's queue empty.)

The 429s come from an allowance seen full, not from a race: the flood's first 4 requests
are long (2000 tokens) and take the flooding tenant's whole allowance (2 in flight, 2
queued); only once the scheduler's queue shows the 2 waiting do the other 20 go out. The
router retries a refused request (3 attempts, ~0.2 s apart: the scheduler's retry hint)
before answering 429, and a room opens in the allowance only when one of the 2 running
finishes its 2000 tokens, each room taken by one request: the 20 would need ten such
rounds within their retries to all get in. 24 requests of 400 tokens at once were refused
only when the threads' requests overlapped, which a loaded CI box once did not do."""
from __future__ import annotations

import http.client
import json
import re
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh

ROOT = Path(__file__).resolve().parents[2]
FLOOD, POLITE = "sk-flood", "sk-polite"
NUM_FLOOD = 24
NUM_HELD = 4  # the flooding tenant's whole allowance: MAX_IN_FLIGHT_PER_TENANT + MAX_QUEUE_PER_TENANT
HELD_TOKENS = 2000  # ~0.6 s of decode at the fastest on the tiny model (2048-token context)


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


def queue_depth(state) -> float:
    """The scheduler's ``weft_queue_depth``: requests waiting for an in-flight slot."""
    port = state.instance("scheduler").ports["scheduler_metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(r'^weft_queue_depth\{service="scheduler"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


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
    held = [threading.Thread(target=post, args=(port, FLOOD, HELD_TOKENS, flood, i)) for i in range(NUM_HELD)]
    for t in held:
        t.start()

    def allowance_full() -> bool:
        if any(r is not None for r in flood[:NUM_HELD]):  # pytest.fail is not an Exception: wait_for stops
            pytest.fail(f"a long flood request came back before the queue was seen full: {flood[:NUM_HELD]}")
        return queue_depth(mesh) >= NUM_HELD - 2  # 2 in flight (the tenant's cap), the rest waiting
    wait_for(allowance_full, 60, "the flooding tenant's 2 queued requests in the scheduler's queue")
    # The rest of the flood meets the full allowance; the polite tenant's requests go out with
    # it, while the flood is in flight.
    rest = [threading.Thread(target=post, args=(port, FLOOD, 16, flood, i)) for i in range(NUM_HELD, NUM_FLOOD)]
    polite_threads = [threading.Thread(target=post, args=(port, POLITE, 8, polite, i)) for i in range(4)]
    for t in rest + polite_threads:
        t.start()
    for t in held + rest + polite_threads:
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

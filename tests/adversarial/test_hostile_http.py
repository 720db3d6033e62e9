"""A real router process against hostile HTTP clients and an unlucky operator (issue 12 §2,
§4): a huge prompt never freezes the router for everyone, a prompt that can never fit
is refused before tokenizing, and readiness follows the mesh while liveness does not."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from services.mesh.nats_server import free_port
from tests.integration.conftest import ProcessGroup, ServiceProcess, wait_for
from tests.integration.conftest import nats_server, processes  # noqa: F401  (fixtures)

MODEL = "tiny"
KEY = "sk-hostile"
# Large enough that a prompt under the character bound takes seconds to tokenize.
MAX_MODEL_LEN = 50_000
NUM_HEALTH_CALLS = 20


def start_router(log_dir: Path, model_dir: Path, scheduler_address: str, *flags: str) -> ServiceProcess:
    """``python -m services.router`` on free ports; ``.http`` is its HTTP base URL."""
    grpc_port, http_port = free_port(), free_port()
    keys = log_dir / "router-keys.txt"
    keys.write_text(f"{KEY} acme\n")
    proc = ServiceProcess("router", [
        "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
        "--model-dir", str(model_dir), "--served-model-name", MODEL, "--scheduler-address", scheduler_address,
        "--keys-file", str(keys), *flags], grpc_port, log_dir / f"router-{grpc_port}.log")
    proc.http = f"http://127.0.0.1:{http_port}"
    return proc.wait_healthy(60)


@pytest.fixture(scope="module")
def lone_router(tmp_path_factory, tiny_model_dir) -> Iterator[ServiceProcess]:
    """A router whose scheduler is not there (every check here is refused before it)."""
    router = start_router(tmp_path_factory.mktemp("router"), tiny_model_dir, f"127.0.0.1:{free_port()}",
                          "--max-model-len", str(MAX_MODEL_LEN))
    try:
        yield router
    finally:
        router.stop()


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


async def health_answered_first(base_url: str, slow: Callable[[], Awaitable[object]]) -> tuple[list[str], object]:
    """Run ``slow`` and, meanwhile, ``NUM_HEALTH_CALLS`` sequential ``GET /health``;
    returns the order in which they completed and ``slow``'s result. A router whose loop
    is frozen by ``slow`` answers the later health calls only after ``slow`` is done."""
    order: list[str] = []

    async def run_slow():
        result = await slow()
        order.append("slow")
        return result

    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(run_slow())
        for i in range(NUM_HEALTH_CALLS):
            async with session.get(f"{base_url}/health") as resp:
                assert resp.status == 200
                order.append(f"health-{i}")
        result = await task
    return order, result


def test_health_is_answered_while_a_huge_prompt_is_tokenized_and_refused(lone_router):
    # Under the character bound (so it is tokenized), far over the context in tokens.
    prompt = "hello world " * 45_000

    async def huge():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{lone_router.http}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                    json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as resp:
                return resp.status, await resp.json()

    order, (status, body) = asyncio.run(health_answered_first(lone_router.http, huge))
    assert status == 400, body
    assert body["error"]["param"] == "prompt" and "tokens exceed" in body["error"]["message"]
    assert order[-1] == "slow", order  # every health call was answered while it was tokenized


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"model": MODEL, "prompt": "a" * (10 << 20)}, "prompt"),
    # non-ASCII: the bound allows for NFC composition (4 code points -> 1)
    ("/v1/completions", {"model": MODEL, "prompt": ["ok", "é" * 3_000_000]}, "prompt[1]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a" * (10 << 20)}]},
     "messages"),
])
def test_a_10mb_prompt_is_refused_naming_the_field_and_the_limit(lone_router, path, body, field):
    data = json.dumps(body, ensure_ascii=False).encode()
    req = urllib.request.Request(f"{lone_router.http}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 400
    error = json.loads(err.value.read())["error"]
    assert error["param"] == field
    assert "can never fit" in error["message"] and f"context length of {MAX_MODEL_LEN}" in error["message"]
    assert get(f"{lone_router.http}/health") == (200, {"status": "ok"})


@pytest.mark.parametrize("raw, field", [
    (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "top_k": 100000000000000000000}', "top_k"),
    (b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    (b"[" * 100_000 + b"]" * 100_000, "body"),
])
def test_hostile_json_gets_400_from_a_real_router(lone_router, raw, field):
    req = urllib.request.Request(f"{lone_router.http}/v1/completions", data=raw, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["param"] == field


def test_readiness_follows_the_mesh_while_liveness_does_not(tmp_path, nats_server, processes: ProcessGroup,
                                                           tiny_model_dir):
    """No scheduler: not ready. Scheduler, no executor: not ready. An executor serving:
    ready. Liveness (``/health``) is 200 throughout: restarting the router would not help."""
    scheduler_port = free_port()
    router = start_router(tmp_path, tiny_model_dir, f"127.0.0.1:{scheduler_port}")
    try:
        status, body = get(f"{router.http}/health/ready")
        assert status == 503 and body["status"] == "not_ready" and "scheduler" in body["reason"], body
        assert get(f"{router.http}/health")[0] == 200

        common = ["--nats-url", nats_server.url]
        processes.start("scheduler", *common, port=scheduler_port, name="scheduler-ready")
        wait_for(lambda: "no serving executor" in get(f"{router.http}/health/ready")[1].get("reason", ""),
                 15, "readiness to report the scheduler without executors")
        assert get(f"{router.http}/health")[0] == 200

        processes.start("executor", *common, "--model-dir", str(tiny_model_dir), "--num-kv-blocks", "64",
                        "--num-threads", "1", "--heartbeat-interval-s", "0.2", name="ex-ready")
        wait_for(lambda: get(f"{router.http}/health/ready") == (200, {"status": "ready", "num_serving_executors": 1}),
                 30, "readiness once an executor serves")
    finally:
        router.stop()

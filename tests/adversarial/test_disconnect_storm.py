"""Clients that hang up early must never kill an executor (issue 12, section 1).

A storm of streaming ``/v1/completions`` whose clients abandon the connection 1-80 ms
after sending once killed the engine thread of both executors of a `weft up` mesh: the
router cancels the scheduler stream, the scheduler the executor stream, and a request
cancelled while its add was still in flight to the engine thread made that thread raise
``InvalidStateError`` and die, while health checks stayed green.

Here the storm runs against a real mesh (`weft up --executors 2`, tiny random model), then
the test requires that every executor serves a normal completion again (the response
header names the executor) and that each executor is back to its idle baseline: no
request running or waiting in the engine, every KV block free, no stream open, no request
held by the engine thread, as many asyncio tasks as before the storm.
"""
from __future__ import annotations

import asyncio
import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services.router.http_api import EXECUTOR_HEADER
from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh
from weft.launcher.mesh_state import MeshState
from weft.v1 import executor_pb2, executor_pb2_grpc

MODEL = "tiny"  # the tiny_model_dir fixture's directory name
MESH_SECRET = "storm-mesh-secret"
ENV = {
    "WEFT_MESH_SECRET": MESH_SECRET,
    "WEFT_EXECUTOR_NUM_THREADS": "1",
    "WEFT_EXECUTOR_HEARTBEAT_INTERVAL_S": "0.25",
    "WEFT_EXECUTOR_GRACE_S": "1",
}
NUM_REQUESTS = 240
CONCURRENCY = 36
MAX_TOKENS = 100
HANG_UP_AFTER_S = (0.001, 0.080)  # how long a client waits after sending before it leaves
RECOVERY_S = 60.0  # a deadline for the conditions below, generous for two busy cores
EXECUTORS = {"executor-0", "executor-1"}


def _completion_bytes(port: int, prompt: list[int], stream: bool, max_tokens: int = MAX_TOKENS) -> bytes:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                       "temperature": 0, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


async def _storm(port: int, seed: int) -> int:
    """NUM_REQUESTS streaming completions, CONCURRENCY at a time, each abandoned (connection
    reset) a random 1-80 ms after it was sent. Returns how many were sent."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(CONCURRENCY)
    sent = 0

    async def one(prompt: list[int], linger_s: float) -> None:
        nonlocal sent
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(_completion_bytes(port, prompt, stream=True))
                await writer.drain()
                sent += 1
                await asyncio.sleep(linger_s)  # the client's behaviour under test, not a synchronisation
            finally:
                writer.transport.abort()  # hang up without reading: the connection is reset

    jobs = [([rng.randrange(20, 1000) for _ in range(rng.randint(20, 300))], rng.uniform(*HANG_UP_AFTER_S))
            for _ in range(NUM_REQUESTS)]
    await asyncio.gather(*(one(p, s) for p, s in jobs))
    return sent


def _completion_executor(port: int, prompt: list[int]) -> str | None:
    """A normal (non-streaming) completion; the executor that served it, None on failure."""
    body = json.loads(_completion_bytes(port, prompt, stream=False, max_tokens=8).split(b"\r\n\r\n", 1)[1])
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            reply = json.loads(resp.read())
            if resp.status == 200 and reply["usage"]["completion_tokens"] == 8:
                return resp.headers[EXECUTOR_HEADER]
    except OSError:  # HTTPError (503: no serving executor) and connection errors alike
        return None
    return None


def _wait_until_each_executor_serves(port: int, rng: random.Random, what: str) -> None:
    """Pairs of concurrent completions until each executor has served one (placement
    spreads a pair: the second request sees the first one's load)."""
    served: set[str] = set()

    def each_served() -> bool:
        prompts = [[rng.randrange(20, 1000) for _ in range(24)] for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            served.update(e for e in pool.map(lambda p: _completion_executor(port, p), prompts) if e)
        return EXECUTORS <= served

    wait_for(each_served, RECOVERY_S, what, interval_s=0.1)


def _executor_stats(state: MeshState) -> dict[str, executor_pb2.GetStatsResponse]:
    stats = {}
    for inst in state.by_service("executor"):
        with grpc.insecure_channel(f"127.0.0.1:{inst.ports['executor_port']}") as channel:
            stats[inst.name] = executor_pb2_grpc.ExecutorStub(channel).GetStats(
                executor_pb2.GetStatsRequest(), timeout=5, metadata=(("x-weft-mesh-secret", MESH_SECRET),))
    return stats


def _executor_gauges(state: MeshState) -> dict[str, dict[str, float]]:
    names = ("weft_asyncio_tasks", "weft_executor_streams_running", "weft_executor_engine_requests",
             "weft_settings_version")
    gauges = {}
    for inst in state.by_service("executor"):
        url = f"http://127.0.0.1:{inst.ports['executor_metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            lines = resp.read().decode().splitlines()
        # each of these has one series per executor (weft_settings_version{service="executor"})
        values = {line.split(" ")[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
                  for line in lines if line.startswith(names)}
        gauges[inst.name] = {n: values[n] for n in names}
    return gauges


def _idle_snapshot(state: MeshState) -> dict[str, tuple]:
    """Per executor: (running, waiting, used KV blocks, open streams, engine requests, tasks)."""
    gauges = _executor_gauges(state)
    return {name: (s.num_running, s.num_waiting, s.num_blocks - s.num_free_blocks,
                   gauges[name]["weft_executor_streams_running"], gauges[name]["weft_executor_engine_requests"],
                   gauges[name]["weft_asyncio_tasks"])
            for name, s in _executor_stats(state).items()}


def test_a_storm_of_early_disconnects_leaves_every_executor_serving_and_idle(tmp_path: Path, tiny_model_dir):
    rng = random.Random(1212)
    with launched_mesh(tmp_path, tiny_model_dir, 2, ENV) as (_, state):
        port = state.instance("router").ports["router_http_port"]
        _wait_until_each_executor_serves(port, rng, "both executors to serve before the storm")
        # The baseline counts asyncio tasks, so it waits for the live-settings document too: its
        # first arrival (a republish, ~1-2 s after an executor serves) starts the document
        # inbox's task, which then stays (services/mesh/document_inbox.py).
        wait_for(lambda: all(g["weft_settings_version"] > 0 for g in _executor_gauges(state).values()), RECOVERY_S,
                 "every executor to run the mesh's live-settings document")
        baseline = wait_for(lambda: _idle(_idle_snapshot(state)), RECOVERY_S, "an idle mesh before the storm")

        assert asyncio.run(_storm(port, seed=rng.randrange(1 << 30))) == NUM_REQUESTS

        _wait_until_each_executor_serves(port, rng, "every executor to serve a completion after the storm")
        last: list[dict] = []

        def back_to_baseline() -> bool:
            last[:] = [_idle_snapshot(state)]
            return last[0] == baseline

        try:
            wait_for(back_to_baseline, RECOVERY_S, "executors back to their idle baseline", interval_s=0.2)
        except pytest.fail.Exception:
            pytest.fail(f"not back to the idle baseline {baseline} (running, waiting, used blocks, open streams, "
                        f"engine requests, asyncio tasks); last seen {last}")


def _idle(snapshot: dict[str, tuple]) -> dict[str, tuple] | None:
    return snapshot if all(v[:5] == (0, 0, 0, 0, 0) for v in snapshot.values()) else None

"""The issue 16 streaming path under hostile clients and unlucky operators.

Issue 16 moved every stream's reads into the consumer's own task: the router's
continuation and the scheduler's migration watch stalls with one timer per stream whose
verdict cancels the reader (and takes the cancellation back), and the executor's Generate
reads the engine in its handler task, cancelled out of that wait by Abort or a dead engine.
Each turns a cancellation into something else, or lets one through; a mistake there leaks a
stream, a task or an engine request, or ends a surviving stream wrongly.

Attacked here through a real mesh (`weft up --executors 2`, the tiny model, the router's
gRPC door): clients that leave before the first chunk, right after it, mid-stream, after a
random delay or by their deadline, slow and never-reading clients beside fast ones, and
clients that leave while an executor is paused (their streams migrating) or the scheduler
was killed (their streams continuing). Required every time: the streams nobody left end
with their undisturbed greedy tokens, and every service returns to its idle baseline (no
stream open, no engine request held, as many asyncio tasks as before).
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh
from weft.launcher.mesh_state import read_state
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

ENV = {
    "WEFT_MESH_SECRET": "issue16-stream-path",
    "WEFT_EXECUTOR_NUM_THREADS": "1",
    "WEFT_EXECUTOR_HEARTBEAT_INTERVAL_S": "0.25",
    "WEFT_EXECUTOR_GRACE_S": "1",
    "WEFT_SCHEDULER_GRACE_S": "1",
    "WEFT_SCHEDULER_MIGRATION_MIN_STALL_S": "1.0",
    "WEFT_SCHEDULER_MIGRATION_STALL_FACTOR": "10",
    "WEFT_SCHEDULER_MIGRATION_FIRST_TOKEN_TIMEOUT_S": "8",
    "WEFT_ROUTER_CONTINUATION_MIN_STALL_S": "0.5",
    "WEFT_ROUTER_CONTINUATION_PROBE_TIMEOUT_S": "0.5",
    "WEFT_ROUTER_CONTINUATION_WAIT_S": "30",
}
NUM_PROMPTS = 8
PROMPTS = [[(7 * i + 13 * j) % 500 + 20 for j in range(12 + i)] for i in range(NUM_PROMPTS)]
LONG_TOKENS = 1500  # long enough that a pause lands mid-generation
CALL_TIMEOUT_S = 60.0  # every client call has a deadline: a hang fails as DEADLINE_EXCEEDED
RECOVERY_S = 60.0  # a deadline for the conditions below, generous for two busy cores
GAUGES = ("weft_asyncio_tasks", "weft_executor_streams_running", "weft_executor_engine_requests")


class _Mesh:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.reference: dict[int, list[int]] = {}

    @property
    def state(self):
        return read_state(self.state_dir)

    def gauges(self) -> dict[str, tuple[float, ...]]:
        """Per service: its asyncio tasks (and an executor's open streams and engine requests)."""
        out = {}
        for inst in self.state.instances:
            port = next((v for k, v in inst.ports.items() if k.endswith("metrics_port")), None)
            if port is None:
                continue
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                lines = resp.read().decode().splitlines()
            out[inst.name] = tuple(float(line.split(" ")[1]) for line in lines if line.startswith(GAUGES))
        return out

    def settings_versions(self) -> list[float]:
        """Every service's ``weft_settings_version`` (0 until its first live-settings document)."""
        versions = []
        for inst in self.state.instances:
            port = next((v for k, v in inst.ports.items() if k.endswith("metrics_port")), None)
            if port is None:
                continue
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                versions += [float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines()
                             if line.startswith("weft_settings_version")]
        return versions

    def log_count(self, service: str, event: str) -> int:
        path = self.state_dir / "logs" / f"{service}.log"
        return path.read_text(errors="replace").count(event) if path.exists() else 0


class _Stream:
    """One client stream: what it received and how it ended."""

    def __init__(self, prompt: int) -> None:
        self.prompt = prompt
        self.tokens: list[int] = []
        self.finish_reason = 0
        self.num_migrations = 0
        self.executor = ""
        self.error: str | None = None
        self.flowing = asyncio.Event()  # set at its 5th token (or its end)
        self.call = None

    async def run(self, stub, max_tokens: int, seconds_per_chunk: float = 0.0, timeout_s: float = CALL_TIMEOUT_S,
                  leave_after_chunks: int | None = None) -> _Stream:
        request = router_pb2.GenerateRequest(
            request_id=f"a3-{self.prompt}-{time.monotonic_ns()}", token_ids=router_pb2.TokenIds(ids=PROMPTS[self.prompt]),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        self.call = stub.Generate(request, timeout=timeout_s)
        num_chunks = 0
        try:
            if leave_after_chunks == 0:
                self.call.cancel()
            async for chunk in self.call:
                num_chunks += 1
                self.tokens.extend(chunk.token_ids_delta)
                self.executor = chunk.executor or self.executor
                if len(self.tokens) >= 5:
                    self.flowing.set()
                if chunk.finish_reason:
                    self.finish_reason, self.num_migrations = chunk.finish_reason, chunk.num_migrations
                if leave_after_chunks is not None and num_chunks >= leave_after_chunks:
                    self.call.cancel()
                if seconds_per_chunk:
                    await asyncio.sleep(seconds_per_chunk)  # the slow client under test, not a synchronisation
        except grpc.aio.AioRpcError as exc:
            self.error = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            self.error = "left"
        finally:
            self.flowing.set()
        return self

    def undisturbed(self, mesh: _Mesh, max_tokens: int) -> bool:
        return self.error is None and self.finish_reason != 0 and self.tokens == mesh.reference[self.prompt][:max_tokens]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir) -> _Mesh:
    state_dir = tmp_path_factory.mktemp("issue16-stream-path")
    with launched_mesh(state_dir, tiny_model_dir, 2, ENV, check_orphans=False):
        m = _Mesh(state_dir)

        async def references() -> None:
            async with grpc.aio.insecure_channel(m.state.grpc_address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                for i in range(NUM_PROMPTS):
                    s = await _Stream(i).run(stub, LONG_TOKENS)
                    assert s.error is None and len(s.tokens) == LONG_TOKENS, (s.error, len(s.tokens))
                    m.reference[i] = s.tokens

        asyncio.run(references())
        yield m


def _back_to_baseline(mesh: _Mesh, baseline: dict[str, tuple[float, ...]]) -> None:
    last: list[dict] = [{}]

    def same() -> bool:
        last[0] = mesh.gauges()
        return last[0] == baseline

    try:
        wait_for(same, RECOVERY_S, "every service back to its idle baseline", interval_s=0.2)
    except pytest.fail.Exception:
        pytest.fail(f"not back to the idle baseline {baseline} (asyncio tasks[, open streams, engine "
                    f"requests]); last seen {last[0]}")


def _idle_baseline(mesh: _Mesh) -> dict[str, tuple[float, ...]]:
    # Tasks are counted, so first every live-settings document must have arrived: its first
    # arrival starts a service's document-inbox task, which then stays (document_inbox.py).
    wait_for(lambda: (v := mesh.settings_versions()) and all(x > 0 for x in v), RECOVERY_S,
             "every service to run the mesh's live-settings document")
    return wait_for(lambda: (g := mesh.gauges()) and all(v[1:] in ((), (0.0, 0.0)) for v in g.values()) and g,
                    RECOVERY_S, "an idle mesh")


def test_grpc_clients_leaving_at_every_point_beside_slow_and_fast_ones_leave_the_mesh_idle(mesh):
    baseline = _idle_baseline(mesh)
    rng = random.Random(1616)

    async def attack() -> tuple[list[_Stream], list[_Stream]]:
        async with grpc.aio.insecure_channel(mesh.state.grpc_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            gate = asyncio.Semaphore(32)

            async def leaver(i: int) -> None:
                kind = rng.choice(("before", "first", "mid", "delay", "deadline"))
                s = _Stream(i % NUM_PROMPTS)
                async with gate:
                    if kind == "delay":
                        run = asyncio.ensure_future(s.run(stub, 400))
                        await asyncio.sleep(rng.uniform(0.0, 0.1))  # the client's behaviour, not a synchronisation
                        run.cancel()
                        await asyncio.gather(run, return_exceptions=True)
                    else:
                        await s.run(stub, 400, timeout_s=rng.uniform(0.05, 0.6) if kind == "deadline" else CALL_TIMEOUT_S,
                                    leave_after_chunks={"before": 0, "first": 1, "mid": rng.randint(2, 40)}.get(kind))

            never = [_Stream(i) for i in range(2)]
            never_calls = [stub.Generate(router_pb2.GenerateRequest(
                request_id=f"a3-never-{i}", token_ids=router_pb2.TokenIds(ids=PROMPTS[i]),
                sampling=common_pb2.SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)),
                timeout=CALL_TIMEOUT_S) for i, _ in enumerate(never)]
            slow = [_Stream(i) for i in range(3)]
            fast = [_Stream(i % NUM_PROMPTS) for i in range(12)]
            await asyncio.gather(*(leaver(i) for i in range(600)),
                                 *(s.run(stub, 12, seconds_per_chunk=0.2) for s in slow),
                                 *(s.run(stub, LONG_TOKENS) for s in fast))
            for call in never_calls:  # they never read a chunk; now they leave
                call.cancel()
            return slow, fast

    slow, fast = asyncio.run(attack())
    assert all(s.undisturbed(mesh, 12) for s in slow), [(s.error, len(s.tokens)) for s in slow]
    assert all(s.undisturbed(mesh, LONG_TOKENS) for s in fast), [(s.error, len(s.tokens)) for s in fast]
    _back_to_baseline(mesh, baseline)


@pytest.mark.parametrize("disturbance", ["executor-paused", "scheduler-killed"])
def test_clients_leaving_while_their_streams_migrate_or_continue_leave_the_rest_identical(mesh, disturbance):
    baseline = _idle_baseline(mesh)
    rng = random.Random(16 if disturbance == "executor-paused" else 17)
    moved_event, service = (("request_migrating", "scheduler") if disturbance == "executor-paused"
                            else ("stream_continuing", "router"))
    moved_before = mesh.log_count(service, moved_event)

    async def attack() -> tuple[list[_Stream], set[int]]:
        async with grpc.aio.insecure_channel(mesh.state.grpc_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            streams = [_Stream(i % NUM_PROMPTS) for i in range(16)]
            runs = [asyncio.ensure_future(s.run(stub, LONG_TOKENS)) for s in streams]
            await asyncio.gather(*(s.flowing.wait() for s in streams))
            if disturbance == "executor-paused":
                counts: dict[str, int] = {}
                for s in streams:
                    counts[s.executor] = counts.get(s.executor, 0) + 1
                victim = mesh.state.instance(max(counts, key=counts.get)).pid
                os.kill(victim, signal.SIGSTOP)
            else:
                victim = mesh.state.instance("scheduler").pid
                os.kill(victim, signal.SIGKILL)  # the launcher restarts it
            left = set(rng.sample(range(len(streams)), len(streams) // 2))
            try:
                for i in sorted(left, key=lambda _: rng.random()):  # they leave during the stall / the outage
                    await asyncio.sleep(rng.uniform(0.0, 0.3))  # the clients' behaviour, not a synchronisation
                    streams[i].call.cancel()
                while mesh.log_count(service, moved_event) == moved_before and not all(r.done() for r in runs):
                    await asyncio.sleep(0.1)  # polls a condition (the move was logged), bounded by the call deadlines
            finally:
                if disturbance == "executor-paused":
                    os.kill(victim, signal.SIGCONT)
            await asyncio.gather(*runs)
            return streams, left

    streams, left = asyncio.run(attack())
    stayed = [s for i, s in enumerate(streams) if i not in left]
    assert all(s.undisturbed(mesh, LONG_TOKENS) for s in stayed), [(s.error, len(s.tokens)) for s in stayed]
    assert any(s.num_migrations for s in stayed), "the disturbance moved none of the streams that stayed"
    for i in left:  # a client that left saw a prefix of its stream, never another one's tokens
        s = streams[i]
        assert s.tokens == mesh.reference[s.prompt][:len(s.tokens)], f"stream {i} left with foreign tokens"
    _back_to_baseline(mesh, baseline)

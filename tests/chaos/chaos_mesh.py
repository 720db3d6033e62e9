"""The chaos suite's mesh handle, load generator and assertions (tests/chaos/test_chaos.py).

NUM_STREAMS concurrent greedy streams of MAX_TOKENS tokens run against a `weft up` mesh
while a test disturbs one service; each stream's Outcome records how it ended, which
executors served it and how long the client waited between chunks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
import grpc
from tests.integration.conftest import wait_for
from weft.launcher.mesh_state import MeshState, read_state
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
NUM_STREAMS = 6
MAX_TOKENS = 600
CALL_TIMEOUT_S = 40.0  # every client call has a deadline: a hang would fail as DEADLINE_EXCEEDED
PROMPTS = [[(7 * i + 13 * j) % 500 + 20 for j in range(12 + i)] for i in range(NUM_STREAMS)]
MESH_SECRET = "chaos-mesh-secret"  # internal calls must carry it (services/mesh/mesh_auth.py)
NATS_SECRET = "chaos-nats-secret"  # the launcher derives the per-role NATS logins from it
CHAOS_ENV = {
    "WEFT_MESH_SECRET": MESH_SECRET,
    "WEFT_NATS_SECRET": NATS_SECRET,
    "WEFT_EXECUTOR_NUM_THREADS": "1",
    "WEFT_EXECUTOR_HEARTBEAT_INTERVAL_S": "0.25",
    "WEFT_EXECUTOR_GRACE_S": "1",
    "WEFT_SCHEDULER_GRACE_S": "1",
    "WEFT_SCHEDULER_MIGRATION_MIN_STALL_S": "1.0",
    "WEFT_SCHEDULER_MIGRATION_STALL_FACTOR": "10",
    "WEFT_SCHEDULER_MIGRATION_FIRST_TOKEN_TIMEOUT_S": "8",
    # A paused scheduler is given up on within ~1 s; a killed one is waited for through its
    # restart (a bound, not a threshold: a restart on two busy cores can take seconds).
    "WEFT_ROUTER_CONTINUATION_MIN_STALL_S": "0.5",
    "WEFT_ROUTER_CONTINUATION_PROBE_TIMEOUT_S": "0.5",
    "WEFT_ROUTER_CONTINUATION_WAIT_S": "30",
}


@dataclass
class Mesh:
    state_dir: Path
    process: subprocess.Popen
    reference: dict[int, list[int]] = field(default_factory=dict)

    @property
    def state(self) -> MeshState:
        return read_state(self.state_dir)

    def chaos_now(self, action: str, name: str) -> dict:
        """The same control call as `weft chaos`, without a CLI process start (~1 s)."""
        import asyncio

        from weft.launcher.control import request_chaos

        return asyncio.run(request_chaos(self.state, action, name))

    def weft(self, *args: str, timeout_s: float = 120) -> str:
        out = subprocess.run([sys.executable, "-m", "weft", *args, "--state-dir", str(self.state_dir)],
                             capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        assert out.returncode == 0, f"weft {' '.join(args)} failed: {out.stderr}{out.stdout}"
        return out.stdout

    def num_router_continuations(self) -> int:
        """Streams the router has re-issued to the scheduler so far (its log's events)."""
        path = self.state_dir / "logs" / "router.log"
        return path.read_text(errors="replace").count("stream_continuing") if path.exists() else 0

    def serving_executors(self) -> set[str]:
        with grpc.insecure_channel(f"127.0.0.1:{self.state.instance('scheduler').ports['scheduler_port']}") as ch:
            reply = scheduler_pb2_grpc.SchedulerStub(ch).ListExecutors(
                scheduler_pb2.ListExecutorsRequest(), timeout=2, metadata=(("x-weft-mesh-secret", MESH_SECRET),))
        return {e.heartbeat.name for e in reply.executors if e.heartbeat.state == 2}  # EXECUTOR_STATE_SERVING


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    executors: list[str] = field(default_factory=list)
    finish_reason: int = 0
    num_migrations: int = 0
    error: grpc.StatusCode | None = None
    num_terminal_states: int = 0
    max_gap_s: float = 0.0  # longest wait between two chunks: what a migration cost the client
    degradation_rung: int = 0  # the rung the first chunk reported

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason != 0


def generate(mesh: Mesh, i: int, outcome: Outcome, started: threading.Event | None = None,
             max_tokens: int = MAX_TOKENS) -> Outcome:
    request = router_pb2.GenerateRequest(
        request_id=f"chaos-{i}-{time.monotonic_ns()}", token_ids=router_pb2.TokenIds(ids=PROMPTS[i]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    try:
        with grpc.insecure_channel(mesh.state.grpc_address) as channel:
            last = None
            for chunk in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=CALL_TIMEOUT_S):
                now = time.monotonic()
                outcome.max_gap_s = max(outcome.max_gap_s, now - last) if last is not None else 0.0
                last = now
                if not outcome.tokens:
                    outcome.degradation_rung = chunk.degradation_rung
                outcome.tokens.extend(chunk.token_ids_delta)
                if chunk.executor and chunk.executor not in outcome.executors:
                    outcome.executors.append(chunk.executor)
                if started is not None and len(outcome.tokens) >= 5:
                    started.set()
                if chunk.finish_reason:
                    outcome.finish_reason = chunk.finish_reason
                    outcome.num_migrations = chunk.num_migrations
                    outcome.num_terminal_states += 1
    except grpc.RpcError as exc:
        outcome.error = exc.code()
        outcome.num_terminal_states += 1
    return outcome


def under_load(mesh: Mesh, disturb, max_tokens: int = MAX_TOKENS) -> list[Outcome]:
    """NUM_STREAMS concurrent streams; ``disturb(outcomes)`` runs once all have tokens
    flowing. Returns when every stream has ended (each has a client deadline)."""
    outcomes = [Outcome() for _ in PROMPTS]
    started = [threading.Event() for _ in PROMPTS]
    threads = [threading.Thread(target=generate, args=(mesh, i, outcomes[i], started[i], max_tokens), daemon=True)
               for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    for ev in started:
        ev.wait(CALL_TIMEOUT_S)
    disturb(outcomes)
    for t in threads:
        t.join(CALL_TIMEOUT_S + 5)
    assert not any(t.is_alive() for t in threads), "a client stream did not end"
    for i, o in enumerate(outcomes):
        assert o.num_terminal_states == 1, f"stream {i}: {o.num_terminal_states} terminal states"
    return outcomes


def serves_normally(mesh: Mesh) -> float:
    """Seconds until a request completes with the undisturbed tokens again."""
    t0 = time.monotonic()

    def ok():
        o = generate(mesh, 0, Outcome())
        return o.completed and o.tokens == mesh.reference[0]

    wait_for(ok, 60, "the mesh to serve normally again", interval_s=0.2)
    return time.monotonic() - t0


def record(**row) -> None:
    path = os.environ.get("WEFT_CHAOS_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def busiest_executor(outcomes: list[Outcome]) -> str:
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.executors:
            counts[o.executors[0]] = counts.get(o.executors[0], 0) + 1
    return max(counts, key=counts.get)


def assert_all_completed_as_undisturbed(mesh: Mesh, outcomes: list[Outcome]) -> None:
    for i, o in enumerate(outcomes):
        assert o.completed, f"stream {i} ended with {o.error}"
        assert o.tokens == mesh.reference[i], f"stream {i} differs from its undisturbed run"

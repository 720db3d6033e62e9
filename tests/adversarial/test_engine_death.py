"""An executor whose engine thread dies or wedges leaves the mesh and exits for a restart
(issue 12, section 1).

Before: a dead ``weft-engine`` thread left the gRPC server and the heartbeat green, so the
scheduler kept placing requests there and each waited until its deadline. Now the
executor's watchdog turns health NOT_SERVING, publishes a FAILED heartbeat, ends the open
streams with UNAVAILABLE (the scheduler migrates them) and exits with status 70.

The fault is injected in a real executor process: this module run as ``python -m
tests.adversarial.test_engine_death`` is the executor with ``LLMEngine.step`` patched so a
step holding a request whose prompt starts with ``TRIGGER`` either raises ``SystemExit``
(nothing in the engine loop may catch that: the thread ends) or blocks for good (wedged).
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.mesh.nats_bus import EventBus
from tests.integration.conftest import free_port, nats_server  # noqa: F401  (a fixture)
from weft.v1 import common_pb2, events_pb2, executor_pb2, executor_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
FAULT_ENV = "WEFT_TEST_ENGINE_FAULT"  # die | wedge (read by the fault-injected executor below)
TRIGGER = [1001, 1002, 1003]
EXIT_ENGINE_FAILED = 70  # services/executor/app.py
ENGINE_STALL_S = 3.0  # the executor's own wedge threshold (a flag under test, not a test timing)
DEADLINE_S = 60.0  # for every wait below; a healthy run takes a few seconds


async def _until(cond, what: str) -> None:
    """Poll ``cond`` on the loop until truthy, failing with ``what`` at the deadline."""
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {DEADLINE_S}s waiting for {what}")
        await asyncio.sleep(0.05)


async def _scenario(model_dir: Path, nats_url: str, fault: str, log_path: Path) -> None:
    port = free_port()
    name = f"executor-{fault}"
    heartbeats: list[int] = []
    bus = EventBus(nats_url, "test-engine-death")
    await bus.subscribe("heartbeat", events_pb2.ExecutorHeartbeat,
                        lambda hb, _delivery: heartbeats.append(hb.state), source=name)
    await bus.start()
    assert await bus.wait_connected(DEADLINE_S), "the test's NATS client did not connect"
    argv = [sys.executable, "-m", "tests.adversarial.test_engine_death", "--model-dir", str(model_dir),
            "--name", name, "--port", str(port), "--nats-url", nats_url, "--num-threads", "1",
            "--heartbeat-interval-s", "0.25", "--grace-s", "1", "--engine-stall-s", str(ENGINE_STALL_S)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), WEFT_LOG_FORMAT="json", PYTHONUNBUFFERED="1", **{FAULT_ENV: fault})
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        await _until(lambda: events_pb2.EXECUTOR_STATE_SERVING in heartbeats or process.poll() is not None,
                     "the executor's SERVING heartbeat")
        assert process.poll() is None, log_path.read_text()[-3000:]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health: list[int] = []

            async def watch_health() -> None:
                try:
                    async for reply in health_pb2_grpc.HealthStub(channel).Watch(
                            health_pb2.HealthCheckRequest(service="")):
                        health.append(reply.status)
                except grpc.aio.AioRpcError:
                    pass  # the server went away: the statuses seen so far are the record

            watcher = asyncio.ensure_future(watch_health())
            stub = executor_pb2_grpc.ExecutorStub(channel)
            sampling = common_pb2.SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
            normal = stub.Generate(executor_pb2.ExecuteRequest(
                request_id="normal", prompt_token_ids=[5, 6, 7, 8], sampling=sampling), timeout=DEADLINE_S)
            await normal.read()  # the first chunk: the request is running
            poisoned = stub.Generate(executor_pb2.ExecuteRequest(
                request_id="poisoned", prompt_token_ids=TRIGGER + [9, 10], sampling=sampling), timeout=DEADLINE_S)
            for call in (normal, poisoned):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while (chunk := await call.read()) is not grpc.aio.EOF:
                        assert not chunk.finish_reason, "a stream finished on a dead engine"
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value
            status = await asyncio.wait_for(asyncio.to_thread(process.wait, DEADLINE_S), DEADLINE_S + 1)
            await asyncio.wait_for(watcher, DEADLINE_S)
        assert status == EXIT_ENGINE_FAILED, log_path.read_text()[-3000:]
        assert health_pb2.HealthCheckResponse.NOT_SERVING in health, health
        assert events_pb2.EXECUTOR_STATE_FAILED in heartbeats, heartbeats
        logged = log_path.read_text()
        assert ("engine_dead" if fault == "die" else "engine_wedged") in logged
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        await bus.close()


@pytest.mark.parametrize("fault", ["die", "wedge"])
def test_an_executor_whose_engine_dies_or_wedges_leaves_the_mesh_and_exits(tmp_path, tiny_model_dir, nats_server,
                                                                           fault):
    asyncio.run(_scenario(tiny_model_dir, nats_server.url, fault, tmp_path / f"executor-{fault}.log"))


# -- the fault-injected executor (run as a module by the test above) ----------------------
def _run_faulty_executor() -> None:
    fault = os.environ[FAULT_ENV]
    from services.executor.app import main
    from services.executor.engine.engine import LLMEngine

    real_step = LLMEngine.step
    held_since: list[float] = []

    def step(self):
        seqs = list(self.requests.values())
        if any(seq.prompt_token_ids[:len(TRIGGER)] == TRIGGER for seq in seqs):
            if fault == "die":
                raise SystemExit("injected: the engine thread ends")
            threading.Event().wait()  # injected: wedged for good
        if seqs and all(seq.output_token_ids for seq in seqs):
            # The test sends the poisoned request only after the normal stream's first chunk;
            # on a loaded box the normal stream could decode all its tokens before that request
            # arrives and finish instead of failing with the engine. So once it has a token, it
            # is held (no step, no token) until the poisoned request is added: the thread goes
            # back to its inbox between these empty steps, so the add is applied meanwhile.
            if not held_since:
                held_since.append(time.monotonic())
            if time.monotonic() - held_since[0] > DEADLINE_S:
                raise RuntimeError(f"injected hold: no poisoned request within {DEADLINE_S}s")
            time.sleep(0.01)  # a poll's pace, not a timing the test relies on
            return []
        return real_step(self)

    LLMEngine.step = step
    asyncio.run(main())


if __name__ == "__main__":
    _run_faulty_executor()

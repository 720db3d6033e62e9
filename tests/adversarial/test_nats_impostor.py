"""Issue 12 §3: NATS must not be an open door.

The attack, as found: with ``WEFT_MESH_SECRET`` set, a NATS client publishes
``ExecutorHeartbeat(name="executor-0", address=<its own gRPC server>)``; the scheduler
replaced the real executor-0 and sent tenants' prompts and the mesh secret header there.

Here a real nats-server, scheduler and executor-0 run as processes; the impostor is a
fake Executor gRPC server that records every call, plus a publisher of its heartbeats.
It must get no call at all (so no prompt and no secret), whether NATS is open (the
signature is the only lock left) or requires credentials and the impostor has stolen the
executor role's NATS password. Without credentials it cannot even connect.
"""
from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent import futures

import grpc
import nats
import pytest

from services.mesh import nats_auth
from services.mesh.nats_server import NatsServer, free_port
from services.mesh.service_main import EXIT_CONFIG
from tests.integration.conftest import ProcessGroup, wait_for
from weft.v1 import common_pb2, events_pb2, executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

SECRET = "adversarial-mesh-secret"
SECRET_MD = (("x-weft-mesh-secret", SECRET),)
HEARTBEAT_S = 0.2
FORGED_TOKEN = 666


class FakeExecutor(executor_pb2_grpc.ExecutorServicer):
    """The impostor's gRPC server: records each call's metadata, answers forged tokens."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        executor_pb2_grpc.add_ExecutorServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def Generate(self, request, context):
        self.calls.append(dict(context.invocation_metadata()))
        yield executor_pb2.ExecuteResponse(request_id=request.request_id, token_ids_delta=[FORGED_TOKEN],
                                           finish_reason=common_pb2.FINISH_REASON_LENGTH, executor="executor-0")


class HeartbeatForger:
    """Publishes the impostor's heartbeat for ``executor-0`` every 20 ms from a thread."""

    def __init__(self, url: str, template: events_pb2.ExecutorHeartbeat, address: str, login: dict) -> None:
        self.url, self.login = url, login
        self.msg = events_pb2.ExecutorHeartbeat()
        self.msg.CopyFrom(template)
        self.msg.address = address
        self.msg.header.source, self.msg.header.epoch = "executor-0", uuid.uuid4().hex
        self.num_sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        nc = await nats.connect(self.url, **self.login)
        try:
            while not self._stop.is_set():
                self.msg.header.sequence += 1
                await nc.publish("weft.heartbeat.executor-0", self.msg.SerializeToString())
                await nc.flush()
                self.num_sent += 1
                await asyncio.sleep(0.02)
        finally:
            await nc.close()

    def __enter__(self) -> HeartbeatForger:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def listed(stub) -> dict[str, events_pb2.ExecutorHeartbeat]:
    reply = stub.ListExecutors(scheduler_pb2.ListExecutorsRequest(), metadata=SECRET_MD, timeout=2)
    return {e.heartbeat.name: e.heartbeat for e in reply.executors}


@pytest.mark.parametrize("nats_mode", ["open_nats", "nats_auth_with_stolen_executor_password"])
def test_an_impostor_heartbeat_for_executor_0_gets_no_request_and_no_mesh_secret(nats_mode, tiny_model_dir,
                                                                                 tmp_path):
    passwords = nats_auth.random_passwords() if nats_mode != "open_nats" else None
    server = NatsServer(log_path=tmp_path / "nats.log", **({"passwords": passwords} if passwords else {}))
    group = ProcessGroup(tmp_path)
    fake = FakeExecutor()
    channel = None
    try:
        server.start()
        env = {"WEFT_MESH_SECRET": SECRET}
        role_env = (lambda role: server.client_env(role)) if passwords else (lambda role: {})
        group.start("executor", "--nats-url", server.url, "--model-dir", str(tiny_model_dir), "--name", "executor-0",
                    "--num-kv-blocks", "128", "--block-size", "16", "--num-threads", "1",
                    "--heartbeat-interval-s", str(HEARTBEAT_S), "--grace-s", "1",
                    env={**env, **role_env("executor")}, name="executor-0", wait=False)
        scheduler = group.start("scheduler", "--nats-url", server.url, "--missed-heartbeats", "3", "--grace-s", "1",
                                env={**env, **role_env("scheduler")}, name="scheduler", wait=False)
        for proc in group.processes:
            proc.wait_healthy(90)
        channel = grpc.insecure_channel(scheduler.address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        real = wait_for(lambda: (lambda hb: hb if hb and hb.state == events_pb2.EXECUTOR_STATE_SERVING else None)(
            listed(stub).get("executor-0")), 60, "the scheduler to see the real executor-0 SERVING")
        real_address = real.address

        fake.server.start()
        impostor = f"127.0.0.1:{fake.port}"
        login = {"user": "executor", "password": passwords["executor"]} if passwords else {}
        seen_impostor = []

        def scheduler_reacted() -> bool:
            if listed(stub)["executor-0"].address == impostor:
                seen_impostor.append(True)
            return bool(seen_impostor) or "heartbeat_rejected" in scheduler.log_path.read_text(errors="replace")

        with HeartbeatForger(server.url, real, impostor, login) as forger:
            wait_for(scheduler_reacted, 30, "the scheduler to take or reject the forged heartbeats")
            tokens = []
            for i in range(10):
                for chunk in stub.Generate(scheduler_pb2.ScheduleRequest(
                        request_id=f"victim-{i}", tenant="victim-tenant", prompt_token_ids=[5, 6, 7, 8, i + 1],
                        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0)),
                        metadata=SECRET_MD, timeout=30):
                    tokens.extend(chunk.token_ids_delta)
            if listed(stub)["executor-0"].address == impostor:
                seen_impostor.append(True)
            assert forger.num_sent > 0
        assert not seen_impostor, "the scheduler moved executor-0 to the impostor's address"
        assert fake.calls == [], f"the impostor got {len(fake.calls)} calls (with the mesh secret)"
        assert len(tokens) == 20  # every request was answered, by the real executor-0
        assert listed(stub)["executor-0"].address == real_address
    finally:
        if channel is not None:
            channel.close()
        fake.server.stop(0)
        group.stop_all()
        server.stop()


def test_nats_with_auth_refuses_anonymous_clients_and_heartbeats_from_any_role_but_executor(tmp_path):
    async def scenario(server: NatsServer, passwords: dict[str, str]) -> None:
        with pytest.raises(Exception):  # nats-py: Authorization Violation, then "no servers"
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        got: list[str] = []
        reader = await nats.connect(server.url, user="scheduler", password=passwords["scheduler"])

        async def on_msg(msg) -> None:
            got.append(msg.subject)

        await reader.subscribe("weft.heartbeat.>", cb=on_msg)
        await reader.flush()
        for role in ("router", "cachestore", "scheduler"):
            violations: list[str] = []

            async def on_error(exc, violations=violations):
                violations.append(str(exc))

            forger = await nats.connect(server.url, user=role, password=passwords[role], error_cb=on_error)
            await forger.publish(f"weft.heartbeat.forged-by-{role}", b"")
            await forger.flush()  # the server has handled the publish: routed or refused
            deadline = asyncio.get_running_loop().time() + 10
            while not violations and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)  # waiting on a condition: the server's -ERR
            assert any("permissions violation" in v.lower() for v in violations), role
            await forger.close()
        executor = await nats.connect(server.url, user="executor", password=passwords["executor"])
        await executor.publish("weft.heartbeat.canary", b"")
        await executor.flush()
        deadline = asyncio.get_running_loop().time() + 10
        while "weft.heartbeat.canary" not in got and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        # The canary was sent after every refused publish had been handled: anything of
        # theirs that had got through would have arrived before it.
        assert got == ["weft.heartbeat.canary"]
        await executor.close()
        await reader.close()

    passwords = nats_auth.random_passwords()
    with NatsServer(log_path=tmp_path / "nats.log", passwords=passwords) as server:
        asyncio.run(scenario(server, passwords))


def test_nats_server_refuses_to_start_without_a_roles_password(tmp_path):
    # Fail closed: a config naming $WEFT_NATS_ROUTER_PASSWORD with it unset stops the server.
    passwords = {role: pw for role, pw in nats_auth.random_passwords().items() if role != "router"}
    server = NatsServer(port=free_port(), log_path=tmp_path / "nats.log", passwords=passwords,
                        permissions=nats_auth.role_permissions())
    with pytest.raises(RuntimeError, match="did not listen"):
        server.start(timeout_s=10)
    assert "WEFT_NATS_ROUTER_PASSWORD" in (tmp_path / "nats.log").read_text()


def test_a_service_logs_in_with_its_roles_credentials_and_one_refused_says_what_to_set_and_exits_78(tmp_path):
    passwords = nats_auth.random_passwords()
    group = ProcessGroup(tmp_path)
    try:
        with NatsServer(log_path=tmp_path / "nats.log", passwords=passwords) as server:
            flags = ("--nats-url", server.url, "--no-disk-fsync", "--grace-s", "1")
            good = group.start("cachestore", *flags, "--disk-dir", str(tmp_path / "a"),
                               env=server.client_env("cachestore"), name="cachestore-good")
            bad = group.start("cachestore", *flags, "--disk-dir", str(tmp_path / "b"), name="cachestore-anon",
                              wait=False)
            # An operator's typo: the scheduler's own user with a wrong password.
            wrong = group.start("scheduler", "--nats-url", server.url, "--grace-s", "1", name="scheduler-wrong",
                                env={**server.client_env("scheduler"), "WEFT_NATS_PASSWORD": "w" * 32}, wait=False)
            wait_for(lambda: '"nats_connected"' in good.log_path.read_text(), 30, "the cachestore to log in")
            # A refused login is a configuration error: one clear line and exit 78, which
            # supervisors do not restart (it used to run on, healthy-looking, never joining).
            for proc in (bad, wrong):
                wait_for(lambda: not proc.running, 30, f"{proc.name} to exit on the refused login")
                assert proc.process.returncode == EXIT_CONFIG, proc.log_tail()
                log = proc.log_path.read_text()
                assert '"nats_authorization_failed"' in log and '"service_config_error"' in log
                assert "WEFT_NATS_PASSWORD" in log and "w" * 32 not in log
            assert passwords["cachestore"] not in good.log_path.read_text()
    finally:
        group.stop_all()

"""The unlucky operator, found while killing executors mid-stream (issue 15): an executor
killed with SIGKILL is restarted by the launcher on the same port and announces SERVING
again, yet the scheduler's next attempt on it failed at once ("failed to connect to all
addresses ... Connection refused"), so a request migrating off a second dying executor
found "no executor to continue on". The pooled channel was in gRPC's reconnect backoff
(which grows to minutes), and even a new channel shared the dead connection's backoff
through gRPC's process-wide subchannel pool. Now a channel in TRANSIENT_FAILURE is replaced
by one with its own subchannels, which connects at once."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from services.scheduler.api.executor_port import ChannelPool
from tests.integration.conftest import free_port


async def _scenario() -> tuple[bool, bool]:
    address = f"127.0.0.1:{free_port()}"
    executor = SimpleNamespace(address=address)
    pool = ChannelPool(1 << 20)
    server = grpc.aio.server()
    try:
        down = await pool.serving(executor)  # the executor is dead: the channel backs off
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(address)
        await server.start()  # restarted on the same port
        return down, await pool.serving(executor)
    finally:
        await server.stop(None)
        await pool.close()


def test_the_scheduler_reaches_an_executor_restarted_on_its_port_without_waiting_out_the_backoff():
    down, back = asyncio.run(_scenario())
    assert not down
    assert back, "the restarted executor was unreachable through the pooled channel"

"""Executors pin a session's blocks by the session id they are given, and two tenants may
choose the same session id: the scheduler must scope it by tenant on its way down, or
tenant B's hop replaces (and B's release frees) tenant A's pinned blocks (issue 12)."""
from __future__ import annotations

import asyncio

from services.scheduler.policy.degradation import Rung
from services.scheduler.state.sessions import executor_session_id
from tests.unit.scheduler.test_placement_rungs import Context, FakeExecutor, schedule_request, start_pools


class RecordingExecutor(FakeExecutor):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.session_ids: list[str] = []

    async def Generate(self, request, context):
        self.session_ids.append(request.session.session_id)
        async for chunk in super().Generate(request, context):
            yield chunk


def test_two_tenants_with_one_session_id_reach_the_executor_under_different_ids():
    fake = RecordingExecutor("full")

    async def main():
        servicer, servers = await start_pools({"full": (fake, Rung.NONE)})
        try:
            for rid, tenant, sid in (("a1", "tenant-a", "shared"), ("b1", "tenant-b", "shared"), ("n1", "tenant-a", "")):
                req = schedule_request(rid)
                req.tenant = tenant
                req.session.session_id = sid
                _ = [c async for c in servicer.Generate(req, Context())]
        finally:
            for server in servers:
                await server.stop(0)
            await servicer.dispatch.port.close()

    asyncio.run(main())
    assert fake.session_ids == ["tenant-a/shared", "tenant-b/shared", ""]


def test_the_executor_session_id_is_tenant_scoped_and_empty_stays_empty():
    assert executor_session_id("a", "s") != executor_session_id("b", "s")
    assert executor_session_id("a", "") == ""

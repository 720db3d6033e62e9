"""The degradation ladder acting through the scheduler's gRPC API: a class whose ladder
reached ``shed`` is refused RESOURCE_EXHAUSTED with a retry hint; classes still on
``none`` are placed as usual (here: no executor, so UNAVAILABLE, past admission)."""
from __future__ import annotations

import asyncio

import grpc

from services.mesh.grpc_server import GrpcServer
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.degradation import DegradationLadder, LadderConfig, LoadSignal, Rung
from services.scheduler.errors import ERROR_RULES
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import Membership
from services.scheduler.policy.placement import PlacementPolicy, make_placer
from services.scheduler.api.events import MeshView
from services.scheduler.api.executor_port import ChannelPool
from services.scheduler.api.servicer import SchedulerServicer
from services.scheduler.dispatch.degrade_steps import DegradeSteps
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.shared.vocabulary import RequestClass
from weft.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc


def test_a_shedding_class_is_refused_with_a_retry_hint_and_other_classes_are_not():
    ladder = DegradationLadder(LadderConfig(min_dwell_s=60))
    batch = RequestClass.BATCH.value  # the ladder keeps one rung per class label
    assert ladder.observe(batch, LoadSignal(admission_fraction=1.0)) is Rung.SHED  # overloaded a moment ago

    async def main():
        servicer = SchedulerServicer(Dispatcher(MeshView(Membership(), KvIndex()), make_placer(PlacementPolicy("kv")),
                                                Admission(4, 4, retry_after_ms=250), ChannelPool(1 << 20),
                                                degrade=DegradeSteps(ladder)))
        server = GrpcServer("weft.v1.Scheduler", "127.0.0.1", 0, rules=ERROR_RULES)
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server.server)
        port = await server.start()
        errors = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                for cls in (common_pb2.REQUEST_CLASS_BATCH, common_pb2.REQUEST_CLASS_INTERACTIVE):
                    call = stub.Generate(scheduler_pb2.ScheduleRequest(
                        request_id=f"r{cls}", prompt_token_ids=[1, 2, 3], tenant="t",
                        session=common_pb2.SessionInfo(request_class=cls)), timeout=10)
                    try:
                        [m async for m in call]
                    except grpc.aio.AioRpcError as exc:
                        errors[cls] = (exc.code(), dict(exc.trailing_metadata() or ()))
        finally:
            await server.server.stop(0)
        return errors

    errors = asyncio.run(main())
    code, trailers = errors[common_pb2.REQUEST_CLASS_BATCH]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and int(trailers["retry-after-ms"]) >= 250
    assert errors[common_pb2.REQUEST_CLASS_INTERACTIVE][0] == grpc.StatusCode.UNAVAILABLE  # placed: no executor

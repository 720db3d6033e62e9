"""The Scheduler gRPC servicer: protobuf in, the dispatcher's domain calls, protobuf out.

Nothing is decided here: ``Generate`` converts the request into a job (convert.py), hands
it to the dispatcher (dispatch/dispatcher.py, which owns the request path) and converts
each chunk of its stream back. Domain errors leave as they are raised; the gRPC server's
interceptor maps them to status codes (errors.py), except two session answers mapped
here: a hop while another hop of its session runs is ABORTED with trailing metadata
``weft-error: session_busy`` (the router answers 409), and ``EndSession`` of a session the
tenant does not have is NOT_FOUND.
"""
from __future__ import annotations

import grpc

from services.mesh.grpc_server import DrainingError
from services.mesh.timeline import context_from_metadata, spans_metadata
from services.scheduler.api import convert
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.scheduler.state.sessions import SessionBusyError
from weft.v1 import scheduler_pb2, scheduler_pb2_grpc


SESSION_BUSY_METADATA = (("weft-error", "session_busy"),)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, dispatch: Dispatcher) -> None:
        self.dispatch = dispatch
        self.draining = False  # set by the server's drain: new streams are refused

    async def Generate(self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            raise DrainingError("scheduler is draining")
        self.dispatch.screen(request.request_id, request.prompt_token_ids)
        job = convert.job_from_pb(request, context.time_remaining,
                                  context_from_metadata(context.invocation_metadata()))

        def finished(spans) -> None:
            context.set_trailing_metadata(spans_metadata(spans))

        try:
            async for chunk in self.dispatch.generate(job, finished):
                yield convert.schedule_response(request.request_id, chunk)
        except SessionBusyError as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc), trailing_metadata=SESSION_BUSY_METADATA)

    async def EndSession(self, request: scheduler_pb2.SchedulerEndSessionRequest,
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerEndSessionResponse:
        agent = self.dispatch.agent
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id: must not be empty")
        end = await agent.end_session(request.tenant, request.session_id) if agent is not None else None
        if end is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r}")
        return scheduler_pb2.SchedulerEndSessionResponse(
            ended_now=end.ended_now, num_executors_released=end.num_executors_released,
            num_running_hops=end.num_running_hops)

    async def ListExecutors(self, request, context) -> scheduler_pb2.ListExecutorsResponse:
        return convert.list_executors_response(self.dispatch.view.membership, self.dispatch.view.kv_index)


def add_to_server(servicer: SchedulerServicer, server: grpc.aio.Server) -> None:
    """Serve ``servicer`` as weft.v1.Scheduler on ``server``."""
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)

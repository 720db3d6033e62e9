"""The Scheduler gRPC servicer: protobuf in, the dispatcher's domain calls, protobuf out.

Nothing is decided here: ``Generate`` converts the request into a job (convert.py), hands
it to the dispatcher (dispatch/dispatcher.py, which owns the request path) and converts
each chunk of its stream back. Domain errors leave as they are raised; the gRPC server's
interceptor maps them to status codes (``errors.ERROR_RULES``), the session ones included:
a hop, fork or join while a hop of the session runs is ABORTED (trailing ``weft-error:
SessionBusyError``, which the router answers 409), a session the tenant does not have is
NOT_FOUND, a fork's child id already in use ALREADY_EXISTS.
"""
from __future__ import annotations

import grpc

from services.mesh.grpc_server import DrainingError
from services.mesh.timeline import context_from_metadata, spans_metadata
from services.scheduler.api import convert
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.scheduler.errors import InvalidScheduleRequest, SessionNotFoundError
from services.scheduler.state.sessions import MAX_CHILDREN
from weft.v1 import router_pb2, scheduler_pb2, scheduler_pb2_grpc


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

        async for chunk in self.dispatch.generate(job, finished):
            yield convert.schedule_response(request.request_id, chunk)

    async def EndSession(self, request: scheduler_pb2.SchedulerEndSessionRequest,
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerEndSessionResponse:
        agent = self.dispatch.agent
        if not request.session_id:
            raise InvalidScheduleRequest("session_id", "must not be empty")
        end = await agent.end_session(request.tenant, request.session_id, request.fork_id) if agent is not None else None
        if end is None:
            raise SessionNotFoundError(request.session_id)
        return scheduler_pb2.SchedulerEndSessionResponse(
            ended_now=end.ended_now, num_executors_released=end.num_executors_released,
            num_running_hops=end.num_running_hops)

    async def ForkSession(self, request: scheduler_pb2.SchedulerForkSessionRequest,
                          context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerForkSessionResponse:
        f = request.fork
        child_ids = list(f.child_session_ids) or fork_child_ids(f.session_id, f.num_children)
        or_new = (request.program_id, request.next_hop) if request.or_new else None
        forked = self._agent(f.session_id).fork_session(request.tenant, f.session_id, child_ids, or_new,
                                                        request.fork_id)
        context = forked.parent.context_token_ids if forked.parent is not None else ()
        return scheduler_pb2.SchedulerForkSessionResponse(fork=router_pb2.ForkSessionResponse(
            session_id=f.session_id, child_session_ids=child_ids, num_context_tokens=len(context)),
            new_sessions=forked.parent is None)

    async def JoinSession(self, request: scheduler_pb2.SchedulerJoinSessionRequest,
                          context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerJoinSessionResponse:
        j = request.join
        joined = await self._agent(j.session_id).join_session(request.tenant, j.session_id, j.from_session_id,
                                                              j.end_children)
        return scheduler_pb2.SchedulerJoinSessionResponse(join=router_pb2.JoinSessionResponse(
            session_id=j.session_id, num_context_tokens=len(joined.parent.context_token_ids),
            ended_session_ids=list(joined.ended_ids)))

    def _agent(self, session_id: str):
        """The agent plane for a fork / join of ``session_id`` (refusals name the field)."""
        if not session_id:
            raise InvalidScheduleRequest("session_id", "must not be empty")
        if self.dispatch.agent is None:  # no agent plane: no session is ever recorded
            raise SessionNotFoundError(session_id)
        return self.dispatch.agent

    async def ListExecutors(self, request, context) -> scheduler_pb2.ListExecutorsResponse:
        return convert.list_executors_response(self.dispatch.view.membership, self.dispatch.view.kv_index)


def fork_child_ids(session_id: str, num_children: int) -> list[str]:
    """Default child ids ``<id>.f<k>``, k = 0..n-1; n outside 1..MAX_CHILDREN names the field."""
    if not 1 <= num_children <= MAX_CHILDREN:
        raise InvalidScheduleRequest("num_children", f"must be 1..{MAX_CHILDREN} (or send child_session_ids), "
                                     f"got {num_children}")
    return [f"{session_id}.f{k}" for k in range(num_children)]


def add_to_server(servicer: SchedulerServicer, server: grpc.aio.Server) -> None:
    """Serve ``servicer`` as weft.v1.Scheduler on ``server``."""
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)

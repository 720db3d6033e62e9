"""An aio gRPC server with health checking, explicit message limits, one error-mapping
interceptor and graceful drain.

Drain on SIGTERM/SIGINT:
    1. health → NOT_SERVING (clients and the scheduler stop sending new work),
    2. ``on_drain`` hooks run (e.g. the executor announces DRAINING),
    3. the server stops accepting RPCs and lets in-flight ones finish up to
       ``grace_s``; what is still running then is cancelled.
"""
from __future__ import annotations

import asyncio
import inspect
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.mesh import mesh_auth

log = structlog.get_logger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"
# Trailing metadata on every status this interceptor answers: the server *chose* the
# error (value: the domain error's class name). A failed call without it broke in
# transport (peer died, connection reset, server shut down): the router continues such
# streams (services/router/continuation.py) and ends chosen ones.
ERROR_ORIGIN_KEY = "weft-error"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options that set both message limits explicitly (client and server side)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# -- error mapping --------------------------------------------------------------------
MAX_DETAILS_CHARS = 1024  # far under grpc's 8-16 KiB metadata limits


class DrainingError(Exception):
    """The service is draining and takes no new work (UNAVAILABLE: try another replica)."""


class UndecodableRequest(ValueError):
    """The request bytes are not a valid message of the method's type (INVALID_ARGUMENT)."""

    def __init__(self, method: str) -> None:
        super().__init__(f"request: not a valid protobuf message for {method}")


UNDECODABLE = object()  # what _lenient returns for bytes that do not parse


def _lenient(deserializer):
    """Wrap a request deserializer so garbage bytes reach the handler as UNDECODABLE
    (answered INVALID_ARGUMENT by the interceptor) instead of gRPC's own UNKNOWN."""
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception:
            return UNDECODABLE
    return parse


@dataclass(frozen=True)
class ErrorRule:
    """Domain errors of type ``error`` map to ``code``. An error carrying a
    ``retry_after_ms`` attribute gets it as ``retry-after-ms`` trailing metadata."""

    error: type[BaseException]
    code: grpc.StatusCode


def bounded_details(details: str) -> str:
    """Status details cut to ``MAX_DETAILS_CHARS``. Errors may quote client input (a model
    name, a role, an id): a 1 MB one overflowed the status's metadata (the client saw
    RESOURCE_EXHAUSTED "metadata size exceeds hard limit", read as overload) and was logged whole."""
    if len(details) <= MAX_DETAILS_CHARS:
        return details
    return f"{details[:MAX_DETAILS_CHARS]}... ({len(details)} characters in all)"


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """The one place where exceptions become gRPC statuses.

    Rules are tried in order (put subclasses first). An ``AioRpcError`` raised by a
    downstream call keeps its code and details (an executor's INVALID_ARGUMENT reaches
    the client as INVALID_ARGUMENT). Anything else is a bug: INTERNAL, logged with its
    traceback. Cancellation (client gone) passes through untouched.
    """

    def __init__(self, rules: Sequence[ErrorRule]) -> None:
        self.rules = (*rules, ErrorRule(DrainingError, grpc.StatusCode.UNAVAILABLE),
                      ErrorRule(UndecodableRequest, grpc.StatusCode.INVALID_ARGUMENT))

    def status_for(self, exc: BaseException) -> tuple[grpc.StatusCode, str, int | None]:
        """(code, details, retry_after_ms) for an exception; does not log."""
        if isinstance(exc, grpc.aio.AioRpcError):
            retry = _retry_after_ms(exc.trailing_metadata())
            return exc.code(), exc.details() or "", retry
        for rule in self.rules:
            if isinstance(exc, rule.error):
                retry = getattr(exc, "retry_after_ms", None)
                return rule.code, str(exc), (int(retry) if retry is not None else None)
        return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})", None

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
        code, details, retry_after_ms = self.status_for(exc)
        details = bounded_details(details)
        if code == grpc.StatusCode.INTERNAL and not isinstance(exc, grpc.aio.AioRpcError):
            log.error("rpc_failed", method=method, exc_info=exc)
        else:
            log.info("rpc_error", method=method, code=code.name, details=details)
        metadata = [(ERROR_ORIGIN_KEY, type(exc).__name__)]
        if retry_after_ms is not None:
            metadata.append((RETRY_AFTER_KEY, str(retry_after_ms)))
        context.set_trailing_metadata(tuple(metadata))
        await context.abort(code, details)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method),
                _lenient(handler.request_deserializer), handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, method),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method),
                _lenient(handler.request_deserializer), handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_stream(handler.stream_stream, method),
            handler.request_deserializer, handler.response_serializer)

    def _wrap_unary(self, fn, method):
        async def wrapper(request, context):
            try:
                if request is UNDECODABLE:
                    raise UndecodableRequest(method)
                return await fn(request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:
                await self._abort(context, exc, method)
        return wrapper

    def _wrap_stream(self, fn, method):
        if inspect.isasyncgenfunction(fn):
            async def gen_wrapper(request, context):
                try:
                    if request is UNDECODABLE:
                        raise UndecodableRequest(method)
                    async for item in fn(request, context):
                        yield item
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await self._abort(context, exc, method)
            return gen_wrapper
        return self._wrap_unary(fn, method)  # a coroutine that writes via context.write


def _retry_after_ms(metadata) -> int | None:
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def retry_after_ms_of(error: grpc.aio.AioRpcError) -> int | None:
    """The server's ``retry-after-ms`` hint on a failed call, if any."""
    return _retry_after_ms(error.trailing_metadata())


def error_origin_of(error: grpc.aio.AioRpcError) -> str | None:
    """The domain error a Weft server answered ``error`` with; None: no Weft server chose
    this status (the peer died or the call broke in transport)."""
    for key, value in error.trailing_metadata() or ():
        if key == ERROR_ORIGIN_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


# -- server -----------------------------------------------------------------------------
class GrpcServer:
    """Owns one aio server: health service, limits, interceptor, drain.

    Usage::

        srv = GrpcServer("scheduler", host, port, rules=SCHEDULER_ERROR_RULES)
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, srv.server)
        await srv.start()                 # health SERVING
        await srv.serve_until_signal()    # SIGTERM → drain → return
    """

    def __init__(
        self,
        service_name: str,
        host: str,
        port: int,
        rules: Sequence[ErrorRule] = (),
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        grace_s: float = 10.0,
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
        peer_auth: bool = True,
    ) -> None:
        self.service_name = service_name
        self.host = host
        self.requested_port = port
        self.grace_s = grace_s
        self.interceptor = ErrorMappingInterceptor(rules)
        self.server = grpc.aio.server(
            # Internal services require the mesh secret when one is set (services/mesh/mesh_auth.py);
            # the router's public API passes peer_auth=False and authenticates API keys instead.
            interceptors=[*(mesh_auth.server_interceptors() if peer_auth else ()), self.interceptor, *interceptors],
            options=[*channel_options(max_message_bytes), ("grpc.so_reuseport", 0)],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port: int | None = None
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []
        self._stop = asyncio.Event()
        self.draining = False

    def on_drain(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``hook`` when draining starts, after health turns NOT_SERVING."""
        self._drain_hooks.append(hook)

    async def start(self) -> int:
        """Bind, start and report SERVING; returns the bound port."""
        self.port = mesh_auth.add_port(self.server, f"{self.host}:{self.requested_port}")  # TLS when configured
        if self.port == 0:
            raise OSError(f"cannot bind {self.host}:{self.requested_port}")
        await self.server.start()
        await self.set_serving(True)
        log.info("grpc_server_started", grpc_service=self.service_name, host=self.host, port=self.port)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)
        await self.health.set(self.service_name, status)

    def request_stop(self) -> None:
        """Ask ``serve_until_signal`` to drain and return (signal-handler safe)."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def drain(self) -> None:
        """NOT_SERVING, drain hooks, stop accepting, finish in-flight up to ``grace_s``."""
        if self.draining:
            return
        self.draining = True
        log.info("drain_started", grpc_service=self.service_name, grace_s=self.grace_s)
        await self.set_serving(False)
        for hook in self._drain_hooks:
            try:
                await hook()
            except Exception:
                log.exception("drain_hook_failed")
        await self.server.stop(self.grace_s)
        log.info("drain_finished", grpc_service=self.service_name)

    async def serve_until_signal(self) -> None:
        """Wait for SIGTERM/SIGINT (or ``request_stop``), then drain."""
        self.install_signal_handlers()
        await self._stop.wait()
        await self.drain()

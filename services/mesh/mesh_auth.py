"""Peer authentication inside the mesh: a shared secret on every internal gRPC call, and
TLS when a certificate is configured.

Internal services (scheduler, executor, cachestore) bind loopback by default; once they
are exposed beyond it, set the same ``WEFT_MESH_SECRET`` for every service. Servers then
refuse any call without ``x-weft-mesh-secret: <secret>`` metadata with UNAUTHENTICATED
(compared in constant time), except gRPC health checks, which orchestrators probe without
credentials. Clients built with ``mesh_channel`` attach the secret to every call.

The secret may also come from a file (Docker secrets: ``/run/secrets/<name>``):
``--mesh-secret-file`` on every service, or ``WEFT_MESH_SECRET_FILE``; surrounding
whitespace is stripped. An unreadable or empty file is a start-up error naming the
option; setting both the file and ``WEFT_MESH_SECRET`` is an error too (which one wins
would be a guess).

TLS: ``WEFT_MESH_TLS_CERT`` + ``WEFT_MESH_TLS_KEY`` (PEM files) make servers listen with
TLS; ``WEFT_MESH_TLS_CA`` (PEM) makes clients verify peers with it (TLS on the client side
is on whenever a CA or a certificate is configured).

The environment is read here only (``MeshSecurity.from_environ``), once per process;
``configure`` (called by each service's ``__main__`` with its ``--mesh-secret-file``)
fixes the process's settings before any server or channel is built.
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger(__name__)

SECRET_KEY = "x-weft-mesh-secret"
# compose.yaml's fallback when WEFT_MESH_SECRET is unset: public, so a service using it warns.
DEV_FALLBACK_SECRET = "weft-dev-mesh-secret-change-me"
SECRET_ENV = "WEFT_MESH_SECRET"
SECRET_FILE_ENV = "WEFT_MESH_SECRET_FILE"
SECRET_FILE_OPTION = f"--mesh-secret-file ({SECRET_FILE_ENV})"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class MeshSecurity:
    secret: str = ""
    tls_cert_path: str = ""
    tls_key_path: str = ""
    tls_ca_path: str = ""

    def __post_init__(self) -> None:
        if bool(self.tls_cert_path) != bool(self.tls_key_path):
            raise ValueError("WEFT_MESH_TLS_CERT and WEFT_MESH_TLS_KEY must be given together")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, secret_file: str = "") -> MeshSecurity:
        """Settings from ``WEFT_MESH_*``; ``secret_file`` (the ``--mesh-secret-file`` flag)
        wins over ``WEFT_MESH_SECRET_FILE``. Raises ValueError naming the option when the
        file is unreadable or empty, or when a secret is given both ways."""
        env = os.environ if environ is None else environ
        secret = env.get(SECRET_ENV, "")
        secret_file = secret_file or env.get(SECRET_FILE_ENV, "")
        if secret_file:
            if secret:
                raise ValueError(f"set either {SECRET_ENV} or {SECRET_FILE_OPTION}, not both")
            secret = read_secret_file(secret_file)
        return cls(secret=secret, tls_cert_path=env.get("WEFT_MESH_TLS_CERT", ""),
                   tls_key_path=env.get("WEFT_MESH_TLS_KEY", ""), tls_ca_path=env.get("WEFT_MESH_TLS_CA", ""))

    @property
    def client_tls(self) -> bool:
        return bool(self.tls_ca_path or self.tls_cert_path)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert_path:
            return None
        pair = (Path(self.tls_key_path).read_bytes(), Path(self.tls_cert_path).read_bytes())
        return grpc.ssl_server_credentials([pair])

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.client_tls:
            return None
        ca = Path(self.tls_ca_path or self.tls_cert_path).read_bytes()
        return grpc.ssl_channel_credentials(root_certificates=ca)


def read_secret_file(path: str) -> str:
    """The secret in ``path``, stripped; ValueError naming the option when the file cannot
    be read or holds nothing."""
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{SECRET_FILE_OPTION}: cannot read {path}: {reason}") from None
    if not secret:
        raise ValueError(f"{SECRET_FILE_OPTION}: {path} is empty")
    return secret


_current: MeshSecurity | None = None


def configure(secret_file: str = "", environ: Mapping[str, str] | None = None) -> MeshSecurity:
    """Fix this process's mesh security (environment plus ``--mesh-secret-file``); call
    once at start-up, before any server or channel exists. Raises ValueError."""
    global _current
    _current = MeshSecurity.from_environ(environ, secret_file)
    return _current


def current() -> MeshSecurity:
    """This process's mesh security settings (``configure``d, else from the environment,
    read once)."""
    return _current if _current is not None else configure()


class SharedSecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the mesh secret (UNAUTHENTICATED); health stays open."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("an empty mesh secret authenticates nothing")
        self._secret = secret.encode()

    def authorized(self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """Whether a call may proceed (does not log)."""
        if method.startswith(OPEN_METHOD_PREFIXES):
            return True
        for key, value in metadata or ():
            if key == SECRET_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._secret)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        if self.authorized(handler_call_details.method, handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        return _refusal(await continuation(handler_call_details))


def _refusal(handler):
    """A handler of the same shape that aborts UNAUTHENTICATED before reading anything."""
    if handler is None:
        return None

    async def abort_unary(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong mesh secret")

    async def abort_stream(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong mesh secret")
        yield  # pragma: no cover  (makes this an async generator)

    kinds = (
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler, abort_unary),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler, abort_unary),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler, abort_stream),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler, abort_stream),
    )
    for fn, make, abort in kinds:
        if fn is not None:
            return make(abort, handler.request_deserializer, handler.response_serializer)
    return None


class _SecretMetadata:
    """Adds the mesh secret to every outgoing call (one subclass per call shape: grpc.aio
    files an interceptor under the first shape it implements only)."""

    def __init__(self, secret: str) -> None:
        self._pair = (SECRET_KEY, secret)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._pair)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryUnary(_SecretMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_SecretMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_SecretMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_SecretMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def server_interceptors(security: MeshSecurity | None = None) -> list[grpc.aio.ServerInterceptor]:
    security = security or current()
    if security.secret == DEV_FALLBACK_SECRET:  # logged here: logging is configured by now
        log.warning("mesh_secret_is_the_public_fallback", detail="set WEFT_MESH_SECRET (or a secret file)")
    return [SharedSecretInterceptor(security.secret)] if security.secret else []


def add_port(server: grpc.aio.Server, address: str, security: MeshSecurity | None = None) -> int:
    """Bind ``address`` with TLS when a certificate is configured, else plaintext."""
    creds = (security or current()).server_credentials()
    return server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)


# A mesh peer that dies is restarted on the same address within seconds. gRPC's default
# reconnect backoff grows to 120 s, and its process-wide subchannel pool hands that backoff
# to every new channel to the address, so a healthy peer stayed unreachable for as long
# (measured: 2.6 s of 503s from /v1/embeddings after a 25 s cachestore outage). Reconnects
# are capped at 1 s and each channel keeps its own connections.
RECONNECT_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.use_local_subchannel_pool", 1),
)


def mesh_channel(address: str, options: Sequence[tuple[str, object]] | None = None,
                 security: MeshSecurity | None = None) -> grpc.aio.Channel:
    """An aio channel to a mesh peer: TLS and the shared secret when configured, and the
    short reconnect backoff of ``RECONNECT_OPTIONS`` (``options`` override it)."""
    given = dict(options or ())
    options = [(k, v) for k, v in RECONNECT_OPTIONS if k not in given] + list(given.items())
    security = security or current()
    interceptors = ([kind(security.secret) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
                    if security.secret else None)
    creds = security.channel_credentials()
    if creds is not None:
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)

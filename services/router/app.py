"""Assemble and run the router: tokenizer, scheduler client, gRPC and HTTP listeners.

SIGTERM drains: /health and gRPC health turn NOT_SERVING, new work is refused, in-flight
streams get ``drain_s`` (``--drain-timeout-s``, else ``--grace-s``) to finish, then both
listeners close.
"""
from __future__ import annotations

import structlog
from aiohttp import web

from services.mesh import metric_catalogue as catalogue
from services.mesh.grpc_server import GrpcServer
from services.mesh.metrics import MetricsServer
from services.router.auth import KeyStore
from services.router.config import RouterConfig
from services.router.continuation import ContinuationPolicy, ContinuingStreamer
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.scheduler_client import SchedulerClient
from services.router.server import ROUTER_ERROR_RULES, RouterServicer, add_router_to_server
from services.router.tool_parsers import select_format
from services.shared.tokenizer import Tokenizer

log = structlog.get_logger(__name__)
LINGER_S = 2.0  # how long an unread request body is still read after the answer (aiohttp: 10 s)


class RouterApp:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        catalogue.register("router")
        tokenizer = Tokenizer.from_dir(config.model_dir)
        limits = model_limits(config.model_dir, tokenizer, [config.model_name], config.max_model_len)
        self.scheduler = SchedulerClient(config.scheduler_address, config.max_message_bytes)
        # A stream survives its scheduler's death, restart or stall (continuation.py).
        downstream = ContinuingStreamer(self.scheduler, ContinuationPolicy(
            max_attempts=config.continuation_attempts, reconnect_wait_s=config.continuation_wait_s,
            min_stall_s=config.continuation_min_stall_s, probe_timeout_s=config.continuation_probe_timeout_s,
            probe_attempts=config.continuation_probe_attempts, probe_backoff=config.continuation_probe_backoff,
        ), probe=self.scheduler.probe, unreachable=self.scheduler.unreachable)
        embeddings = None
        if config.cachestore_address:  # opt-in semantic response cache in front of the scheduler
            from services.router.cachestore_client import CacheStoreClient
            from services.router.embeddings import EmbeddingsApi
            from services.router.semantic_cache import SemanticCachingStreamer

            cachestore = CacheStoreClient(config.cachestore_address)
            downstream = SemanticCachingStreamer(downstream, cachestore, tokenizer)
            embeddings = EmbeddingsApi(cachestore, tokenizer)  # /v1/embeddings: the cachestore's model
        self.generator = Generator(tokenizer, limits, downstream, config.request_timeout_s)
        keys = KeyStore.from_file(config.keys_file)
        # The tool-call format: the one the chat template teaches, or --tool-call-parser's.
        tool_format = select_format(tokenizer.chat_template, config.tool_call_parser)
        self.http = HttpApi(self.generator, keys, config.model_name, self.scheduler.list_executors,
                            body_read_timeout_s=config.body_read_timeout_s, tool_format=tool_format,
                            embeddings=embeddings, sessions=self.scheduler)
        # One request cap for both public doors: the gRPC message limit is the HTTP body cap.
        self.grpc = GrpcServer("weft.v1.Router", config.host, config.grpc_port, rules=ROUTER_ERROR_RULES,
                               max_message_bytes=config.max_body_bytes, grace_s=config.drain_s,
                               peer_auth=False)
        self.metrics_server = MetricsServer(config.metrics_host, config.metrics_port)
        servicer = RouterServicer(self.generator, keys, config.model_name, self.scheduler.list_executors,
                                  tool_format=tool_format, sessions=self.scheduler)
        add_router_to_server(servicer, self.grpc.server)  # with server reflection
        self._runner: web.AppRunner | None = None
        self.http_port: int | None = None

    async def start(self) -> None:
        app = self.http.app(self.config.max_body_bytes)
        # Live settings: admin API, SIGHUP reload, the document on the bus (docs/live_config.md).
        from services.router.admin_routes import start_live_settings

        self.live = await start_live_settings(app, self.http.keys, self.config.keys_file)
        # handler_cancellation: a client that disconnects cancels its handler at once,
        # even while it waits for the first token, so its KV is freed downstream.
        # keepalive_timeout also bounds a connection that never completes its headers
        # (slowloris): aiohttp arms it at connection start and after every response.
        # lingering_time: after answering a request whose body was not read (a 408 for a
        # body that never arrived, a refusal before reading), aiohttp keeps reading it so
        # the client can see the answer; its 10 s default held each slow client's fd
        # 10 s past its 408.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self.config.drain_s,
                                     keepalive_timeout=self.config.http_idle_timeout_s,
                                     lingering_time=LINGER_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.http_port)
        await site.start()
        self.http_port = self._runner.addresses[0][1]
        await self.grpc.start()
        await self.metrics_server.start()
        log.info("router_ready", http_port=self.http_port, grpc_port=self.grpc.port,
                 scheduler=self.config.scheduler_address, model=self.config.model_name)

    async def _refuse_http(self) -> None:
        self.http.draining = True

    async def stop(self) -> None:
        """Close the HTTP listener (in-flight streams get ``drain_s``) and the
        scheduler channel; the gRPC server has drained already."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.metrics_server.stop()
        await self.scheduler.close()

    async def run(self) -> None:
        self.grpc.on_drain(self._refuse_http)
        await self.start()
        try:
            await self.grpc.serve_until_signal()  # SIGTERM: health NOT_SERVING, drain
        finally:
            await self.stop()

"""Prometheus metrics: one registry per process and a tiny aiohttp ``/metrics`` endpoint.

Metric constructors are get-or-create, so modules may declare their metrics at import
and tests may build several servers in one process without duplicate-name errors.
"""
from __future__ import annotations

import asyncio

from collections.abc import Sequence

import structlog
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest,
)

log = structlog.get_logger(__name__)

disable_created_metrics()  # no *_created series: they double the scrape for no use here

REGISTRY = CollectorRegistry(auto_describe=True)
_metrics: dict[str, object] = {}


def _get_or_create(kind, name: str, doc: str, labels: Sequence[str], **kw):
    existing = _metrics.get(name)
    if existing is not None:
        if not isinstance(existing, kind):
            raise ValueError(f"metric {name!r} already registered as {type(existing).__name__}")
        return existing
    metric = kind(name, doc, labelnames=tuple(labels), registry=REGISTRY, **kw)
    _metrics[name] = metric
    return metric


def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    return _get_or_create(Counter, name, doc, labels)


def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
    return _get_or_create(Gauge, name, doc, labels)


def histogram(name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] | None = None) -> Histogram:
    kw = {"buckets": tuple(buckets)} if buckets else {}
    return _get_or_create(Histogram, name, doc, labels, **kw)


def _num_asyncio_tasks() -> float:
    """Tasks alive on this thread's running loop (scrapes run on the service's loop)."""
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # no running loop on the scraping thread
        return -1.0


ASYNCIO_TASKS = gauge("weft_asyncio_tasks", "asyncio tasks alive in this process (a leak shows as a rising line).")
ASYNCIO_TASKS.set_function(_num_asyncio_tasks)


async def _handle_metrics(_request: web.Request) -> web.Response:
    body = generate_latest(REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class MetricsServer:
    """Serves ``GET /metrics`` on ``host:port``; port 0 disables it."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def enabled(self) -> bool:
        return self.port != 0

    async def start(self) -> None:
        if not self.enabled:
            return
        app = web.Application()
        app.router.add_get("/metrics", _handle_metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        log.info("metrics_server_started", host=self.host, port=self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

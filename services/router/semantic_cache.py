"""Semantic response cache: a ``TokenStreamer`` in front of the scheduler.

A request that opted in (``weft_semantic_cache: true`` over HTTP, ``semantic_cache`` over
gRPC) and is deterministic (greedy, no log-probabilities) is first looked up in the
cachestore's semantic index by its prompt text, scoped by tenant and by everything that
shapes the output (model, max_tokens, min_tokens, stop ids, ignore_eos): a hit is
streamed back as one chunk from executor ``cachestore`` without touching the scheduler;
a miss streams as usual and its output is remembered once it finishes (stop / length).
The cachestore being down or slow is a miss, never an error.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import structlog

from services.mesh import metrics
from services.router.cachestore_client import CacheStoreClient
from services.router.schema import TokenChunk, TokenRequest

log = structlog.get_logger(__name__)

LOOKUPS = metrics.counter("weft_router_semantic_cache_total", "Opted-in requests by semantic cache result.",
                          ["result"])
EXECUTOR_NAME = "cachestore"  # what a cached answer reports as its executor


def is_cacheable(request: TokenRequest) -> bool:
    s = request.sampling
    return s.semantic_cache and s.temperature == 0.0 and not s.logprobs


def scope_of(request: TokenRequest) -> str:
    s = request.sampling
    return (f"{request.model}|max={s.max_tokens}|min={s.min_tokens}|eos={int(s.ignore_eos)}|"
            f"stop={','.join(map(str, s.stop_token_ids))}")


class SemanticCachingStreamer:
    def __init__(self, downstream, client: CacheStoreClient, tokenizer) -> None:
        self.downstream = downstream
        self.client = client
        self.tokenizer = tokenizer
        self._background: set[asyncio.Task] = set()

    def __getattr__(self, name):  # list_executors and friends stay the scheduler client's
        return getattr(self.downstream, name)

    def generate(self, request: TokenRequest, timeout_s: float) -> AsyncIterator[TokenChunk]:
        if not is_cacheable(request):
            return self.downstream.generate(request, timeout_s)
        return self._cached_generate(request, timeout_s)

    async def _cached_generate(self, request: TokenRequest, timeout_s: float) -> AsyncIterator[TokenChunk]:
        text = self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        scope = scope_of(request)
        try:
            hit = await self.client.lookup_response(request.tenant, scope, text)
        except Exception as exc:  # noqa: BLE001 - a cache problem is a miss
            log.warning("semantic_cache_lookup_failed", error=str(exc))
            hit = None
        if hit is not None:
            LOOKUPS.labels("hit").inc()
            n = len(request.prompt_token_ids)
            reason = "length" if len(hit) >= (request.sampling.max_tokens or 0) else "stop"
            yield TokenChunk(hit, (), reason, n, n, len(hit), EXECUTOR_NAME)
            return
        LOOKUPS.labels("miss").inc()
        output: list[int] = []
        chunks = self.downstream.generate(request, timeout_s)
        try:
            async for chunk in chunks:
                output.extend(chunk.token_ids)
                if chunk.finish_reason in ("stop", "length"):
                    self._remember(request.tenant, scope, text, tuple(output))
                yield chunk
        finally:
            await chunks.aclose()

    def _remember(self, tenant: str, scope: str, text: str, token_ids: tuple[int, ...]) -> None:
        async def store() -> None:
            try:
                await self.client.store_response(tenant, scope, text, token_ids)
            except Exception as exc:  # noqa: BLE001
                log.warning("semantic_cache_store_failed", error=str(exc))

        task = asyncio.get_running_loop().create_task(store(), name="semantic-cache-store")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

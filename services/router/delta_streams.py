"""Combinators over ``Delta`` streams used by the HTTP API: metrics on the way through,
and interleaving several prompts' streams of one ``/v1/completions`` request. Closing
a combinator closes what it wraps (so cancellation still reaches the scheduler)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from services.router import metrics as m
from services.router.schema import Delta


async def timed(deltas: AsyncIterator[Delta], api: str) -> AsyncIterator[Delta]:
    """Pass deltas through, recording TTFT, latency and token counts."""
    start = time.perf_counter()
    first = True
    m.IN_FLIGHT.labels(api).inc()
    try:
        async for delta in deltas:
            if first and delta.token_ids:
                m.TTFT_S.labels(api).observe(time.perf_counter() - start)
                first = False
            m.GENERATED_TOKENS.inc(len(delta.token_ids))
            if delta.finish_reason is not None:
                m.REQUEST_S.labels(api).observe(time.perf_counter() - start)
                m.PROMPT_TOKENS.inc(delta.usage.prompt_tokens)
                m.CACHED_TOKENS.inc(delta.usage.cached_tokens)
            yield delta
    finally:
        m.IN_FLIGHT.labels(api).dec()
        await deltas.aclose()


async def merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """Interleave several streams as (index, delta); one stream passes straight through."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta, None))
        except Exception as exc:
            await queue.put((i, None, exc))
        finally:
            await stream.aclose()
            await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            if delta is None:
                remaining -= 1
                continue
            yield i, delta
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

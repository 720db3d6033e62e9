"""Combinators over ``Delta`` streams used by the HTTP API: metrics on the way through,
interleaving the streams of one request's choices (several prompts, ``n`` completions
each), and naming a grammar's refusal after the body field it came from. Closing a
combinator closes what it wraps (so cancellation still reaches the scheduler)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from services.router import metrics as m
from services.router.errors import InvalidRequestError
from services.router.schema import Delta

GRAMMAR_FIELD = "grammar"  # the executor names a grammar it cannot compile "grammar.<kind>"


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


async def name_grammar_errors(deltas: AsyncIterator[Delta], field: str) -> AsyncIterator[Delta]:
    """Pass deltas through; a refusal of the grammar (``grammar.json_schema: ...`` from the
    executor's compiler) is re-raised naming ``field``, the body field the client set."""
    try:
        async for delta in deltas:
            yield delta
    except InvalidRequestError as exc:
        if not field or not exc.field.startswith(GRAMMAR_FIELD):
            raise
        raise InvalidRequestError(field, f"cannot be enforced: {exc.message} ({exc.field})") from None
    finally:
        await deltas.aclose()


async def merge(streams: list[AsyncIterator[Delta]],
                follows: list[int | None] | None = None) -> AsyncIterator[tuple[int, Delta]]:
    """Interleave several streams as (index, delta); one stream passes straight through.

    ``follows[i] = j``: stream i starts only once stream j yielded its first delta (or
    ended). The ``n`` completions of one prompt follow the first: by then the prompt's KV
    is on the executor, so the others reuse its full blocks through the prefix cache
    instead of all prefilling the same prompt at once. A follower that did not ask for the
    prompt's logprobs (``fan_out`` asks the first completion only: computing them bars the
    prefix cache) gets its leader's on its first delta."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    follows = follows or [None] * len(streams)
    started = [asyncio.Event() for _ in streams]
    firsts: list[Delta | None] = [None] * len(streams)

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            leader = follows[i]
            if leader is not None:
                await started[leader].wait()
            async for delta in stream:
                if firsts[i] is None:
                    lead = firsts[leader] if leader is not None else None
                    if lead is not None and lead.prompt_logprobs and not delta.prompt_logprobs:
                        delta = replace(delta, prompt_logprobs=lead.prompt_logprobs,
                                        prompt_top_logprobs=lead.prompt_top_logprobs)
                    firsts[i] = delta
                started[i].set()
                await queue.put((i, delta, None))
        except Exception as exc:
            await queue.put((i, None, exc))
        finally:
            started[i].set()  # ended without a delta: its followers must not wait forever
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

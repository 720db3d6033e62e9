"""Semantic response cache and similar-intent prefetch: a ``TokenStreamer`` in front of
the scheduler.

A request that opted in (``weft_semantic_cache: true`` over HTTP, ``semantic_cache`` over
gRPC) and is deterministic (greedy, no log-probabilities) is first looked up in the
cachestore's semantic index by its prompt text, scoped by tenant and by everything that
shapes the output (model, max_tokens, min_tokens, stop ids, ignore_eos): a hit is
streamed back as one chunk from executor ``cachestore`` without touching the scheduler;
a miss streams as usual and its output is remembered once it finishes (stop / length).

Similar-intent prefetch: the first turn of an opted-in session (hop 0, not stateful)
is looked up among known sessions' first turns; when one is similar, the prefix its
prompt shares with this one is warmed in the cachestore (disk → host RAM) before the
request goes downstream, so the executor's promotion reads RAM, not disk. Every
first turn is remembered for later sessions.

The cachestore being down or slow is a miss, never an error.
"""
from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import AsyncIterator, Sequence

import structlog

from services.mesh import metrics
from services.router.cachestore_client import CacheStoreClient
from services.router.schema import TokenChunk, TokenRequest

log = structlog.get_logger(__name__)

LOOKUPS = metrics.counter("weft_router_semantic_cache_total", "Opted-in requests by semantic cache result.",
                          ["result"])
PREFETCHES = metrics.counter("weft_router_session_prefetch_total",
                             "Opted-in first turns by similar-session prefetch result.", ["result"])
EXECUTOR_NAME = "cachestore"  # what a cached answer reports as its executor


def is_first_turn(request: TokenRequest) -> bool:
    s = request.session
    return request.sampling.semantic_cache and bool(s.session_id) and s.hop_index == 0 and not s.stateful


def common_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


_PROBE = "weftprobe"
_MARKER_LEN = 3  # tokens right before a user message's content: e.g. <|im_start|> user \n


class PromptSplitter:
    """Splits a prompt into (everything before its last user message, that message's text).

    NOTE: only the last user message is embedded: a shared system prompt, tool list or
    chat template would otherwise make unrelated questions look alike (with the tiny
    model's template around the built-in set, a 0.92 threshold drops from precision 1.0
    to 0.86). The context before it must match exactly instead: its token digest goes
    into the scope. The user-turn marker is learned once from the checkpoint's own chat
    template; without one (or for plain completions) the whole prompt is the text.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.marker: tuple[int, ...] = ()
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tools=None,
                                                 add_generation_prompt=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            probe = tokenizer.encode(_PROBE, add_special_tokens=False)
            at = _find_last(ids, probe)
            if at >= _MARKER_LEN:
                self.marker = tuple(ids[at - _MARKER_LEN:at])
        except Exception:  # noqa: BLE001 - no usable template: whole-prompt mode
            self.marker = ()

    def split(self, prompt_ids: Sequence[int]) -> tuple[str, str]:
        """(context digest, last user message text)."""
        at = _find_last(prompt_ids, self.marker) if self.marker else -1
        cut = at + len(self.marker) if at >= 0 else 0
        digest = hashlib.blake2b(array("q", prompt_ids[:cut]).tobytes(), digest_size=8).hexdigest()
        return digest, self.tokenizer.decode(prompt_ids[cut:], skip_special_tokens=True).strip()


def _find_last(seq: Sequence[int], sub: Sequence[int]) -> int:
    n = len(sub)
    if n == 0:
        return -1
    first = sub[0]
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == first and tuple(seq[i:i + n]) == tuple(sub):
            return i
    return -1


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
        self.splitter = PromptSplitter(tokenizer)
        self._background: set[asyncio.Task] = set()

    def __getattr__(self, name):  # list_executors and friends stay the scheduler client's
        return getattr(self.downstream, name)

    def generate(self, request: TokenRequest, timeout_s: float) -> AsyncIterator[TokenChunk]:
        cacheable, first_turn = is_cacheable(request), is_first_turn(request)
        if not cacheable and not first_turn:
            return self.downstream.generate(request, timeout_s)
        return self._generate(request, timeout_s, cacheable, first_turn)

    async def _generate(self, request: TokenRequest, timeout_s: float, cacheable: bool,
                        first_turn: bool) -> AsyncIterator[TokenChunk]:
        context, text = self.splitter.split(request.prompt_token_ids)
        scope = f"{scope_of(request)}|ctx={context}"
        if first_turn:  # a first turn's context is the shared prefix itself: match on the message alone
            await self._prefetch_similar_session(request, text)
        if cacheable:
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
                    if cacheable:
                        self._remember(self.client.store_response, request.tenant, scope, text, tuple(output))
                    if first_turn:
                        self._remember(self.client.store_session, request.tenant, request.model, text,
                                       request.prompt_token_ids)
                yield chunk
        finally:
            await chunks.aclose()

    async def _prefetch_similar_session(self, request: TokenRequest, text: str) -> None:
        try:
            known = await self.client.lookup_session(request.tenant, request.model, text)
            shared = common_prefix_len(known, request.prompt_token_ids) if known else 0
            num_blocks = await self.client.prefetch(request.tenant, request.prompt_token_ids[:shared]) if shared else 0
        except Exception as exc:  # noqa: BLE001 - prefetch is best effort
            log.warning("session_prefetch_failed", error=str(exc))
            PREFETCHES.labels("error").inc()
            return
        PREFETCHES.labels("prefetched" if num_blocks else "none").inc()
        if num_blocks:
            log.info("session_prefix_prefetched", session_id=request.session.session_id, num_shared_tokens=shared,
                     num_blocks=num_blocks)

    def _remember(self, store, *args) -> None:
        async def run() -> None:
            try:
                await store(*args)
            except Exception as exc:  # noqa: BLE001
                log.warning("semantic_cache_store_failed", error=str(exc))

        task = asyncio.get_running_loop().create_task(run(), name="semantic-cache-store")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

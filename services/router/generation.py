"""The router's request pipeline, shared by the HTTP and gRPC front ends:

    validated request --tokenize/template--> TokenRequest --scheduler stream-->
    token chunks --incremental detokenize--> text --stop strings--> Delta events

Only token ids leave this process (one server-streaming RPC per request). Closing a
``stream`` generator (client gone, stop string matched) cancels the downstream call,
which aborts the request on its executor and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import jinja2
import structlog

from services.shared.detokenizer import IncrementalDetokenizer
from services.router.intent import prescreen
from services.router.errors import InvalidRequestError, UpstreamError
from services.router.request_trace import RequestRecorder
from services.router.schema import ChatRequest, Delta, Sampling, Session, TokenChunk, TokenRequest, Usage
from services.router.stop_strings import StopStringMatcher
from services.shared.tokenizer import Tokenizer
from services.router.validation import Limits, resolve_max_tokens

log = structlog.get_logger(__name__)

# Texts longer than this are encoded in a worker thread with the GIL released
# (``Tokenizer.encode_bounded``), so one huge prompt does not stall every other stream on
# the router's event loop; shorter ones cost less than the thread hop.
OFFLOAD_TOKENIZE_CHARS = 16_384
# Conversations with more messages than this are rendered in a worker thread too: the
# template's cost grows with the number of messages, not only with their text.
OFFLOAD_RENDER_MESSAGES = 64
# Huge prompts tokenized at once: each takes a core for as long as it runs.
MAX_CONCURRENT_OFFLOADS = 2


class TokenStreamer(Protocol):
    """The downstream: the scheduler client (or an in-process fake in tests)."""

    def generate(self, request: TokenRequest, timeout_s: float) -> AsyncIterator[TokenChunk]: ...


def model_limits(model_dir: str | Path, tokenizer: Tokenizer, served_models: Sequence[str],
                 max_model_len: int | None) -> Limits:
    """Context length and vocabulary from the checkpoint's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    context = max_model_len or int(config.get("max_position_embeddings") or 2048)
    vocab = int(config.get("vocab_size") or tokenizer.vocab_size)
    return Limits(served_models=tuple(served_models), max_model_len=context, vocab_size=vocab)


class Generator:
    """Turns validated requests into token requests and token streams into text deltas."""

    def __init__(self, tokenizer: Tokenizer, limits: Limits, downstream: TokenStreamer,
                 request_timeout_s: float = 600.0) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.downstream = downstream
        self.request_timeout_s = request_timeout_s
        self._offload_slots = asyncio.Semaphore(MAX_CONCURRENT_OFFLOADS)

    # -- prompts ------------------------------------------------------------------
    def chat_prompt_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None,
                        add_generation_prompt: bool = True) -> list[int]:
        """Synchronous twin of ``chat_prompt_ids_async`` for small conversations."""
        text = self._render_chat(messages, tools, add_generation_prompt)
        self.check_prompt_chars(text, "messages")
        # The template already carries BOS and friends, as transformers tokenizes it.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _render_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None,
                     add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=tools,
                                                      add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError("messages", f"rejected by the model's chat template: {exc}") from None
        except ValueError as exc:
            raise InvalidRequestError("messages", str(exc)) from None
        except RecursionError:  # tool-call arguments or tool schemas too deep for ``tojson``
            raise InvalidRequestError("messages", "too deeply nested for the model's chat template") from None

    def text_prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def token_request(self, prompt_ids: Sequence[int], sampling: Sampling, tenant: str, session: Session,
                      prompt_field: str, request_id: str, has_tools: bool = False) -> TokenRequest:
        """Check the prompt against the context and resolve max_tokens."""
        if len(prompt_ids) >= self.limits.max_model_len:  # cannot fit: refuse before walking the ids
            resolve_max_tokens(sampling, len(prompt_ids), self.limits.max_model_len, prompt_field)
        for i, t in enumerate(prompt_ids):
            if not 0 <= t < self.limits.vocab_size:
                raise InvalidRequestError(f"{prompt_field}[{i}]", f"token id {t} is outside [0, {self.limits.vocab_size})")
        max_tokens = resolve_max_tokens(sampling, len(prompt_ids), self.limits.max_model_len, prompt_field)
        stop_ids = sampling.stop_token_ids
        return TokenRequest(
            request_id=request_id,
            model="",  # one model per deployment: any executor serves it
            prompt_token_ids=tuple(prompt_ids),
            sampling=replace(sampling, max_tokens=max_tokens, min_tokens=min(sampling.min_tokens, max_tokens),
                             stop_token_ids=tuple(stop_ids)),
            tenant=tenant,
            # Intent pre-screen (intent.py): class and contract template, in microseconds.
            session=prescreen(session, has_tools, len(prompt_ids), max_tokens),
            deadline_unix_ms=int((time.time() + self.request_timeout_s) * 1000),
        )

    def chat_token_request(self, req: ChatRequest, tenant: str, request_id: str) -> TokenRequest:
        ids = self.chat_prompt_ids(req.messages, req.tools)
        return self.token_request(ids, req.sampling, tenant, req.session, "messages", request_id, bool(req.tools))

    async def chat_token_request_async(self, req: ChatRequest, tenant: str, request_id: str) -> TokenRequest:
        ids = await self.chat_prompt_ids_async(req.messages, req.tools)
        return self.token_request(ids, req.sampling, tenant, req.session, "messages", request_id, bool(req.tools))

    async def chat_prompt_ids_async(self, messages: Sequence[dict], tools: Sequence[dict] | None,
                                    add_generation_prompt: bool = True, field: str = "messages") -> list[int]:
        """Render (in a worker thread when the conversation is large: jinja is pure Python,
        so the loop keeps its GIL turns) and encode with ``encode_async``."""
        size = sum(len(m.get("content") or "") for m in messages)
        small = (size <= OFFLOAD_TOKENIZE_CHARS and len(messages) <= OFFLOAD_RENDER_MESSAGES
                 and not tools and not any(m.get("tool_calls") for m in messages))  # rendered with json.dumps
        if small:
            text = self._render_chat(messages, tools, add_generation_prompt)
        else:
            text = await asyncio.to_thread(self._render_chat, messages, tools, add_generation_prompt)
        # The template already carries BOS and friends, as transformers tokenizes it.
        return await self.encode_async(text, field, add_special_tokens=False)

    async def text_prompt_ids_async(self, prompt: str | Sequence[int], field: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return await self.encode_async(prompt, field)
        return list(prompt)

    async def encode_async(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt text that can fit the context; raises
        ``InvalidRequestError`` naming ``field`` when it cannot. Never blocks the loop:
        text longer than the sound character bound is refused before tokenizing
        (``prompt_budget.py``), a long text is encoded off the loop with the GIL
        released, and an over-long result is only counted."""
        self.check_prompt_chars(text, field)
        if len(text) <= OFFLOAD_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        async with self._offload_slots:
            num_tokens, ids = await asyncio.to_thread(self.tokenizer.encode_bounded, text,
                                                      self.limits.max_model_len, add_special_tokens)
        if ids is None:
            raise InvalidRequestError(
                field, f"{num_tokens} tokens exceed the model's context length of {self.limits.max_model_len}")
        return ids

    def check_prompt_chars(self, text: str, field: str) -> None:
        """Refuse a text that has more characters than any fitting prompt can have."""
        max_chars = self.tokenizer.char_budget.max_chars(self.limits.max_model_len, text.isascii())
        if max_chars is not None and len(text) > max_chars:
            raise InvalidRequestError(
                field, f"{len(text)} characters can never fit the model's context length of "
                f"{self.limits.max_model_len} tokens (at most {max_chars} characters with this tokenizer)")

    # -- streams ------------------------------------------------------------------
    async def stream(self, request: TokenRequest, stop: Sequence[str] = ()) -> AsyncIterator[Delta]:
        """Deltas of one request. The last has ``finish_reason`` set; on a stop-string
        match it is "stop" and the downstream stream is cancelled."""
        detok = IncrementalDetokenizer(self.tokenizer)
        matcher = StopStringMatcher(tuple(stop))
        recorder = RequestRecorder(request)  # this request's timeline; read by the scheduler client
        chunks = self.downstream.generate(request, self.request_timeout_s)
        reason, num_output_tokens, executor = None, 0, ""
        try:
            async for chunk in chunks:
                recorder.on_chunk(chunk)
                num_output_tokens, executor = chunk.num_output_tokens, chunk.executor
                finished = chunk.finish_reason is not None
                text = detok.push(chunk.token_ids)
                if finished:
                    text += detok.flush()
                out = matcher.push(text)
                if finished and not matcher.stopped:
                    out += matcher.flush()
                reason = "stop" if matcher.stopped else chunk.finish_reason
                usage = Usage(chunk.num_prompt_tokens, chunk.num_output_tokens, chunk.num_cached_tokens)
                yield Delta(out, chunk.token_ids, chunk.logprobs, reason, usage, chunk.executor,
                            chunk.degradation_rung, chunk.num_migrations, chunk.notes)
                if reason is not None:
                    return
            raise UpstreamError("the scheduler's stream ended without a finish reason")
        finally:
            await chunks.aclose()
            recorder.finish(reason, num_output_tokens, executor)

"""The router's request pipeline, shared by the HTTP and gRPC front ends:

    validated request --prepare (prepare.py)--> TokenRequest --scheduler stream-->
    token chunks --incremental detokenize--> text --stop strings--> Delta events

Only token ids leave this process (one server-streaming RPC per request). Closing a
``stream`` generator (client gone, stop string matched) cancels the downstream call,
which aborts the request on its executor and frees its KV blocks.
"""
from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import structlog

from services.router.errors import InvalidRequestError, UpstreamError
from services.router.prepare import Prompt, RequestPreparer
from services.router.request_trace import RequestRecorder
from services.router.schema import Delta, Sampling, Session, TokenChunk, TokenRequest, Usage
from services.router.stop_strings import StopStringMatcher
from services.router.validation import Limits
from services.shared.detokenizer import IncrementalDetokenizer
from services.shared.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


class TokenStreamer(Protocol):
    """The downstream: the scheduler client (or an in-process fake in tests)."""

    def generate(self, request: TokenRequest, timeout_s: float) -> AsyncIterator[TokenChunk]: ...


def fan_out(request: TokenRequest, n: int) -> list[TokenRequest]:
    """The ``n`` downstream requests of one prompt's ``n`` completions: the first keeps the
    request id, the others get ``<id>.n<i>``; a seeded request seeds completion i with
    seed + i (vLLM's rule), so each completion is reproducible and they differ. Only the
    first asks for the prompt's logprobs: they are the same for every completion, and
    computing them bars the prefix cache, so each other completion would prefill the
    whole prompt again (``delta_streams.merge`` hands the first's to the others)."""
    out = []
    for i in range(n):
        s = request.sampling
        seed = None if s.seed is None else (s.seed + i) % 2**64
        prompt_logprobs = s.prompt_logprobs if i == 0 else None
        out.append(replace(request, request_id=request.request_id if i == 0 else f"{request.request_id}.n{i}",
                           sampling=replace(s, n=1, seed=seed, prompt_logprobs=prompt_logprobs)))
    return out


def model_limits(model_dir: str | Path, tokenizer: Tokenizer, served_models: Sequence[str],
                 max_model_len: int | None) -> Limits:
    """Context length and vocabulary from the checkpoint's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    context = max_model_len or int(config.get("max_position_embeddings") or 2048)
    vocab = int(config.get("vocab_size") or tokenizer.vocab_size)
    return Limits(served_models=tuple(served_models), max_model_len=context, vocab_size=vocab)


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether the chat template reads the request's ``tools`` (no template: the render
    fails on its own, with its own error)."""
    return chat_template is None or re.search(r"\btools\b", chat_template) is not None


class Generator:
    """The pipeline: ``prepare`` turns a validated prompt into a token request (the
    ``RequestPreparer`` it owns), ``stream`` turns the downstream's token chunks into
    text deltas."""

    def __init__(self, tokenizer: Tokenizer, limits: Limits, downstream: TokenStreamer,
                 request_timeout_s: float = 600.0) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.downstream = downstream
        self.request_timeout_s = request_timeout_s
        self.preparer = RequestPreparer(tokenizer, limits, request_timeout_s)
        self.takes_tools = template_takes_tools(getattr(tokenizer, "chat_template", None))

    async def prepare(self, prompt: Prompt, sampling: Sampling, tenant: str, session: Session,
                      client_request_id: str) -> TokenRequest:
        """The pipeline's first half, shared by every door (``prepare.py``)."""
        if getattr(prompt, "tools", None) and not self.takes_tools:
            # The template would drop them silently: the model never sees the tools, and a
            # forced call would be a grammar's guess at functions the model was not shown.
            raise InvalidRequestError("tools", "this model's chat template has no tool support; "
                                               "send the request without tools")
        return await self.preparer.prepare(prompt, sampling, tenant, session, client_request_id)

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
                            chunk.degradation_rung, chunk.num_migrations, chunk.notes, chunk.top_logprobs,
                            chunk.prompt_logprobs, chunk.prompt_top_logprobs)
                if reason is not None:
                    return
            raise UpstreamError("the scheduler's stream ended without a finish reason")
        finally:
            await chunks.aclose()
            recorder.finish(reason, num_output_tokens, executor)

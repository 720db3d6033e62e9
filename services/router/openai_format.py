"""OpenAI response bodies and stream chunks, built from the router's domain types.

Shapes follow OpenAI's Chat Completions and (legacy) Completions APIs. Extensions are
additive: ``token_ids`` on a choice (with ``return_token_ids: true``),
``prompt_tokens_details.cached_tokens`` (prefix-cache hits) in usage, a ``weft`` object
on each finished choice (the scheduler's decisions for it, ``weft_body``: each choice is
its own scheduled request), and ``finish_reason: "kv_quota"`` when the contract's KV quota
cut the reply (the ``openai`` Python client parses an unknown finish reason as a string). Several choices
(``n``, several prompts) each carry their ``index``; their usage is ``choices_usage``.
"""
from __future__ import annotations

import json
import time
from typing import Any

from services.router.schema import ServingNotes, Usage
from services.router.tool_calls import ToolCall

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def sum_usage(usages: list[Usage]) -> Usage:
    return Usage(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                 sum(u.cached_tokens for u in usages))


def choices_usage(usages: list[Usage], n: int) -> Usage:
    """Usage of choices grouped ``n`` per prompt: each prompt counted once (its first
    completion's prompt and cached tokens: the others reuse its KV), every completion's
    output tokens."""
    firsts = usages[::n]
    return Usage(sum(u.prompt_tokens for u in firsts), sum(u.completion_tokens for u in usages),
                 sum(u.cached_tokens for u in firsts))


def weft_body(notes: ServingNotes | None, session_id: str = "", error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The scheduler's decisions for one choice (``weft.v1.SchedulingDecisions`` in
    snake_case, enums as the shared vocabulary's lowercase labels); null: not reported
    (or, for ``fallback`` / ``pause_decision``, none taken). ``session_id``: the session the
    choice's hop ran on (a branch for a session hop's choices after the first), null: none.
    ``error``: why the choice failed on its own (finish_reason "error"; a session hop's
    branch, ``http_responses.choice_error_body``), null: it did not."""
    n = notes or ServingNotes()
    return {
        "session_id": session_id or None, "error": error,
        "request_class": n.request_class or None, "priority": n.priority, "queue_ms": n.queue_ms,
        "fallback": n.fallback or None, "fallback_reason": n.fallback_reason or None,
        "degradation_rung": n.degradation_rung or None, "intent_shift": n.intent_shift,
        "intent_distance": n.intent_distance, "ttft_estimate_ms": n.ttft_estimate_ms,
        "ttft_ceiling_ms": n.ttft_ceiling_ms or None, "ttft_achieved_ms": n.ttft_achieved_ms,
        "expected_cached_tokens": n.expected_cached_tokens, "pause_decision": n.pause_decision or None,
    }


def tool_call_body(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        body = {"index": index, **body}
    return body


class ChatFormatter:
    """Bodies of one chat completion (id, model and creation time fixed per request)."""

    def __init__(self, request_id: str, model: str, include_usage: bool) -> None:
        self.id = request_id if request_id.startswith("chatcmpl-") else f"chatcmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage

    @staticmethod
    def choice(index: int, content: str | None, tool_calls: list[ToolCall], finish_reason: str,
               token_ids: list[int] | None, logprobs: list[dict[str, Any]] | None = None,
               weft: dict[str, Any] | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = [tool_call_body(c) for c in tool_calls]
        choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish_reason,
                                  "logprobs": None if logprobs is None else {"content": logprobs}}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        if weft is not None:
            choice["weft"] = weft
        return choice

    def response(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_body(usage)}

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None,
              token_ids: list[int] | None = None, index: int = 0,
              logprobs: list[dict[str, Any]] | None = None, weft: dict[str, Any] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason,
                                  "logprobs": None if logprobs is None else {"content": logprobs}}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        if weft is not None:
            choice["weft"] = weft
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": usage_body(usage)}


class CompletionFormatter:
    """Bodies of one (legacy) text completion, possibly with several prompts."""

    def __init__(self, request_id: str, model: str, include_usage: bool) -> None:
        self.id = request_id if request_id.startswith("cmpl-") else f"cmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage

    @staticmethod
    def choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None,
               logprobs: dict[str, list] | None = None, weft: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        if token_ids is not None:
            body["token_ids"] = token_ids
        if weft is not None:
            body["weft"] = weft
        return body

    def response(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_body(usage)}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": usage_body(usage)}


def sse(body: dict[str, Any] | str) -> bytes:
    """One server-sent event; ``"[DONE]"`` ends an OpenAI stream."""
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()

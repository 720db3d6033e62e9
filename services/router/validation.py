"""Validate OpenAI-style JSON bodies into the router's domain requests.

Every rejection is an ``InvalidRequestError`` naming the field (``messages[1].content``,
``temperature``), which the HTTP layer answers with 400 in OpenAI's error shape. Unknown
fields are ignored, as OpenAI's own clients send optional extras (``store``,
``metadata``, ``parallel_tool_calls``); known fields with unsupported values are
rejected rather than silently dropped.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.router.errors import InvalidRequestError, ModelNotFoundError
from services.router.schema import ChatRequest, CompletionRequest, Sampling, Session

_ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_CHOICES = ("none", "auto", "required")
_REQUEST_CLASSES = ("", "interactive", "deterministic", "batch")


@dataclass(frozen=True)
class Limits:
    """What the deployment accepts; derived from the checkpoint and the router config."""

    served_models: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    max_stop_strings: int = 16
    max_prompts: int = 64


def parse_chat_request(body: Any, limits: Limits) -> ChatRequest:
    body = _object(body, "body")
    model = _model(body, limits)
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequestError("messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty array of message objects")
    parsed = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    if _opt(body, "logprobs", bool, False) or _opt(body, "top_logprobs", int, 0):
        raise InvalidRequestError("logprobs", "log-probabilities are not supported on /v1/chat/completions")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    stream, include_usage = _stream(body)
    return ChatRequest(
        model=model,
        messages=parsed,
        tools=tools,
        tool_choice=tool_choice,
        sampling=parse_sampling(body, limits, max_tokens, field, default_max_tokens=None),
        stop=parse_stop(body.get("stop"), limits),
        stream=stream,
        include_usage=include_usage,
        session=_session(body),
        return_token_ids=_opt(body, "return_token_ids", bool, False),
    )


def parse_completion_request(body: Any, limits: Limits) -> CompletionRequest:
    body = _object(body, "body")
    model = _model(body, limits)
    if "prompt" not in body:
        raise InvalidRequestError("prompt", "is required")
    if _opt(body, "echo", bool, False):
        raise InvalidRequestError("echo", "echo is not supported")
    if body.get("logprobs") not in (None, 0):
        raise InvalidRequestError("logprobs", "log-probabilities are not supported on /v1/completions")
    if body.get("suffix") not in (None, ""):
        raise InvalidRequestError("suffix", "suffix is not supported")
    stream, include_usage = _stream(body)
    return CompletionRequest(
        model=model,
        prompts=_prompts(body["prompt"], limits),
        sampling=parse_sampling(body, limits, body.get("max_tokens"), "max_tokens", default_max_tokens=16),
        stop=parse_stop(body.get("stop"), limits),
        stream=stream,
        include_usage=include_usage,
        session=_session(body),
        return_token_ids=_opt(body, "return_token_ids", bool, False),
    )


def resolve_max_tokens(sampling: Sampling, num_prompt_tokens: int, max_model_len: int, prompt_field: str) -> int:
    """The request's max_tokens given its prompt length; the prompt must leave room."""
    if num_prompt_tokens == 0:
        raise InvalidRequestError(prompt_field, "must contain at least one token")
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise InvalidRequestError(
            prompt_field, f"{num_prompt_tokens} tokens exceed the model's context length of {max_model_len}"
        )
    if sampling.max_tokens is None:
        return room
    if sampling.max_tokens > room:
        raise InvalidRequestError(
            "max_tokens",
            f"{sampling.max_tokens} tokens requested but the prompt ({num_prompt_tokens} tokens) leaves "
            f"{room} of the model's context length of {max_model_len}",
        )
    return sampling.max_tokens


# -- pieces --------------------------------------------------------------------------
def _object(value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRequestError(field, f"must be a JSON object, got {_type(value)}")
    return value


def _type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _opt(body: Mapping[str, Any], field: str, kind: type, default: Any) -> Any:
    """An optional field of one JSON type (``null`` reads as absent; bools are not ints)."""
    value = body.get(field)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        want = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[kind]
        raise InvalidRequestError(field, f"must be {want}, got {_type(value)}")
    return value


def _model(body: Mapping[str, Any], limits: Limits) -> str:
    model = body.get("model")
    if model is None:
        raise InvalidRequestError("model", "is required")
    if not isinstance(model, str):
        raise InvalidRequestError("model", f"must be a string, got {_type(model)}")
    if model not in limits.served_models:
        raise ModelNotFoundError(model, list(limits.served_models))
    return model


def _text_content(value: Any, field: str, allow_null: bool) -> str | None:
    if value is None:
        if allow_null:
            return None
        raise InvalidRequestError(field, "is required")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            part = _object(part, f"{field}[{i}]")
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{field}[{i}]", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(field, f"must be a string or an array of text parts, got {_type(value)}")


def _message(value: Any, field: str) -> dict[str, Any]:
    m = _object(value, field)
    role = m.get("role")
    if role not in _ROLES:
        raise InvalidRequestError(f"{field}.role", f"must be one of {list(_ROLES)}, got {role!r}")
    tool_calls = m.get("tool_calls") if role == "assistant" else None
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _text_content(m.get("content"), f"{field}.content", allow_null=bool(tool_calls)),
    }
    if m.get("name") is not None:
        out["name"] = _opt(m, "name", str, None)
    if role == "tool":
        out["tool_call_id"] = _opt(m, "tool_call_id", str, None)
        if out["tool_call_id"] is None:
            raise InvalidRequestError(f"{field}.tool_call_id", "is required for role 'tool'")
    if tool_calls is not None:
        out["tool_calls"] = _assistant_tool_calls(tool_calls, f"{field}.tool_calls")
    return out


def _assistant_tool_calls(value: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRequestError(field, f"must be an array, got {_type(value)}")
    calls = []
    for i, call in enumerate(value):
        call = _object(call, f"{field}[{i}]")
        fn = _object(call.get("function"), f"{field}[{i}].function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{field}[{i}].function.name", "must be a non-empty string")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            # Templates render arguments with ``tojson``: hand them the object, not its text.
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        calls.append({"id": call.get("id") or f"call_{i}", "type": "function",
                      "function": {"name": name, "arguments": args}})
    return calls


def _tools(value: Any) -> tuple[dict[str, Any], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequestError("tools", f"must be an array, got {_type(value)}")
    tools = []
    for i, tool in enumerate(value):
        tool = _object(tool, f"tools[{i}]")
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"tools[{i}].type", "only 'function' tools are supported")
        fn = _object(tool.get("function"), f"tools[{i}].function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"tools[{i}].function.name", "must be a non-empty string")
        if fn.get("parameters") is not None:
            _object(fn["parameters"], f"tools[{i}].function.parameters")
        tools.append({"type": "function", "function": dict(fn)})
    return tuple(tools)


def _tool_choice(value: Any, tools: tuple[dict[str, Any], ...] | None) -> Any:
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in _TOOL_CHOICES:
            raise InvalidRequestError("tool_choice", f"must be one of {list(_TOOL_CHOICES)} or an object")
        return value
    choice = _object(value, "tool_choice")
    name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), Mapping) else None
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError("tool_choice", f"names function {name!r}, which is not in tools")
    return dict(choice)


def parse_sampling(body: Mapping[str, Any], limits: Limits, max_tokens: Any, field: str,
              default_max_tokens: int | None) -> Sampling:
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidRequestError(field, f"must be an integer, got {_type(max_tokens)}")
    elif not 1 <= max_tokens <= limits.max_model_len:
        raise InvalidRequestError(field, f"must be in [1, {limits.max_model_len}] (the model's context length), got {max_tokens}")
    temperature = _opt(body, "temperature", float, 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise InvalidRequestError("temperature", f"must be in [0, 2], got {temperature}")
    top_p = _opt(body, "top_p", float, 1.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequestError("top_p", f"must be in (0, 1], got {top_p}")
    top_k = _opt(body, "top_k", int, 0)
    if top_k < -1:
        raise InvalidRequestError("top_k", f"must be >= 0 (or -1 to disable), got {top_k}")
    n = _opt(body, "n", int, 1)
    if n != 1:
        raise InvalidRequestError("n", f"only n=1 is supported, got {n}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _opt(body, name, float, 0.0)
        if value != 0.0:
            raise InvalidRequestError(name, "penalties are not supported (must be 0)")
    seed = _opt(body, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**64:
        raise InvalidRequestError("seed", f"must be in [0, 2^64), got {seed}")
    min_tokens = _opt(body, "min_tokens", int, 0)
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise InvalidRequestError("min_tokens", f"must be in [0, max_tokens], got {min_tokens}")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_token_id(t, limits.vocab_size) for t in stop_ids):
        raise InvalidRequestError("stop_token_ids", f"must be an array of token ids in [0, {limits.vocab_size})")
    return Sampling(
        max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0),
        seed=seed, stop_token_ids=tuple(stop_ids), ignore_eos=_opt(body, "ignore_eos", bool, False),
        min_tokens=min_tokens,
    )


def parse_stop(value: Any, limits: Limits) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError("stop", "must be a non-empty string or an array of non-empty strings")
    if len(stops) > limits.max_stop_strings:
        raise InvalidRequestError("stop", f"at most {limits.max_stop_strings} stop strings, got {len(stops)}")
    return tuple(stops)


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _opt(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    options = _object(options, "stream_options")
    return stream, _opt(options, "include_usage", bool, False)


def _session(body: Mapping[str, Any]) -> Session:
    request_class = _opt(body, "request_class", str, "")
    if request_class not in _REQUEST_CLASSES:
        raise InvalidRequestError("request_class", f"must be one of {list(_REQUEST_CLASSES[1:])}")
    hop_index = _opt(body, "hop_index", int, 0)
    expected_tool_ms = _opt(body, "expected_tool_ms", int, 0)
    for name, value in (("hop_index", hop_index), ("expected_tool_ms", expected_tool_ms)):
        if not 0 <= value < 2**32:
            raise InvalidRequestError(name, f"must be in [0, 2^32), got {value}")
    return Session(
        session_id=_opt(body, "session_id", str, ""), program_id=_opt(body, "program_id", str, ""),
        hop_index=hop_index, expected_tool_ms=expected_tool_ms, request_class=request_class,
    )


def _is_token_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _prompts(value: Any, limits: Limits) -> tuple[str | tuple[int, ...], ...]:
    """``str`` | ``list[str]`` | ``list[int]`` | ``list[list[int]]`` -> one entry per prompt."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("prompt", "must be a string, an array of strings, or token ids (array of integers or arrays of integers)")
    if all(isinstance(p, int) for p in value):  # bools too, so they are rejected by position
        return (_token_prompt(value, "prompt", limits),)
    if len(value) > limits.max_prompts:
        raise InvalidRequestError("prompt", f"at most {limits.max_prompts} prompts per request, got {len(value)}")
    prompts: list[str | tuple[int, ...]] = []
    for i, p in enumerate(value):
        if isinstance(p, str):
            prompts.append(p)
        elif isinstance(p, list):
            prompts.append(_token_prompt(p, f"prompt[{i}]", limits))
        else:
            raise InvalidRequestError(f"prompt[{i}]", f"must be a string or an array of token ids, got {_type(p)}")
    return tuple(prompts)


def _token_prompt(ids: list[Any], field: str, limits: Limits) -> tuple[int, ...]:
    if not ids:
        raise InvalidRequestError(field, "must contain at least one token")
    for i, t in enumerate(ids):
        if not _is_token_id(t, limits.vocab_size):
            raise InvalidRequestError(f"{field}[{i}]", f"token id {t!r} is not an integer in [0, {limits.vocab_size})")
    return tuple(ids)

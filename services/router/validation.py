"""Validate OpenAI-style JSON bodies into the router's domain requests.

Every rejection is an ``InvalidRequestError`` naming the field (``messages[1].content``,
``temperature``), which the HTTP layer answers with 400 in OpenAI's error shape.

NOTE: no field that would change the output is parsed and dropped: it is honoured or
refused naming it (``field_gaps.py``). Fields without effect on the output (``user``,
``metadata``, ``store``, ``service_tier``) and unknown fields are accepted, as OpenAI's
clients send optional extras.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from services.router.chat_messages import parse_message, parse_tool_choice_spec, parse_tools
from services.router.errors import InvalidRequestError, ModelNotFoundError
from services.router.field_gaps import CHAT_FIELD_GAPS, COMPLETION_FIELD_GAPS, refuse_field_gaps
from services.router.json_fields import json_object, json_type, optional_field
from services.router.sampling_fields import MAX_N, parse_logit_bias, parse_n, parse_penalties
from services.router.schema import ChatRequest, CompletionRequest, Sampling, Session
from services.router.session_fields import check_session_choices, deterministic_sampling, parse_session
from services.router.structured_output import parse_structured_output

MAX_TOP_LOGPROBS = 20  # OpenAI's cap on chat's top_logprobs; completions' logprobs takes the same


@dataclass(frozen=True)
class Limits:
    """What the deployment accepts; derived from the checkpoint and the router config."""

    served_models: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    max_stop_strings: int = 16
    max_stop_token_ids: int = 64  # each is checked every step: an unbounded list is a CPU cost per token
    max_prompts: int = 64
    # Each message, content part, tool call and tool is walked on the event loop (and the
    # messages rendered by a pure-Python template): without a cap a 3 MB body of 100k empty
    # messages froze the router for every client for over a second. OpenAI's own caps.
    max_messages: int = 2048
    max_message_items: int = 2048  # content parts + tool calls, over all messages
    max_tools: int = 128
    max_n: int = MAX_N  # completions per prompt (each one downstream request)
    max_choices: int = 256  # prompts x n on one /v1/completions request


def parse_chat_request(body: Any, limits: Limits) -> ChatRequest:
    body = json_object(body, "body")
    model = _model(body, limits)
    refuse_field_gaps(body, CHAT_FIELD_GAPS)
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequestError("messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty array of message objects")
    check_message_counts(messages, limits, "messages")
    parsed = tuple(parse_message(m, f"messages[{i}]") for i, m in enumerate(messages))
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise InvalidRequestError("tools", f"at most {limits.max_tools} tools, got {len(tools)}")
    tools = parse_tools(tools)
    # enforced by the served format's grammar (tool_grammar.py, which refuses what it cannot keep)
    tool_choice = parse_tool_choice_spec(body.get("tool_choice"), tools)
    logprobs = optional_field(body, "logprobs", bool, False)
    top_logprobs = optional_field(body, "top_logprobs", int, 0)
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    if top_logprobs and not logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    structured = parse_structured_output(body)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    stream, include_usage = _stream(body)
    sampling = parse_sampling(body, limits, max_tokens, field, default_max_tokens=None)
    sampling = replace(sampling, logprobs=logprobs, top_logprobs=top_logprobs,
                       grammar=structured.grammar if structured else None)
    session = _session(body)
    sampling = deterministic_sampling(sampling, session, "temperature" in body)
    check_session_choices(session, 1, sampling.n, "n")
    return ChatRequest(
        model=model,
        messages=parsed,
        tools=tools,
        tool_choice=tool_choice,
        sampling=sampling,
        stop=parse_stop(body.get("stop"), limits),
        stream=stream,
        include_usage=include_usage,
        session=session,
        return_token_ids=optional_field(body, "return_token_ids", bool, False),
        grammar_field=structured.field if structured else "",
        parallel_tool_calls=optional_field(body, "parallel_tool_calls", bool, True),
    )


def parse_completion_request(body: Any, limits: Limits) -> CompletionRequest:
    body = json_object(body, "body")
    model = _model(body, limits)
    if "prompt" not in body:
        raise InvalidRequestError("prompt", "is required")
    refuse_field_gaps(body, COMPLETION_FIELD_GAPS)
    echo = optional_field(body, "echo", bool, False)
    logprobs = optional_field(body, "logprobs", int, None)  # None: none; k: each token's + k alternatives
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    if body.get("suffix") not in (None, ""):
        raise InvalidRequestError("suffix", "suffix is not supported")
    structured = parse_structured_output(body)
    stream, include_usage = _stream(body)
    # echo with max_tokens 0 scores the prompt (log-likelihood evals): the executor always
    # generates, so one token is asked for and dropped (http_api), the prompt is answered.
    max_tokens, score_only = body.get("max_tokens"), False
    if echo and max_tokens == 0 and not isinstance(max_tokens, bool):
        max_tokens, score_only = 1, True
    sampling = parse_sampling(body, limits, max_tokens, "max_tokens", default_max_tokens=16)
    sampling = replace(sampling, logprobs=logprobs is not None, top_logprobs=logprobs or 0,
                       prompt_logprobs=logprobs if echo and logprobs is not None else None,
                       grammar=structured.grammar if structured else None)
    session = _session(body)
    sampling = deterministic_sampling(sampling, session, "temperature" in body)
    prompts = _prompts(body["prompt"], limits)
    if len(prompts) * sampling.n > limits.max_choices:
        raise InvalidRequestError("n", f"{len(prompts)} prompts x n={sampling.n} exceeds {limits.max_choices} "
                                  "choices per request")
    check_session_choices(session, len(prompts), sampling.n, "n")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=sampling,
        stop=parse_stop(body.get("stop"), limits),
        stream=stream,
        include_usage=include_usage,
        session=session,
        return_token_ids=optional_field(body, "return_token_ids", bool, False),
        echo=echo,
        score_only=score_only,
        grammar_field=structured.field if structured else "",
    )


def check_message_counts(messages: list[Any], limits: Limits, field: str) -> None:
    """Refuse a conversation with more messages, or more content parts and tool calls in
    all, than the deployment walks: counted (one ``len`` per message) before anything
    parses, renders or tokenizes it."""
    if len(messages) > limits.max_messages:
        raise InvalidRequestError(field, f"at most {limits.max_messages} messages, got {len(messages)}")
    items = 0
    for m in messages:
        if isinstance(m, Mapping):
            items += sum(len(v) for v in (m.get("content"), m.get("tool_calls")) if isinstance(v, list))
    if items > limits.max_message_items:
        raise InvalidRequestError(
            field, f"at most {limits.max_message_items} content parts and tool calls in all, got {items}")


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
def _model(body: Mapping[str, Any], limits: Limits) -> str:
    model = body.get("model")
    if model is None:
        raise InvalidRequestError("model", "is required")
    if not isinstance(model, str):
        raise InvalidRequestError("model", f"must be a string, got {json_type(model)}")
    if model not in limits.served_models:
        raise ModelNotFoundError(model, list(limits.served_models))
    return model


def parse_sampling(body: Mapping[str, Any], limits: Limits, max_tokens: Any, field: str,
              default_max_tokens: int | None) -> Sampling:
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidRequestError(field, f"must be an integer, got {json_type(max_tokens)}")
    elif not 1 <= max_tokens <= limits.max_model_len:
        raise InvalidRequestError(field, f"must be in [1, {limits.max_model_len}] (the model's context length), got {max_tokens}")
    temperature = optional_field(body, "temperature", float, 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise InvalidRequestError("temperature", f"must be in [0, 2], got {temperature}")
    top_p = optional_field(body, "top_p", float, 1.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequestError("top_p", f"must be in (0, 1], got {top_p}")
    top_k = optional_field(body, "top_k", int, 0)
    if not -1 <= top_k < 2**31:  # int32 downstream; any k >= the vocabulary keeps every token
        raise InvalidRequestError("top_k", f"must be in [0, 2^31) (or -1 to disable), got {top_k}")
    n = parse_n(body, limits.max_n)
    penalties = parse_penalties(body)
    logit_bias = parse_logit_bias(body, limits.vocab_size)
    seed = optional_field(body, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**64:
        raise InvalidRequestError("seed", f"must be in [0, 2^64), got {seed}")
    min_tokens = optional_field(body, "min_tokens", int, 0)
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise InvalidRequestError("min_tokens", f"must be in [0, max_tokens], got {min_tokens}")
    stop_ids = body.get("stop_token_ids") or []
    if isinstance(stop_ids, list) and len(stop_ids) > limits.max_stop_token_ids:  # counted before walked
        raise InvalidRequestError("stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {len(stop_ids)}")
    if not isinstance(stop_ids, list) or not all(_is_token_id(t, limits.vocab_size) for t in stop_ids):
        raise InvalidRequestError("stop_token_ids", f"must be an array of token ids in [0, {limits.vocab_size})")
    return Sampling(
        max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0),
        seed=seed, stop_token_ids=tuple(stop_ids), ignore_eos=optional_field(body, "ignore_eos", bool, False),
        min_tokens=min_tokens, semantic_cache=optional_field(body, "weft_semantic_cache", bool, False),
        n=n, logit_bias=logit_bias, **penalties,
    )


def parse_stop(value: Any, limits: Limits) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if isinstance(stops, list) and len(stops) > limits.max_stop_strings:  # counted before walked
        raise InvalidRequestError("stop", f"at most {limits.max_stop_strings} stop strings, got {len(stops)}")
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError("stop", "must be a non-empty string or an array of non-empty strings")
    return tuple(stops)


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = optional_field(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    options = json_object(options, "stream_options")
    return stream, optional_field(options, "include_usage", bool, False)


def _session(body: Mapping[str, Any]) -> Session:
    return parse_session(body)


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
            raise InvalidRequestError(f"prompt[{i}]", f"must be a string or an array of token ids, got {json_type(p)}")
    return tuple(prompts)


def _token_prompt(ids: list[Any], field: str, limits: Limits) -> tuple[int, ...]:
    if not ids:
        raise InvalidRequestError(field, "must contain at least one token")
    if len(ids) >= limits.max_model_len:  # cannot fit: refuse before walking every id
        raise InvalidRequestError(field, f"{len(ids)} tokens exceed the model's context length of {limits.max_model_len}")
    for i, t in enumerate(ids):
        if not _is_token_id(t, limits.vocab_size):
            raise InvalidRequestError(f"{field}[{i}]", f"token id {t!r} is not an integer in [0, {limits.vocab_size})")
    return tuple(ids)

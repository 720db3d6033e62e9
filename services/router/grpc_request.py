"""Router.Generate's request side: a ``GenerateRequest``'s sampling, grammar, prompt and
session as the router's domain types, validated by the HTTP API's own validators so both
doors accept and refuse the same values naming the same fields (``sampling.<field>``,
``chat.messages[i]``, ``session.<field>``). The response side is ``grpc_response.py``;
tools in and calls out, ``grpc_tools.py``."""
from __future__ import annotations

import json
from dataclasses import replace

from services.router.chat_messages import parse_message
from services.router.errors import InvalidRequestError
from services.router.grpc_tools import assistant_tool_calls
from services.router.prepare import ChatPrompt, Prompt, TextPrompt, TokenIdsPrompt
from services.router.schema import Sampling, Session
from services.router.session_fields import parse_session
from services.router.structured_output import check_enforceable
from services.router.validation import Limits, parse_sampling
from weft.v1 import common_pb2, router_pb2

# HTTP's /v1/completions default (validation.parse_completion_request): a text or token-ids prompt
# is that door's request, so an unset max_tokens is 16 there and here.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


MAX_TOP_LOGPROBS = 20  # OpenAI's cap, as HTTP's (validation.py)
MAX_GRAMMAR_CHARS = 65_536  # as HTTP's structured output (structured_output.py)


def sampling_from_proto(request: router_pb2.GenerateRequest, limits: Limits) -> Sampling:
    """``request.sampling`` with HTTP's defaults for what the caller did not set, so one
    request means the same at both doors: temperature 1.0, top_p 1.0, n 1, no penalties or
    bias, and max_tokens as the HTTP endpoint of the prompt's form (a chat prompt: the room
    the context leaves, as ``/v1/chat/completions``; text or token ids: 16, as
    ``/v1/completions``). Validation is HTTP's (``parse_sampling``), so a set value is
    checked, never replaced: max_tokens or top_p set to 0 is refused naming the field (the
    fields are proto3 ``optional``, so "unset" is told from 0). Refusals name
    ``sampling.<field>``."""
    s = request.sampling  # an absent message reads as one with nothing set
    body: dict = {"top_k": s.top_k, "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos,
                  "min_tokens": s.min_tokens, "min_p": s.min_p, "presence_penalty": s.presence_penalty,
                  "frequency_penalty": s.frequency_penalty}
    for name in ("temperature", "top_p", "seed", "repetition_penalty"):  # absent: HTTP's default
        if s.HasField(name):
            body[name] = getattr(s, name)
    if s.n:  # 0 is proto3's unset: one completion
        body["n"] = s.n
    if s.logit_bias:  # HTTP's shape: decimal token-id keys
        body["logit_bias"] = {str(token): bias for token, bias in sorted(s.logit_bias.items())}
    if s.HasField("max_tokens"):
        max_tokens, default = s.max_tokens, None
    else:
        max_tokens = None
        default = None if request.WhichOneof("prompt") == "chat" else COMPLETIONS_DEFAULT_MAX_TOKENS
    try:
        sampling = parse_sampling(body, limits, max_tokens, "sampling.max_tokens", default_max_tokens=default)
    except InvalidRequestError as exc:  # HTTP names the body's top-level field
        raise _in_sampling(exc) from None
    logprobs = s.logprobs or request.return_logprobs
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequestError("sampling.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {s.top_logprobs}")
    if s.top_logprobs and not logprobs:
        raise InvalidRequestError("sampling.top_logprobs", "needs sampling.logprobs (or return_logprobs)")
    prompt_logprobs = s.prompt_logprobs if s.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and prompt_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequestError("sampling.prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}")
    return replace(sampling, logprobs=logprobs, top_logprobs=s.top_logprobs, prompt_logprobs=prompt_logprobs,
                   grammar=grammar_from_proto(s))


def _in_sampling(exc: InvalidRequestError) -> InvalidRequestError:
    field = exc.field if exc.field.startswith("sampling.") else f"sampling.{exc.field}"
    return InvalidRequestError(field, exc.message)


def grammar_from_proto(s: common_pb2.SamplingParams) -> tuple[str, str] | None:
    """``sampling.grammar`` as ``Sampling.grammar``; shapes and sizes are checked here,
    compiling is the executor's (its refusal comes back naming ``sampling.grammar.<kind>``)."""
    if not s.HasField("grammar"):
        return None
    kind = s.grammar.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("sampling.grammar", "set one of json_schema, json_object, regex, ebnf or "
                                  "structural_tag (leave grammar unset for free text)")
    field = f"sampling.grammar.{kind}"
    if kind == "json_object":
        if not s.grammar.json_object:
            raise InvalidRequestError(field, "must be true when set (leave grammar unset for free text)")
        return "json_object", ""
    text = getattr(s.grammar, kind)
    if not text.strip():
        raise InvalidRequestError(field, "must not be empty")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(field, f"longer than {MAX_GRAMMAR_CHARS} characters ({len(text)})")
    if kind in ("json_schema", "structural_tag"):
        try:
            doc = json.loads(text, parse_constant=_no_constant)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidRequestError(field, f"must be JSON text: {exc}") from None
        except ValueError:
            raise InvalidRequestError(field, "holds NaN or Infinity, which JSON does not allow") from None
        if kind == "json_schema":  # the same keyword refusals as HTTP's response_format
            check_enforceable(doc, field)
    return kind, text


def _no_constant(name: str) -> None:
    raise ValueError(name)


def prompt_from_proto(request: router_pb2.GenerateRequest, limits: Limits,
                      tools: tuple[dict, ...] | None = None) -> Prompt:
    """The request's prompt form; its field names are the proto's (``text``, ``token_ids``,
    ``chat.messages``), as every refusal of the prompt names them."""
    form = request.WhichOneof("prompt")
    if form == "text":
        return TextPrompt(request.text, "text")
    if form == "token_ids":
        return TokenIdsPrompt(tuple(request.token_ids.ids), "token_ids")
    if form == "chat":
        if not request.chat.messages:
            raise InvalidRequestError("chat.messages", "must not be empty")
        if len(request.chat.messages) > limits.max_messages:  # as HTTP's cap
            raise InvalidRequestError("chat.messages", f"at most {limits.max_messages} "
                                      f"messages, got {len(request.chat.messages)}")
        messages = tuple(parse_message(_message(msg), f"chat.messages[{i}]")
                         for i, msg in enumerate(request.chat.messages))
        return ChatPrompt(messages, tools, request.chat.add_generation_prompt, "chat.messages")
    raise InvalidRequestError("prompt", "one of text, chat or token_ids is required")


def _message(msg: router_pb2.ChatMessage) -> dict:
    """A proto message as the JSON object HTTP would carry (empty strings read as absent),
    for ``chat_messages.parse_message``: one validation for both doors."""
    out = {"role": msg.role, "content": msg.content}
    if msg.name:
        out["name"] = msg.name
    if msg.tool_call_id:
        out["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:  # rendered by the chat template; refused on a role other than assistant
        out["tool_calls"] = assistant_tool_calls(msg)
    return out


def session_from_proto(s: common_pb2.SessionInfo) -> Session:
    """``SessionInfo`` as the JSON fields HTTP would carry, validated by the same
    ``parse_session``: an enum number the proto does not define (``request_class=99``)
    is refused naming the field, as an unknown name is over HTTP."""
    c = s.contract
    body = {
        "session_id": s.session_id, "program_id": s.program_id, "hop_index": s.hop_index,
        "expected_tool_ms": s.expected_tool_ms, "session_stateful": s.stateful,
        "request_class": _enum_name(common_pb2.RequestClass, s.request_class, "REQUEST_CLASS_"),
        "contract": {
            "kv_quota_blocks": c.kv_quota_blocks, "ttft_ceiling_ms": c.ttft_ceiling_ms,
            "tpot_ceiling_ms": c.tpot_ceiling_ms,
            "fallback": _enum_name(common_pb2.FallbackPath, c.fallback, "FALLBACK_PATH_"),
            "accepted_degrade_steps": [_enum_name(common_pb2.DegradeStep, step, "DEGRADE_STEP_") or str(step)
                                       for step in c.accepted_degrade_steps],
        },
    }
    return parse_session(body, prefix="session.")


def _enum_name(enum, value: int, prefix: str) -> str:
    """``REQUEST_CLASS_BATCH`` -> "batch"; 0 (unspecified) -> ""; an undefined number -> its
    digits, which no validator accepts."""
    if value == 0:
        return ""
    if value not in enum.values():
        return str(value)
    return enum.Name(value).removeprefix(prefix).lower()

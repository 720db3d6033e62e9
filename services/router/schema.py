"""The router's domain types: validated requests and the events a generation yields.

Frozen dataclasses only; ``validation.py`` builds the requests from JSON, ``server.py``
from protobuf, and ``generation.py`` turns one ``TokenRequest`` into ``Delta`` events.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """Sampling and token-level stopping; mirrors ``weft.v1.SamplingParams``.
    ``max_tokens`` None means "whatever room the context leaves" (resolved by the router)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    min_tokens: int = 0
    semantic_cache: bool = False  # opt-in: a greedy request may be answered from the semantic response cache
    # Constrained decoding: (kind, text) with kind one of "json_schema", "json_object",
    # "regex", "ebnf", "structural_tag" (``weft.v1.Grammar``); None: free text.
    grammar: tuple[str, str] | None = None
    top_logprobs: int = 0  # with logprobs: alternatives of each output token
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob + k alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1  # completions of the prompt; the router fans them out (one downstream request each)
    resumed_output_tokens: int = 0  # trailing prompt tokens a previous attempt generated


@dataclass(frozen=True)
class ContractSpec:
    """Per-task contract (``weft.v1.Contract``); zeros mean "none" / "by class"."""

    kv_quota_blocks: int = 0
    ttft_ceiling_ms: int = 0
    tpot_ceiling_ms: int = 0
    fallback: str = ""  # "", "degrade", "reroute", "fail_fast"
    # Degradation rungs the task accepts (labels from ``services/shared/vocabulary.RUNG_LABELS``);
    # empty: every rung.
    # ("none",) alone: full quality only. Shed always applies.
    accepted_degrade_steps: tuple[str, ...] = ()


@dataclass(frozen=True)
class Session:
    """Agent session context (all optional)."""

    session_id: str = ""
    program_id: str = ""
    hop_index: int = 0
    expected_tool_ms: int = 0
    request_class: str = ""  # "" (decided by intent.py) or a ``RequestClass`` label: "interactive", ...
    stateful: bool = False  # the prompt holds only this hop's new tokens
    contract: ContractSpec = field(default_factory=ContractSpec)


@dataclass(frozen=True)
class ChatRequest:
    """A validated ``/v1/chat/completions`` body (messages are plain dicts ready for the
    chat template: role, content text, tool_calls, tool_call_id, name)."""

    model: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    tool_choice: Any  # tool_parsers.ToolChoice
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    session: Session
    return_token_ids: bool = False
    grammar_field: str = ""  # the body field sampling.grammar came from (named by its refusals)
    parallel_tool_calls: bool = True

    @property
    def parse_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"


@dataclass(frozen=True)
class CompletionRequest:
    """A validated ``/v1/completions`` body; ``prompts`` holds one entry per choice,
    each text or token ids."""

    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    session: Session
    return_token_ids: bool = False
    echo: bool = False
    score_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) only
    grammar_field: str = ""


@dataclass(frozen=True)
class TokenRequest:
    """What the router sends downstream: token ids only, one stream per request."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling  # max_tokens resolved (never None)
    tenant: str
    session: Session = field(default_factory=Session)
    deadline_unix_ms: int = 0
    fork_id: str = ""  # a session hop's branch: the fork that created its session (session_branches.py)


@dataclass(frozen=True)
class TokenChunk:
    """One chunk of the scheduler's stream."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None  # "stop", "length", "kv_quota", "abort", "error" on the last chunk
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    executor: str
    degradation_rung: str = ""  # rung of the degradation ladder that served it (first chunk), "" = unknown
    num_migrations: int = 0  # times the stream moved to another executor (last chunk)
    notes: ServingNotes | None = None  # what the scheduler decided (class, fallback, pause)
    # (token id, logprob) alternatives of each of token_ids, when sampling.top_logprobs > 0
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    # first chunk, with sampling.prompt_logprobs: each prompt token's logprob after the first
    prompt_logprobs: tuple[float, ...] = ()
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class ServingNotes:
    """The scheduler's decisions for one request (``weft.v1.SchedulingDecisions``), as the
    client may see them: everything but the pause on the first chunk, the session's pause
    decision on the last. Labels are the shared vocabulary's; "" / None = not reported."""

    request_class: str = ""
    fallback: str = ""  # "", "degrade", "reroute", "fail_fast"
    fallback_reason: str = ""
    pause_decision: str = ""  # "", "keep", "demote", "drop"
    degradation_rung: str = ""  # rung it was served on (first chunk): "none", "kv_int8", ...; "" = unknown
    priority: float | None = None  # higher ran first
    queue_ms: int | None = None  # waited in the scheduler's queue
    intent_shift: bool = False  # the session's kept KV was released: the hop changed topic
    intent_distance: float = 0.0  # of the intent check; 0: none ran
    ttft_estimate_ms: int = 0  # the contract's estimate, counting the expected cached prefix
    ttft_ceiling_ms: int = 0  # 0: none
    ttft_achieved_ms: int | None = None  # as the scheduler observed it
    expected_cached_tokens: int = 0  # prompt tokens the placement expected cached

    def merged(self, later: ServingNotes | None) -> ServingNotes:
        """These (first-chunk) notes completed by a later chunk's: its non-empty fields win."""
        if later is None:
            return self
        empty = ServingNotes()
        return replace(self, **{f.name: getattr(later, f.name) for f in fields(self)
                                if getattr(later, f.name) != getattr(empty, f.name)})


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Delta:
    """One step of a generation as the client sees it: text released since the previous
    delta (after stop strings), the ids behind it, and on the last one the finish reason."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    usage: Usage
    executor: str
    degradation_rung: str = ""  # see TokenChunk
    num_migrations: int = 0  # see TokenChunk
    notes: ServingNotes | None = None  # see TokenChunk
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # see TokenChunk
    prompt_logprobs: tuple[float, ...] = ()  # see TokenChunk (first delta)
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    # finish_reason "error" on a choice that failed on its own (a session hop's branch,
    # session_branches.isolate_branch_failures): the router's error it would have failed with.
    error: Exception | None = None

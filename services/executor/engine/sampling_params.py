"""Sampling parameters of one request, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.executor.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20  # OpenAI's ceiling for top_logprobs
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar the output must follow: ``kind`` one of GRAMMAR_KINDS, ``text`` its
    source (empty for json_object). Compiled once per distinct (kind, text)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError("grammar", f"unknown kind {self.kind!r}; one of {', '.join(GRAMMAR_KINDS)}")
        if self.kind != "json_object" and not self.text:
            raise InvalidRequestError(f"grammar.{self.kind}", "must not be empty")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``seed`` makes a sampled request reproducible
    regardless of what else shares its batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the logprob of each chosen token
    min_tokens: int = 0
    grammar: GrammarSpec | None = None  # constrained decoding (services/executor/grammar)
    top_logprobs: int = 0  # with logprobs: this many alternatives of each output token
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob + k alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, sorted by id
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output; 1 disables
    presence_penalty: float = 0.0  # over the output
    frequency_penalty: float = 0.0  # over the output, times the count
    resumed_output_tokens: int = 0  # trailing prompt tokens an earlier attempt generated
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", f"must be > 0, got {self.max_tokens}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError("seed", f"must be an integer, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("prompt_logprobs",
                                      f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        bias = tuple(sorted((int(t), float(b)) for t, b in dict(self.logit_bias).items()))
        for token, b in bias:
            if token < 0 or not math.isfinite(b) or not -100.0 <= b <= 100.0:
                raise InvalidRequestError("logit_bias", f"token {token}: bias must be in [-100, 100], got {b}")
        object.__setattr__(self, "logit_bias", bias)
        if not _finite_in(self.min_p, 0.0, 1.0):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not _finite_in(self.repetition_penalty, 0.0, 2.0) or self.repetition_penalty == 0.0:
            raise InvalidRequestError("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite_in(getattr(self, name), -2.0, 2.0):
                raise InvalidRequestError(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if self.resumed_output_tokens < 0:
            raise InvalidRequestError("resumed_output_tokens", f"must be >= 0, got {self.resumed_output_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether any logits processor beyond temperature / top-k / top-p applies."""
        return bool(self.logit_bias) or self.min_p > 0.0 or self.repetition_penalty != 1.0 \
            or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _finite_in(value: object, lo: float, hi: float) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and lo <= value <= hi)

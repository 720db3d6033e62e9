"""Sampling parameters of one request, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.executor.errors import InvalidRequestError


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

"""One request's state inside the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from services.shared.block_hash import BlockHash
from services.executor.kv.block_pool import Block
from services.shared.vocabulary import DEFAULT_PARTITION
from services.executor.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the model's context
    KV_QUOTA = "kv_quota"  # the task contract's KV quota: final (asking again cannot get more room)
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"


@dataclass(frozen=True)
class SessionOptions:
    """What an agent hop asks of the engine beyond sampling (all optional)."""

    session_id: str = ""
    pin_ttl_s: float = 0.0  # keep decision: pin the hop's full blocks this long when it finishes
    kv_quota_blocks: int = 0  # the contract's per-task KV quota; 0 = none
    track_entropy: bool = False  # report the mean entropy of the sampled distributions

    def __post_init__(self) -> None:
        if self.pin_ttl_s < 0 or self.kv_quota_blocks < 0:
            raise ValueError("pin_ttl_s and kv_quota_blocks must be >= 0")
        if self.pin_ttl_s and not self.session_id:
            raise ValueError("pin_ttl_s needs a session_id")


NO_SESSION = SessionOptions()


@dataclass
class Sequence:
    """A request's tokens, its place in the KV pool and its progress.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the next step
    computes ``all_token_ids[num_computed_tokens:]`` (or a chunk of it).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    partition: str = DEFAULT_PARTITION
    extra_keys: bytes = b""
    priority: float = 0.0  # higher runs first (services/shared/vocabulary.py); the policy reads it
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    # Changes only by appending to this list or by assigning a new one (the KV manager):
    # the model runner's persistent block table (input_batch.py) relies on it.
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, in order
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    session: SessionOptions = NO_SESSION
    max_num_tokens: int = 1 << 62  # context cap: the model's, or the per-task KV quota's
    capped_by_kv_quota: bool = False  # max_num_tokens is the KV quota's (below the model's context)
    entropy_sum: float = 0.0  # nats, over sampled tokens (only when session.track_entropy)
    # KV compression (kv_compress.py): tokens whose blocks were dropped, always whole
    # blocks, so cache index = position - num_evicted_tokens; and the attention mass
    # each kept block received, aligned with ``blocks``. Both reset when all blocks go.
    num_evicted_tokens: int = 0
    block_scores: list[float] = field(default_factory=list)
    # Constrained decoding: the request's grammar matcher (services/executor/grammar), fed
    # every appended token; None for free text.
    grammar: object | None = None
    # With params.top_logprobs: (token id, logprob) alternatives of each output token.
    output_top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    # With params.prompt_logprobs: each prompt token's logprob after the first (and its
    # alternatives), filled as the prefill chunks run; sent once, with the first output.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_cached_kv_tokens(self) -> int:
        """Computed tokens whose K/V are still in the cache (not dropped by compression)."""
        return self.num_computed_tokens - self.num_evicted_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float | None = None,
                     top_logprobs: tuple[tuple[int, float], ...] | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    @property
    def mean_entropy(self) -> float:
        return self.entropy_sum / self.num_output_tokens if self.num_output_tokens else 0.0

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

"""Engine options: validated once, derived values as properties."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.executor.policy.kv_compress import KV_COMPRESS_POLICIES

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs a model. Every field has a safe default for a CPU."""

    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 512  # longest prefill chunk one sequence gets per step
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    preemption_policy: str = "fcfs"
    model_id: str = ""  # hashed into block hashes; defaults to the checkpoint's directory name
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's choice
    # Degradation-ladder mechanisms (a degraded executor profile; see docs/architecture.md).
    kv_cache_dtype: str = "auto"  # auto: the model dtype; int8: symmetric int8, one scale per token and KV head
    kv_compress_budget_blocks: int = 0  # 0: off; else most KV blocks a sequence keeps (heavy hitters + recent)
    kv_compress_recent_blocks: int = 4  # the newest blocks a compressed sequence always keeps
    kv_compress_sink_blocks: int = 1  # the first blocks (attention sinks) it always keeps
    kv_compress_policy: str = "attention"  # attention: least-attended middle block first; oldest: StreamingLLM

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "kv_cache_memory_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be > 0, got {self.num_kv_blocks}")
        if self.max_prefill_chunk > self.max_num_batched_tokens:
            raise ValueError("max_prefill_chunk must not exceed max_num_batched_tokens")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_compress_policy not in KV_COMPRESS_POLICIES:
            raise ValueError(f"kv_compress_policy must be one of {KV_COMPRESS_POLICIES}, got {self.kv_compress_policy!r}")
        if self.kv_compress_budget_blocks < 0:
            raise ValueError(f"kv_compress_budget_blocks must be >= 0, got {self.kv_compress_budget_blocks}")
        if self.kv_compress_budget_blocks and (
                self.kv_compress_recent_blocks < 1 or self.kv_compress_sink_blocks < 0
                or self.kv_compress_sink_blocks + self.kv_compress_recent_blocks >= self.kv_compress_budget_blocks):
            raise ValueError("kv_compress_budget_blocks must exceed kv_compress_sink_blocks + "
                             "kv_compress_recent_blocks (and recent >= 1, sink >= 0), got "
                             f"budget={self.kv_compress_budget_blocks} sink={self.kv_compress_sink_blocks} "
                             f"recent={self.kv_compress_recent_blocks}")
        if (self.attention_backend == "triton" and not self.device.startswith("cuda")
                and torch.cuda.is_available()):
            # With a GPU present the kernels compile for it (the interpreter stays off), and
            # a compiled kernel cannot read a CPU cache: say so now, not at the first step.
            raise ValueError(f"attention_backend 'triton' needs device 'cuda' on a machine with a GPU "
                             f"(device is {self.device!r}); the CPU back end is 'torch'")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"

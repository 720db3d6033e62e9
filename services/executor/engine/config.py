"""Engine options: declared once, validated once, derived values as properties.

Each field is an ``option`` (services/mesh/env_config.py) with its help text, so the
executor process takes every engine option as a flag / ``WEFT_EXECUTOR_*`` variable of
the same name without redeclaring it (``ExecutorConfig`` derives from this class and
builds the engine's own ``EngineConfig`` from these fields, in one place).

torch is imported only where a torch value is needed, so ``--help`` does not load it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.executor.policy.kv_compress import KV_COMPRESS_POLICIES
from services.executor.policy.preemption import PREEMPTION_POLICIES
from services.mesh.env_config import option

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs a model. Every field has a safe default for a CPU."""

    device: str = option("Torch device: cpu, cuda, cuda:N.", default="cpu")
    dtype: str = option("Weight and KV dtype.", default="float32", choices=DTYPES)
    attention_backend: str = option("Attention back end (auto: triton on CUDA, torch elsewhere).",
                                    default="auto", choices=ATTENTION_BACKENDS)
    block_size: int = option("Tokens per KV block.", default=16)
    num_kv_blocks: int | None = option("KV blocks in the pool; none: derived from --kv-cache-memory-bytes.", default=None)
    kv_cache_memory_bytes: int = option(
        "Bytes of KV cache when --num-kv-blocks is none (never more blocks than twice what max_num_seqs "
        "sequences of max_model_len tokens fill).", default=1 << 30)
    max_num_seqs: int = option("Most requests computed in one step.", default=64)
    max_num_batched_tokens: int = option("Most tokens computed in one step.", default=2048)
    max_prefill_chunk: int = option("Longest prefill chunk one request gets per step.", default=512)
    max_model_len: int | None = option("Context limit in tokens; none: the model's.", default=None)
    enable_prefix_caching: bool = option("Reuse KV blocks across requests by block hash.", default=True)
    preemption_policy: str = option(
        "Waiting order and who loses blocks under pressure: priority (the scheduler's priority, the order its "
        "scored queue uses: borrowers lose first, then the lowest priority, then the newest; equal priorities "
        "are arrival order) or fcfs (arrival order, newest loses: the vLLM-like ablation).",
        default="priority", choices=PREEMPTION_POLICIES)
    model_id: str = option("Model id hashed into block hashes; empty: the checkpoint directory's name.", default="")
    num_threads: int | None = option("Torch CPU threads; none: torch's choice.", default=None)
    native_decode: bool = option(
        "On a CPU in float32, run a step that is one decode and nothing else as one native C call "
        "(services/executor/model/native/, built with the system gcc at first use and cached; a failed "
        "build warns and keeps the torch path). Keeps a row-major copy of the projection weights beside "
        "oneDNN's packed ones. WEFT_NATIVE_DECODE=0 also turns it off.", default=True)
    cuda_graphs: bool = option(
        "Replay decode steps from CUDA graphs: an engine on CUDA with the triton attention back end "
        "captures, at start, one graph per decode batch size bucket (1, 2, 4, then every multiple of 8 up "
        "to max_num_seqs, at most 256) and runs every decode-only step of up to that size from it, one "
        "launch for the whole forward pass instead of hundreds. Prefill steps, and steps that track "
        "attention mass for KV compression, stay eager; a failed capture logs a warning and stays eager. "
        "Off by default until it has been measured on a GPU (benchmarks/gpu/run.sh); ignored on a CPU.",
        default=False)
    # Degradation-ladder mechanisms (a degraded executor profile; see docs/architecture.md).
    kv_cache_dtype: str = option(
        "KV cache storage (auto: the model dtype; int8: int8 with a scale per token and KV head, about "
        "4x the tokens of a float32 cache in the same bytes). An int8 executor serves the kv_int8 rung "
        "of the degradation ladder.", default="auto", choices=KV_CACHE_DTYPES)
    kv_compress_budget_blocks: int = option(
        "0: off. Else the most KV blocks one sequence keeps: past it, the middle block with the least "
        "attention mass is dropped (the first --kv-compress-sink-blocks and newest "
        "--kv-compress-recent-blocks are always kept). Such an executor serves the kv_compress rung.",
        default=0)
    kv_compress_recent_blocks: int = option("Newest blocks a compressed sequence always keeps.", default=4)
    kv_compress_sink_blocks: int = option("First blocks (attention sinks) a compressed sequence always keeps.",
                                          default=1)
    kv_compress_policy: str = option(
        "Which middle block a compressed sequence drops first: attention (the least attended; heavy "
        "hitters stay) or oldest (StreamingLLM: sinks + a sliding window).", default="attention",
        choices=KV_COMPRESS_POLICIES)

    grammar_cache_entries: int = option(
        "Compiled grammars (constrained decoding) kept, least recently used dropped first.", default=256)
    grammar_max_bytes: int = option("Longest grammar source (schema, regex, EBNF, structural tag) accepted, "
                                    "in bytes.", default=64 * 1024)
    grammar_compile_timeout_s: float = option(
        "Longest a grammar may take to compile before the request is refused (INVALID_ARGUMENT). Compiles run "
        "off the engine thread: only requests that need the grammar wait; other streams keep going.",
        default=5.0)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "kv_cache_memory_bytes",
                     "grammar_cache_entries", "grammar_max_bytes", "grammar_compile_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or unset, got {self.num_threads}")
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
        if self.attention_backend == "triton" and not self.device.startswith("cuda") and _cuda_available():
            # With a GPU present the kernels compile for it (the interpreter stays off), and
            # a compiled kernel cannot read a CPU cache: say so now, not at the first step.
            raise ValueError(f"attention_backend 'triton' needs device 'cuda' on a machine with a GPU "
                             f"(device is {self.device!r}); the CPU back end is 'torch'")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

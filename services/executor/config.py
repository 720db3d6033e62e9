"""ExecutorConfig: everything an executor process is told, from flags / WEFT_ env."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from services.executor.engine.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, EngineConfig
from services.executor.policy.kv_compress import KV_COMPRESS_POLICIES
from services.mesh.env_config import option
from services.mesh.logging import LOG_FORMATS, LOG_LEVELS
from services.mesh.nats_bus import subject

DESCRIPTION = (
    "Weft executor: loads a checkpoint, runs its paged-KV engine and serves the internal "
    "Executor gRPC API (token-level Generate streams). Announces itself on NATS with a "
    "heartbeat and publishes kv and load events for the scheduler's placement."
)


@dataclass(frozen=True)
class ExecutorConfig:
    model_dir: str = option("Checkpoint directory (config.json, *.safetensors, tokenizer.json). Required.", default="")
    name: str = option("Unique executor name on the bus and in responses; empty: executor-<host>-<pid>.", default="")
    host: str = option("Address the gRPC server binds.", default="127.0.0.1")
    port: int = option("gRPC port.", default=50061)
    advertise_address: str = option(
        "host:port the scheduler dials; empty: <host>:<port> (the hostname when binding 0.0.0.0).", default="")
    nats_url: str = option("NATS server URL for events.", default="nats://127.0.0.1:4222", shared=True)
    model_id: str = option("Model id hashed into block hashes; empty: the checkpoint directory's name.", default="")
    device: str = option("Torch device: cpu, cuda, cuda:N.", default="cpu")
    dtype: str = option("Weight and KV dtype.", default="float32", choices=("float32", "float16", "bfloat16"))
    attention_backend: str = option("Attention back end (auto: triton on CUDA, torch elsewhere).",
                                    default="auto", choices=ATTENTION_BACKENDS)
    block_size: int = option("Tokens per KV block.", default=16)
    num_kv_blocks: int | None = option("KV blocks in the pool; none: derived from --kv-cache-memory-bytes.", default=None)
    kv_cache_memory_bytes: int = option("Bytes of KV cache when --num-kv-blocks is none.", default=256 * 1024 * 1024)
    max_num_seqs: int = option("Most requests computed in one step.", default=64)
    max_num_batched_tokens: int = option("Most tokens computed in one step.", default=2048)
    max_prefill_chunk: int = option("Longest prefill chunk one request gets per step.", default=512)
    max_model_len: int | None = option("Context limit in tokens; none: the model's.", default=None)
    enable_prefix_caching: bool = option("Reuse KV blocks across requests by block hash.", default=True)
    preemption_policy: str = option("Who loses blocks under pressure: fcfs (newest) or priority (borrowers, then "
                                    "lowest priority).", default="fcfs", choices=("fcfs", "priority"))
    tenant_partitions: str = option(
        "KV partitions per tenant, name=reserved:credit blocks, comma-separated (e.g. acme=32:16); "
        "requests are charged to their tenant's partition.", default="")
    credit_audit_period_s: float = option("Seconds between audits that decay a borrowing tenant's credit; "
                                          "0 disables.", default=2.0)
    num_threads: int | None = option("Torch CPU threads; none: torch's choice.", default=None)
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
    kv_compress_policy: str = option(
        "Which middle block a compressed sequence drops first: attention (the least attended; heavy "
        "hitters stay) or oldest (StreamingLLM: sinks + a sliding window).", default="attention",
        choices=KV_COMPRESS_POLICIES)
    kv_compress_sink_blocks: int = option("First blocks (attention sinks) a compressed sequence always keeps.",
                                          default=1)
    serves_rung: str = option(
        "Degradation rung this executor's pool serves: none (full quality), kv_int8, kv_compress or "
        "smaller_model (a smaller checkpoint with the same tokenizer). Empty: derived from the KV flags "
        "(int8 -> kv_int8, a compress budget -> kv_compress, else none).", default="",
        choices=("", "none", "kv_int8", "kv_compress", "smaller_model"))
    heartbeat_interval_s: float = option("Seconds between membership heartbeats.", default=1.0)
    load_report_interval_s: float = option("Seconds between load reports.", default=0.25)
    grace_s: float = option("On SIGTERM, seconds in-flight requests get to finish.", default=10.0)
    engine_stall_s: float = option(
        "Seconds the engine thread may hold work without finishing a step before the executor counts it "
        "wedged, reports NOT_SERVING / FAILED, fails its streams (UNAVAILABLE) and exits for a restart "
        "(as it does at once when the thread dies); 0 disables the stall check.", default=60.0)
    max_message_bytes: int = option("Largest gRPC message sent or received.", default=64 * 1024 * 1024)
    metrics_port: int = option("Port of the Prometheus /metrics endpoint; 0 disables it.", default=0)
    cachestore_address: str = option(
        "host:port of the cachestore for KV demotion / promotion; empty: no lower tiers.", default="")
    demote_on_finish: str = option("Which finished requests' blocks are written to the cachestore.",
                                   default="sessions", choices=("never", "sessions", "all"))
    promote_before_prefill: bool = option(
        "Load a prompt's prefix blocks from the cachestore before its prefill when cheaper than recompute.",
        default=True)
    mesh_secret_file: str = option(
        "File holding the mesh shared secret (Docker secrets style, e.g. /run/secrets/weft_mesh); stripped; "
        "unreadable or empty is an error; empty: WEFT_MESH_SECRET, or no peer authentication.",
        default="", shared=True)
    log_level: str = option("Log level.", default="info", choices=LOG_LEVELS, shared=True)
    log_format: str = option("Log format (auto: JSON unless stderr is a terminal).", default="auto",
                             choices=LOG_FORMATS, shared=True)

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir is required (--model-dir or WEFT_EXECUTOR_MODEL_DIR)")
        if not Path(self.model_dir).is_dir():
            raise ValueError(f"model_dir {self.model_dir!r} is not a directory")
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise ValueError("port and metrics_port must be in [0, 65535]")
        for name in ("heartbeat_interval_s", "load_report_interval_s", "max_message_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.engine_stall_s < 0:
            raise ValueError(f"engine_stall_s must be >= 0 (0 disables), got {self.engine_stall_s}")
        if self.name:
            subject("heartbeat", self.name)  # a subject-safe name, or ValueError
        if self.credit_audit_period_s < 0:
            raise ValueError(f"credit_audit_period_s must be >= 0, got {self.credit_audit_period_s}")
        self.partitions  # validates the partition table (raises ValueError)
        self.engine_config  # validates the engine options (raises ValueError)

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            device=self.device, dtype=self.dtype, attention_backend=self.attention_backend,
            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_prefill_chunk=self.max_prefill_chunk,
            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            model_id=self.model_id, num_threads=self.num_threads, preemption_policy=self.preemption_policy,
            kv_cache_dtype=self.kv_cache_dtype, kv_compress_budget_blocks=self.kv_compress_budget_blocks,
            kv_compress_recent_blocks=self.kv_compress_recent_blocks,
            kv_compress_sink_blocks=self.kv_compress_sink_blocks, kv_compress_policy=self.kv_compress_policy,
        )

    @property
    def resolved_serves_rung(self) -> str:
        """The degradation rung this executor's pool serves (see --serves-rung)."""
        if self.serves_rung:
            return self.serves_rung
        if self.kv_cache_dtype == "int8":
            return "kv_int8"
        return "kv_compress" if self.kv_compress_budget_blocks else "none"

    @property
    def partitions(self):
        from services.executor.policy.credit_audit import parse_partitions

        return parse_partitions(self.tenant_partitions)

    @property
    def resolved_name(self) -> str:
        return self.name or f"executor-{socket.gethostname().split('.')[0]}-{os.getpid()}"

    @property
    def resolved_model_id(self) -> str:
        """As the engine computes it: the flag, else the checkpoint directory's name."""
        return self.model_id or Path(self.model_dir).name

    def address(self, bound_port: int) -> str:
        if self.advertise_address:
            return self.advertise_address
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{bound_port}"

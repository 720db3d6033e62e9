"""ExecutorConfig: everything an executor process is told, from flags / WEFT_ env.

Declared once: the options every service takes come from ``ServiceOptions``
(services/mesh/service_options.py), the engine's from ``EngineConfig``
(engine/config.py, each field an ``option`` with its help), and this class adds only
the executor's own. The flags stay flat (``--max-num-seqs``, ``WEFT_EXECUTOR_MAX_NUM_SEQS``);
``engine_config`` is the one place the engine's ``EngineConfig`` is built from them,
field by field as ``dataclasses.fields(EngineConfig)`` lists them.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from services.executor.engine.config import EngineConfig
from services.mesh.env_config import option
from services.mesh.subjects import subject
from services.mesh.service_options import ServiceOptions, check_port
from services.shared.vocabulary import POOL_RUNG_LABELS, Rung

DESCRIPTION = (
    "Weft executor: loads a checkpoint, runs its paged-KV engine and serves the internal "
    "Executor gRPC API (token-level Generate streams). Announces itself on NATS with a "
    "heartbeat and publishes kv and load events for the scheduler's placement."
)


@dataclass(frozen=True)
class ExecutorConfig(EngineConfig, ServiceOptions):
    model_dir: str = option("Checkpoint directory (config.json, *.safetensors, tokenizer.json). Required.", default="")
    name: str = option("Unique executor name on the bus and in responses; empty: executor-<host>-<pid>.", default="")
    port: int = option("gRPC port.", default=50061)
    advertise_address: str = option(
        "host:port the scheduler dials; empty: <host>:<port> (the hostname when binding 0.0.0.0).", default="")
    nats_url: str = option("NATS server URL for events.", default="nats://127.0.0.1:4222", shared=True)
    tenant_partitions: str = option(
        "KV partitions per tenant, name=reserved:credit blocks, comma-separated (e.g. acme=32:16); "
        "requests are charged to their tenant's partition.", default="")
    credit_audit_period_s: float = option("Seconds between audits that decay a borrowing tenant's credit; "
                                          "0 disables.", default=2.0)
    serves_rung: str = option(
        "Degradation rung this executor's pool serves: none (full quality), kv_int8, kv_compress or "
        "smaller_model (a smaller checkpoint with the same tokenizer). Empty: derived from the KV flags "
        "(int8 -> kv_int8, a compress budget -> kv_compress, else none).", default="",
        choices=("", *POOL_RUNG_LABELS))
    heartbeat_interval_s: float = option("Seconds between membership heartbeats.", default=1.0)
    load_report_interval_s: float = option("Seconds between load reports.", default=0.25)
    engine_stall_s: float = option(
        "Seconds the engine thread may hold work without finishing a step before the executor counts it "
        "wedged, reports NOT_SERVING / FAILED, fails its streams (UNAVAILABLE) and exits for a restart "
        "(as it does at once when the thread dies); 0 disables the stall check.", default=60.0)
    cachestore_address: str = option(
        "host:port of the cachestore for KV offload / promotion; empty: no lower tiers.", default="")
    demote_on_finish: str = option("Which finished requests' blocks are written to the cachestore.",
                                   default="sessions", choices=("never", "sessions", "all"))
    demote_on_finish_min_held: float = option(
        "Write a finished request's blocks (demote_on_finish) only while running requests hold at least this "
        "fraction of the KV pool (pins count as room: they yield to live work); below it LRU keeps them through "
        "a pause and the write is CPU the steps need; 0: always.", default=0.5)
    first_token_yield_ms: float = option(
        "CPU engines: milliseconds the engine pauses after a step that gave an interactive request its first "
        "token, when at most two requests are unfinished, so the token crosses the scheduler and the router "
        "before the next decode step takes the cores they share (~1 ms off the mesh's TTFT on 2 cores; the "
        "reply ends later, so agent hops and batch work never ask for it); 0: never. Ignored on CUDA, where "
        "the device would idle.", default=1.5)
    promote_before_prefill: bool = option(
        "Load a prompt's prefix blocks from the cachestore before its prefill when cheaper than recompute.",
        default=True)

    def __post_init__(self) -> None:
        ServiceOptions.__post_init__(self)
        if not self.model_dir:
            raise ValueError("model_dir is required (--model-dir or WEFT_EXECUTOR_MODEL_DIR)")
        if not Path(self.model_dir).is_dir():
            raise ValueError(f"model_dir {self.model_dir!r} is not a directory")
        check_port("port", self.port)
        for name in ("heartbeat_interval_s", "load_report_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.demote_on_finish_min_held <= 1.0:
            raise ValueError(f"demote_on_finish_min_held must be in [0, 1], got {self.demote_on_finish_min_held}")
        if not 0.0 <= self.first_token_yield_ms <= 50.0:
            raise ValueError(f"first_token_yield_ms must be in [0, 50], got {self.first_token_yield_ms}")
        if self.engine_stall_s < 0:
            raise ValueError(f"engine_stall_s must be >= 0 (0 disables), got {self.engine_stall_s}")
        if self.name:
            subject("heartbeat", self.name)  # a subject-safe name, or ValueError
        if self.credit_audit_period_s < 0:
            raise ValueError(f"credit_audit_period_s must be >= 0, got {self.credit_audit_period_s}")
        self.partitions  # validates the partition table (raises ValueError)
        self.engine_config  # builds and validates the engine options (raises ValueError)

    @functools.cached_property
    def engine_config(self) -> EngineConfig:
        """The engine's options, exactly the ``EngineConfig`` fields of this config."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)})

    @property
    def first_token_yield_s(self) -> float:
        """The engine driver's first-token pause in seconds: 0 on a CUDA device."""
        return 0.0 if self.device.startswith("cuda") else self.first_token_yield_ms / 1000.0

    @property
    def resolved_serves_rung(self) -> str:
        """The degradation rung this executor's pool serves (see --serves-rung)."""
        if self.serves_rung:
            return self.serves_rung
        if self.kv_cache_dtype == "int8":
            return Rung.KV_INT8.label
        return (Rung.KV_COMPRESS if self.kv_compress_budget_blocks else Rung.NONE).label

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

"""Router settings: flags > ``WEFT_ROUTER_*`` / shared ``WEFT_*`` environment > defaults.

The options every service takes (``services/mesh/service_options.py``) are declared there;
the router adds its own and redeclares only what reads differently here: ``host`` (both
listeners bind it) and ``max_message_bytes`` (the scheduler channel's cap: the public
gRPC API's cap is ``max_body_bytes``, one cap for both public doors). The router's drain
flag keeps its name, ``--drain-timeout-s``; the shared ``--grace-s`` sets the same drain
when it is not given (``drain_s``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.mesh.env_config import option
from services.mesh.service_options import ServiceOptions, check_port
from services.router.tool_parsers import FORMATS


@dataclass(frozen=True)
class RouterConfig(ServiceOptions):
    host: str = option("address both listeners bind", default="127.0.0.1")
    max_message_bytes: int = option(
        "largest gRPC message sent to or received from the scheduler (the public gRPC API takes "
        "--max-body-bytes)", default=64 << 20)
    model_dir: str = option("checkpoint directory: tokenizer, chat template and context length come from it", default="")
    grpc_port: int = option("public gRPC API port (0 = pick a free one)", default=50051)
    http_port: int = option("OpenAI-compatible HTTP API port (0 = pick a free one)", default=8000)
    scheduler_address: str = option("host:port of the scheduler's gRPC API", default="127.0.0.1:50052")
    served_model_name: str = option("model id clients send; empty = the checkpoint directory's name", default="")
    keys_file: str = option("API keys file (JSON {key: tenant} or 'key tenant' lines); empty = no auth", default="")
    max_model_len: int | None = option("context length override; none = the checkpoint's max_position_embeddings", default=None)
    max_body_bytes: int = option(
        "largest accepted request on either public API: the HTTP body (larger: 413) and the gRPC message "
        "(larger: RESOURCE_EXHAUSTED); one cap so both doors take the same prompts", default=16 * 1024 * 1024)
    request_timeout_s: float = option("deadline of one generation, propagated downstream", default=600.0)
    http_idle_timeout_s: float = option(
        "an HTTP connection with no request in progress (none yet, or headers never finished) is closed after "
        "this long; aiohttp's own default held such a connection for an hour", default=75.0)
    body_read_timeout_s: float = option(
        "how long an HTTP request body may take to arrive (slower: 408 and the connection closed); a client "
        "that sends headers and then trickles or never finishes its body held a connection forever", default=30.0)
    cachestore_address: str = option(
        "host:port of the cachestore for the opt-in semantic response cache; empty disables it", default="")
    metrics_host: str = option(
        "address the Prometheus /metrics listener binds: loopback by default, since metrics carry per-tenant "
        "labels (the public HTTP port does not serve /metrics)", default="127.0.0.1")
    drain_timeout_s: float | None = option(
        "on SIGTERM, how long in-flight streams (HTTP and gRPC) may finish; none = --grace-s", default=None)
    tool_call_parser: str = option(
        "how tool calls are written and parsed: 'auto' (recognised from the chat template) or one of "
        "hermes, smollm2, llama3_json, mistral, pythonic (docs/tools.md)", default="auto")
    continuation_attempts: int = option(
        "times one stream is re-issued to the scheduler from prompt + tokens so far when the scheduler dies, "
        "restarts or stalls mid-stream (the client sees one stream); 0: such streams end UNAVAILABLE", default=3)
    continuation_wait_s: float = option(
        "how long one continuation waits for the scheduler to come back (jittered retries) before the stream "
        "ends UNAVAILABLE naming the tokens sent", default=10.0)
    continuation_min_stall_s: float = option(
        "no chunk for max(this, 20 x the stream's mean gap), none on any other stream, and no answer to a round "
        "of scheduler health probes: the scheduler is stalled and the stream is continued", default=2.0)
    continuation_probe_timeout_s: float = option(
        "how long the first health probe of a round may take; each next one waits --continuation-probe-backoff "
        "times longer (a slow answer is an answer)", default=1.0)
    continuation_probe_attempts: int = option(
        "health probes per round before a silent scheduler (no chunk on any stream) counts as stalled", default=3)
    continuation_probe_backoff: float = option(
        "each further probe of a round may take this many times longer than the last", default=2.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model_dir:
            raise ValueError("model_dir is required (--model-dir or WEFT_ROUTER_MODEL_DIR)")
        if not (Path(self.model_dir) / "tokenizer.json").is_file():
            raise ValueError(f"model_dir: no tokenizer.json in {self.model_dir}")
        for name in ("grpc_port", "http_port"):
            check_port(name, getattr(self, name))
        if ":" not in self.scheduler_address:
            raise ValueError(f"scheduler_address must be host:port, got {self.scheduler_address!r}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.keys_file and not Path(self.keys_file).is_file():
            raise ValueError(f"keys_file: {self.keys_file} does not exist")
        if self.tool_call_parser != "auto" and self.tool_call_parser not in FORMATS:
            raise ValueError(f"tool_call_parser must be 'auto' or one of {sorted(FORMATS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.continuation_attempts < 0:
            raise ValueError(f"continuation_attempts must be >= 0, got {self.continuation_attempts}")
        if self.continuation_wait_s < 0:
            raise ValueError(f"continuation_wait_s must be >= 0, got {self.continuation_wait_s}")
        if self.continuation_probe_attempts < 1:
            raise ValueError(f"continuation_probe_attempts must be >= 1, got {self.continuation_probe_attempts}")
        if self.continuation_probe_backoff < 1:
            raise ValueError(f"continuation_probe_backoff must be >= 1, got {self.continuation_probe_backoff}")
        if self.drain_timeout_s is not None and self.drain_timeout_s <= 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s}")
        for name in ("max_body_bytes", "request_timeout_s", "body_read_timeout_s", "http_idle_timeout_s",
                     "continuation_min_stall_s", "continuation_probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def drain_s(self) -> float:
        """How long in-flight streams may finish on SIGTERM: ``drain_timeout_s``, else ``grace_s``."""
        return self.grace_s if self.drain_timeout_s is None else self.drain_timeout_s

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name

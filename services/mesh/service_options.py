"""Options every Weft service takes, declared once.

Each service's config dataclass derives from ``ServiceOptions`` and adds only what is its
own; a service that needs another default for a shared option redeclares just that field
(dataclass inheritance keeps one field, the subclass's default). ``__post_init__`` here
validates the shared fields; a subclass calls it through ``super().__post_init__()``.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.mesh.env_config import option
from services.mesh.logging import LOG_FORMATS, LOG_LEVELS

MESH_SECRET_FILE_HELP = (
    "File holding the mesh shared secret (Docker secrets style, e.g. /run/secrets/weft_mesh); stripped; "
    "unreadable or empty is an error; empty: WEFT_MESH_SECRET, or no peer authentication.")


@dataclass(frozen=True)
class ServiceOptions:
    host: str = option("Address the gRPC server binds.", default="127.0.0.1")
    grace_s: float = option("On SIGTERM, seconds in-flight calls get to finish.", default=10.0)
    max_message_bytes: int = option("Largest gRPC message sent or received.", default=64 << 20)
    metrics_port: int = option("Port of the Prometheus /metrics endpoint; 0 disables it.", default=0)
    mesh_secret_file: str = option(MESH_SECRET_FILE_HELP, default="", shared=True)
    log_level: str = option("Log level.", default="info", choices=LOG_LEVELS, shared=True)
    log_format: str = option("Log format (auto: JSON unless stderr is a terminal).", default="auto",
                             choices=LOG_FORMATS, shared=True)

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be > 0, got {self.max_message_bytes}")


def check_port(name: str, port: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``port`` is in [0, 65535] (0: pick a free one)."""
    if not 0 <= port < 65536:
        raise ValueError(f"{name} must be in [0, 65535], got {port}")

"""``UpOptions``: what ``weft up`` (or a test, a benchmark) asks of the launcher, validated
here so a bad value names itself before anything starts."""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from weft.launcher.restart_policy import RestartConfig


@dataclass(frozen=True)
class UpOptions:
    # A checkpoint directory. None: the tiny random model, created under the state dir (tests,
    # benchmarks); `weft up` resolves --model (default: SmolLM2, weft/models/sources.py) before.
    model_dir: str | None = None
    num_executors: int = 1
    http_port: int = 8000  # 0: a free port
    grpc_port: int = 50051  # 0: a free port
    state_dir: Path = Path(".weft")
    host: str = "127.0.0.1"
    keys_file: str = ""
    settings_file: str = ""  # the live-settings document (docs/live_config.md); the router reads it
    log_level: str = "info"
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 15.0
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. WEFT_EXECUTOR_NUM_KV_BLOCKS
    # One more executor per entry, started with these flags appended to its command (they win
    # over the mesh's env): e.g. "--serves-rung kv_int8 --kv-cache-dtype int8", a degraded pool.
    extra_executors: tuple[str, ...] = ()
    restart: RestartConfig = RestartConfig()  # supervision of unplanned deaths (weft/launcher/restart_policy.py)
    # Services' settings by `weft up` flag dest (``{"policy": "fcfs", "num_kv_blocks": "128"}``),
    # handed only to the services that read them (weft/launcher/setting_flags.py); they win over
    # ``extra_env``. Validated here with the services' own parsers (loads torch when non-empty).
    settings: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_executors < 0:
            raise ValueError("num_executors must be >= 0")
        for flags in self.extra_executors:
            if not shlex.split(flags):
                raise ValueError("an extra executor needs at least one flag")
        for name in ("http_port", "grpc_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536)")
        if self.settings_file:
            from weft.launcher.setting_checks import check_settings_file

            check_settings_file(self.settings_file)
        if self.settings:
            from weft.launcher.setting_checks import check_settings

            check_settings(self.settings)

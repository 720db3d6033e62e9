"""Validate ``weft up``'s service settings with each service's own config parser, before
anything starts, so a bad value is one line naming the flag instead of a service that
exits during startup.

NOTE: every service that reads a setting builds its config dataclass from exactly the
variables ``weft up`` would hand it (``services/mesh/env_config.resolve``: the same parsing,
choices and ``__post_init__`` checks as the service at start). The settings the launcher
fills itself (the checkpoint directory) get a placeholder, so only the operator's values
can fail. The error names the flags whose fields the service's message mentions, else
every flag given to that service (a conflict between two of them). Importing the configs
loads torch: this runs when a mesh is about to start, never for ``--help``.
"""
from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

from weft.launcher.setting_flags import BY_DEST, SettingFlag, service_env, unknown_settings


def _config_class(service: str) -> type:
    if service == "scheduler":
        from services.scheduler.config import SchedulerConfig
        return SchedulerConfig
    if service == "executor":
        from services.executor.config import ExecutorConfig
        return ExecutorConfig
    if service == "cachestore":
        from services.cachestore.config import CacheStoreConfig
        return CacheStoreConfig
    if service == "router":
        from services.router.config import RouterConfig
        return RouterConfig
    raise ValueError(f"no config class for service {service!r}")


def check_settings(settings: Mapping[str, str]) -> None:
    """Raise ``ValueError`` whose message starts with the offending flag(s) unless every
    service accepts its share of ``settings`` (dest -> value text)."""
    unknown = unknown_settings(settings)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; known: {sorted(BY_DEST)}")
    for dest, value in settings.items():
        _check_text(BY_DEST[dest], value)
    from services.mesh.env_config import resolve

    with tempfile.TemporaryDirectory(prefix="weft-settings-") as placeholder:
        (Path(placeholder) / "tokenizer.json").write_text("{}")  # the router only checks it exists
        required = {"executor": {"WEFT_EXECUTOR_MODEL_DIR": placeholder},
                    "router": {"WEFT_ROUTER_MODEL_DIR": placeholder}}
        for service, env in sorted(service_env(settings).items()):
            try:
                resolve(_config_class(service), service, {}, {**required.get(service, {}), **env})
            except (ValueError, TypeError) as exc:
                given = [BY_DEST[d] for d in settings if service in BY_DEST[d].envs]
                raise ValueError(f"{_blame(given, service, str(exc))}: {exc}") from None


MAX_NUMBER = 2**63 - 1  # what an int64 field (protos, torch sizes) holds


def _check_text(f: SettingFlag, value: str) -> None:
    """What no service parser refuses but none can use: control characters (a NUL reached
    the environment of every process), and for a number-valued flag (its default is a
    number) NaN or infinity (``x < 0`` checks pass NaN: a NaN timeout or period) and
    integers past int64."""
    if not value.isprintable():
        raise ValueError(f"{f.flag}: must be printable text, got {value!r}")
    if f.flag == "--device":
        _check_device(value)
    if not (_is_number(f.default) or f.default == "none") or not _is_number(value):
        return
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{f.flag}: must be a finite number, got {value.strip()!r}")
    if abs(number) > MAX_NUMBER:
        raise ValueError(f"{f.flag}: must be at most {MAX_NUMBER}, got {value.strip()!r}")


def _check_device(value: str) -> None:
    """A torch device name ("cpu", "cuda", "cuda:1"): the executor parses it only once its
    process started, so "" or "gpu" took down every executor instead of failing here."""
    import torch

    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device: must be a torch device such as cpu, cuda or cuda:0, got {value!r}") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _blame(given: list[SettingFlag], service: str, message: str) -> str:
    """The flags among ``given`` that ``message`` names (by field or variable), else all of them."""
    named = [f for f in given
             if any(re.search(rf"\b{name}\b", message) for name in (*_fields(f, service), f.envs[service]))]
    return ", ".join(f.flag for f in (named or given))


def _fields(f: SettingFlag, service: str) -> list[str]:
    return [field for s, field in f.targets if s == service]


def check_settings_file(path: str) -> None:
    """``--settings FILE`` holds a valid live-settings document (docs/live_config.md); a
    ValueError naming the file and the field otherwise."""
    from services.router.live_settings import read_settings_file

    try:
        read_settings_file(path)
    except ValueError as exc:
        raise ValueError(f"--settings {path}: {exc}") from None

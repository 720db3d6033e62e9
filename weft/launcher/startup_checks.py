"""What ``weft up`` checks before it starts anything, and how it names a failure in one line.

Checked first because the failure modes they prevent are confusing: a router whose HTTP
port is taken by another process dies at start while the readiness probe is answered by
that other process (the mesh looked up, then stopped, exit 0); a missing ``--model`` made
a service print its whole usage text. Each check returns None when fine, else the one
line ``weft up`` prints.
"""
from __future__ import annotations

import json
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path


def check_model_dir(model_dir: str | None) -> str | None:
    """None (the built-in tiny model), or an existing directory whose small JSON files,
    where present, are readable JSON objects."""
    if model_dir is None:
        return None
    path = Path(model_dir)
    if not path.exists():
        return f"no such directory: {path} (--model)"
    if not path.is_dir():
        return f"not a directory: {path} (--model)"
    for name in _SMALL_JSON_FILES:  # a broken one made the router die with a bare JSONDecodeError
        problem = _json_object_error(path / name)
        if problem:
            return f"{path / name} {problem} (--model)"
    return None


# The checkpoint's small JSON files, read by several services; tokenizer.json is big and
# the router names it itself.
_SMALL_JSON_FILES = ("config.json", "tokenizer_config.json", "generation_config.json")


def _json_object_error(path: Path) -> str | None:
    """Why the file at ``path`` is not a readable JSON object, or None (also when absent)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except PermissionError:
        return "cannot be read: permission denied"
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot be read: {exc}"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"is not valid JSON: {exc}"
    return None if isinstance(value, dict) else "is not a JSON object"


def bind_error(host: str, port: int) -> OSError | None:
    """Why ``port`` cannot be listened on at ``host`` now, or None. SO_REUSEADDR as the
    services' servers use it: a port in TIME_WAIT is free, one with a listener is not."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc
    return None


def ports_free(host: str, ports: Iterable[int]) -> bool:
    return all(bind_error(host, p) is None for p in ports)


def check_ports_free(host: str, ports: Mapping[str, int]) -> str | None:
    """``ports``: flag -> port; 0 means "pick a free one" and is not checked."""
    for flag, port in ports.items():
        if port and (exc := bind_error(host, port)) is not None:
            cause = exc.strerror or str(exc)
            return f"port {port} ({flag}) on {host} is not available: {cause}; stop what uses it or pass {flag} 0"
    return None


# What an asyncio process prints while the interpreter tears down after a fatal error:
# never the cause, and it would hide the cause's line.
_NOISE_STARTS = ("Task was destroyed but it is pending!", "Exception ignored in")


def _without_shutdown_noise(lines: list[str]) -> list[str]:
    """``lines`` less a trailing run of interpreter shutdown noise (a later JSON record or a
    traceback of its own ends a run); unchanged when nothing would be left."""
    start = None
    for i, ln in enumerate(lines):
        if ln.startswith(_NOISE_STARTS):
            start = i if start is None else start
        elif start is not None and (ln.startswith("{") or (
                ln.startswith("Traceback") and not lines[i - 1].startswith("Exception ignored in"))):
            start = None  # something real came after the noise
    return lines[:start] if start else lines


def last_log_line(path: str | Path, max_chars: int = 300) -> str:
    """The last non-empty line of a service's log, as one short line: a JSON log record is
    shown as its event and error fields, else the raw text. Interpreter shutdown noise
    after the fatal error is skipped."""
    try:
        lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except FileNotFoundError:
        return "(no log)"
    if not lines:
        return "(empty log)"
    line = _without_shutdown_noise(lines)[-1]
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if isinstance(record, dict):
        fields = {k: v for k, v in record.items() if k not in ("timestamp", "level", "logger", "service")}
        line = " ".join(f"{k}={v}" for k, v in fields.items())
    return line if len(line) <= max_chars else line[: max_chars - 3] + "..."

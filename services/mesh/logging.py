"""structlog setup shared by every service.

JSON lines when stderr is not a terminal (containers, files, tests) or when
``WEFT_LOG_FORMAT=json``; coloured key/value output in a terminal. The request id is
bound through contextvars, so every log line inside a request carries it.
"""
from __future__ import annotations

import logging as stdlib_logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

LOG_FORMATS = ("auto", "json", "pretty")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _use_json(log_format: str) -> bool:
    if log_format == "auto":
        log_format = os.environ.get("WEFT_LOG_FORMAT", "auto")
    if log_format == "json":
        return True
    if log_format == "pretty":
        return False
    return not sys.stderr.isatty()


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write. structlog's loggers
    hold the file they were made with (and, cached on first use, keep it), so a stream
    bound once outlives a swap of ``sys.stderr``: in tests, the capture stream of the test
    that configured logging, closed when that test ends, and every later log line raised
    ``ValueError: I/O operation on closed file``."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _CurrentStderr()  # one object: structlog keeps one lock per file


def configure_logging(service: str, level: str = "info", log_format: str = "auto") -> None:
    """Configure structlog for this process. ``service`` is added to every line."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {LOG_LEVELS}, got {level!r}")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")

    def add_service(_logger, _name, event_dict):
        event_dict.setdefault("service", service)
        return event_dict

    json_output = _use_json(log_format)
    renderer = (
        structlog.processors.JSONRenderer()
        if json_output
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    processors = [
        structlog.contextvars.merge_contextvars,
        add_service,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if json_output:
        processors.append(structlog.processors.format_exc_info)
    processors.append(renderer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(stdlib_logging, level.upper())),
        logger_factory=structlog.WriteLoggerFactory(file=_STDERR),
        cache_logger_on_first_use=True,
    )


@contextmanager
def request_context(request_id: str, **fields) -> Iterator[None]:
    """Bind ``request_id`` (and any extra fields) to every log line in this context."""
    with structlog.contextvars.bound_contextvars(request_id=request_id, **fields):
        yield

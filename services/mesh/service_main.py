"""How a service process ends when its configuration cannot work.

A service whose model files cannot be loaded or whose NATS login is refused will fail the
same way on every restart, so it logs ONE line naming the cause and exits with
``EXIT_CONFIG`` (78, sysexits' EX_CONFIG). Supervisors read that status: ``weft up``
does not restart such an instance (``weft ps`` shows ``config-error``), where any other
death is restarted with a backoff. Everything else (bugs, an engine death: 70) keeps its
own status.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine

import structlog

EXIT_CONFIG = 78  # sysexits.h EX_CONFIG: a restart cannot help


def run_service(main: Callable[[], Coroutine], service: str, config_errors: tuple[type[BaseException], ...]) -> None:
    """``asyncio.run(main())``; an exception of ``config_errors`` (or NATS refusing the
    login) becomes one ``service_config_error`` line and exit status ``EXIT_CONFIG``."""
    from services.mesh.nats_auth import NatsLoginRefused

    try:
        asyncio.run(main())
    except (NatsLoginRefused, *config_errors) as exc:
        structlog.get_logger(__name__).error("service_config_error", service=service, error=str(exc),
                                             error_type=type(exc).__name__, exit_status=EXIT_CONFIG)
        print(f"{service}: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    exit_without_teardown(0)


def exit_without_teardown(status: int) -> None:
    """End a service whose ``main()`` has drained and closed everything it owns, skipping
    the interpreter's teardown: with torch, OpenMP and gRPC loaded that teardown is ~0.7–0.9 s
    of native finalisation after the last line of Python (py-spy: no Python frame left),
    paid on every stop, restart and scale-down. Nothing is lost by skipping it: each
    service's ``main()`` returns only after its servers stopped, its engine thread joined
    and its NATS connection closed; files are written through context managers; the
    default executor was shut down by ``asyncio.run``. Logs and stdio are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to keep
            pass
    os._exit(status)

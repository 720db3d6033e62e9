"""The constrained-decoding package, imported on first use rather than at engine import:
xgrammar pulls in transformers, ~1.1 s of an executor's ~3.2 s import. ``LLMEngine.grammars``
calls ``grammar_package`` for the first constrained request, and the executor warms it on a
daemon thread once it serves (services/executor/app.py)."""
from __future__ import annotations

import structlog

from services.executor.errors import InvalidRequestError

log = structlog.get_logger(__name__)

_grammar_import_error: str | None = None


def grammar_package():  # -> the services.executor.grammar module
    """``services.executor.grammar``, imported on first use (``LLMEngine.grammars``, or the
    executor's warm-up thread once it serves). A failed import (a missing or broken xgrammar
    wheel, its native library refusing to load) is remembered: Python would retry it, and
    every constrained request would re-run xgrammar's and transformers' imports (~1 s) on
    the engine thread. Each constrained request is then refused naming the cause, and
    unconstrained requests are served as before."""
    global _grammar_import_error
    if _grammar_import_error is None:
        try:
            import services.executor.grammar as package
            return package
        except Exception as e:  # noqa: BLE001 - ImportError, or OSError from a native library
            _grammar_import_error = f"this executor cannot constrain output: xgrammar did not load ({type(e).__name__}: {e})"
            log.error("grammar_import_failed", error=f"{type(e).__name__}: {e}")
    raise InvalidRequestError("grammar", _grammar_import_error)

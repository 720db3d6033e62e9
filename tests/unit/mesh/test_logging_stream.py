"""configure_logging writes to the stderr of the moment, not the one it was called under.

structlog's loggers keep the file they were made with (cached on first use), so binding
``sys.stderr`` at configure time made a swapped-out stream live on: under pytest, the
capture stream of whichever test configured logging, closed when that test ended, and
then any later log line (tests/unit/mesh/test_document_flood.py's inbox, run after
tests/unit/weft's in-process CLI calls) raised ``ValueError: I/O operation on closed file``.
"""
from __future__ import annotations

import io
import json
import sys

import pytest
import structlog

from services.mesh.logging import configure_logging


@pytest.fixture
def restore_structlog():
    saved = structlog.get_config()
    yield
    structlog.reset_defaults()
    structlog.configure(**saved)


def test_a_logger_made_under_one_stderr_writes_to_the_next_after_the_first_is_closed(monkeypatch, restore_structlog):
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("stream-test", log_format="json")
    log = structlog.get_logger("stream-test")  # a module-level proxy, cached on first use
    log.info("one")
    assert json.loads(first.getvalue())["event"] == "one"

    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    log.info("two", n=2)  # raised ValueError: I/O operation on closed file

    line = json.loads(second.getvalue())
    assert (line["event"], line["n"], line["service"]) == ("two", 2, "stream-test")

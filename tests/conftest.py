"""Test-session setup.

Triton: ``triton.jit`` decides when a kernel module is imported (at decoration) whether
its kernels are compiled or run by the interpreter, so without a CUDA device
TRITON_INTERPRET=1 has to be in the environment before any test module, in any
directory, imports ``kernels`` or the Triton attention back end.

structlog: tests that run a CLI or a service's ``main`` in-process call
``configure_logging``, which configures structlog for the whole process (level filter,
renderer, caching of loggers on first use). Left as they are, a later test's module
loggers keep that configuration: its ``capture_logs`` misses debug lines, or its log
lines go to a stream an earlier test closed. So every test starts from the session's
initial configuration, and loggers are never cached (a cached logger keeps the
configuration of the test that first used it, whatever is restored after).
"""
import os

import pytest
import structlog
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_configure = structlog.configure


def _configure_uncached(*args, **kwargs):
    kwargs["cache_logger_on_first_use"] = False
    return _configure(*args, **kwargs)


structlog.configure = _configure_uncached  # services.mesh.logging calls structlog.configure(...)
_INITIAL_STRUCTLOG = structlog.get_config()


@pytest.fixture(autouse=True)
def _fresh_structlog_config():
    yield
    if structlog.get_config() != _INITIAL_STRUCTLOG:
        structlog.reset_defaults()
        _configure(**_INITIAL_STRUCTLOG)

"""Hostile-client and unlucky-operator cases (issue 12): each test reproduces a fault found
by attacking a real mesh from outside and asserts the mesh now survives it. The fixtures
are the integration suite's (imported, not duplicated)."""
from tests.integration.conftest import tiny_model_dir  # noqa: F401  (a session fixture)

"""Chaos tests reuse the integration fixtures (imported, not duplicated)."""
from tests.integration.conftest import tiny_model_dir  # noqa: F401  (a session fixture)

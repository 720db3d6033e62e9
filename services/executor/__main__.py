"""``python -m services.executor --help``"""
from __future__ import annotations

from services.executor.process_env import apply_executor_env

apply_executor_env()  # OpenMP wait policy, bounded spin, huge pages: before torch loads (process_env.py)

from services.mesh.onednn_caches import bound_onednn_caches  # noqa: E402

bound_onednn_caches()  # per-shape kernel caches would otherwise grow RSS for hours (onednn_caches.py)

from services.executor.app import main  # noqa: E402
from services.executor.errors import ModelLoadError  # noqa: E402
from services.mesh.service_main import run_service  # noqa: E402

if __name__ == "__main__":
    run_service(main, "executor", config_errors=(ModelLoadError,))  # unloadable model: exit 78, not a restart

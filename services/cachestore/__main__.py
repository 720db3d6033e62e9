"""``python -m services.cachestore --help``"""
from __future__ import annotations

from services.mesh.onednn_caches import bound_onednn_caches

bound_onednn_caches()  # before torch loads (the embedder): bounded per-shape kernel caches

from services.cachestore.app import main  # noqa: E402
from services.mesh.service_main import run_service  # noqa: E402

if __name__ == "__main__":
    run_service(main, "cachestore", config_errors=())

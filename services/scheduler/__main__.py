"""``python -m services.scheduler --help``"""
from __future__ import annotations

from services.mesh.service_main import run_service
from services.scheduler.app import main

if __name__ == "__main__":
    run_service(main, "scheduler", config_errors=())

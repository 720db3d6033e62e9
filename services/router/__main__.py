"""``python -m services.router``: the public gRPC + OpenAI-compatible HTTP front door."""
from __future__ import annotations

import asyncio

from services.mesh.env_config import load_config
from services.mesh.logging import configure_logging
from services.mesh.service_main import exit_without_teardown
from services.router.config import RouterConfig


def main(argv: list[str] | None = None) -> None:
    config = load_config(RouterConfig, "router", "Weft router: public gRPC and OpenAI-compatible HTTP API.", argv)
    configure_logging("router", config.log_level, config.log_format)
    from services.router.app import RouterApp  # after config: --help stays fast

    async def run() -> None:
        await RouterApp(config).run()  # built inside the loop: gRPC objects bind to it

    asyncio.run(run())
    exit_without_teardown(0)  # drained and closed: skip the interpreter's teardown (service_main.py)


if __name__ == "__main__":
    main()

"""``python -m services.scheduler --help``"""
from __future__ import annotations

import asyncio

from services.scheduler.app import main

if __name__ == "__main__":
    asyncio.run(main())

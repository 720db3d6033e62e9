"""``python -m services.executor --help``"""
from __future__ import annotations

import asyncio

from services.executor.app import main

if __name__ == "__main__":
    asyncio.run(main())

"""``python -m services.cachestore --help``"""
from __future__ import annotations

import asyncio

from services.cachestore.app import main

if __name__ == "__main__":
    asyncio.run(main())

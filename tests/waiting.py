"""Helpers for tests that wait on something asynchronous: a condition (never a fixed sleep
as synchronisation) and a source that lets its items through one by one."""
from __future__ import annotations

import asyncio
import time


async def until(condition, what: str, deadline_s: float = 30.0) -> None:
    """Return once ``condition()`` holds; fail naming ``what`` after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)  # waiting on a condition, not for time to pass


class GatedSource:
    """Items released one by one: ``give(n)`` lets n more through; ``waiting`` is set
    whenever ``items()`` is blocked on the next one."""

    def __init__(self) -> None:
        self.allowed = 0
        self.changed = asyncio.Event()
        self.waiting = asyncio.Event()

    def give(self, n: int = 1) -> None:
        self.allowed += n
        self.changed.set()

    async def items(self):
        i = 0
        while True:
            while i >= self.allowed:
                self.changed.clear()
                self.waiting.set()
                await self.changed.wait()
            self.waiting.clear()
            yield i
            i += 1

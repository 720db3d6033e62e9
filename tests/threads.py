"""A call run on a daemon thread whose result or exception the test reads afterwards."""
from __future__ import annotations

import threading


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    """Start ``fn(*args)`` on a daemon thread; returns the thread and a dict that gets
    ``"value"`` (its result) or ``"error"`` (what it raised) when it ends."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - read by the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out

"""Stop strings, matched on text as it streams.

NOTE: a stop string may span several deltas ("###" arriving as "#", "##"), so text whose
tail could still grow into a stop string is held back until the next delta settles it.
On a match the text before the stop string is released and the rest discarded; the
caller then cancels the downstream stream.
"""
from __future__ import annotations

from services.router.text_holdback import partial_marker_suffix


class StopStringMatcher:
    """Per-request filter. Not thread-safe; one per stream."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Feed a delta; return the text that is now safe to release. After a match
        ``stopped`` is True and every later push returns ""."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)]
        keep = partial_marker_suffix(buf, self._stops)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The stream ended without a match: release what was held."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

"""First-token yield: a short idle pause of the engine thread (and so of its OpenMP threads)
after a step that gave a request that asked for it its first token, before the next step,
when at most ``MAX_UNFINISHED`` requests are unfinished.

NOTE: on a mesh whose services share the engine's cores, the first token still has to leave
the executor and cross the scheduler and the router, and the next decode step, started at
once, takes the CPU they need. Measured on 2 cores (docs/architecture.md, "first-token
yield"): a 1.5 ms pause took ~1 ms off the mesh's p50 TTFT, but the whole reply ended
0.5-2.7 ms later and ITL p50 rose 0.03-0.18 ms. So only a request whose promise is its first
token asks for it (the executor: the interactive class, ``server.wants_first_token_yield``);
an agent's hop waits for its whole reply. With more requests running the pause would delay
all of them, and their own tokens need the same relays, so it is skipped. A pause of 0 (the
driver's default) never pauses.

Engine thread only (``AsyncEngine`` calls it between steps); not thread-safe.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

MAX_UNFINISHED = 2  # unfinished requests at most for a pause
MAX_PAUSE_S = 0.05


class FirstTokenYield:
    """Which requests are still owed the yield, and whether a step's outputs call for it."""

    def __init__(self, pause_s: float = 0.0) -> None:
        if not 0.0 <= pause_s <= MAX_PAUSE_S:
            raise ValueError(f"first_token_yield_s must be in [0, {MAX_PAUSE_S}], got {pause_s}")
        self.pause_s = pause_s
        self.num_pauses = 0  # pauses taken (tests read it)
        self._owed: set[str] = set()  # requests that asked, before their first token (or end)

    def admit(self, request_id: str, asked: bool) -> None:
        """A request the engine accepted; ``asked``: it wants the pause after its first token."""
        if asked and self.pause_s:
            self._owed.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request left (aborted, dropped): it is owed nothing."""
        self._owed.discard(request_id)

    def due(self, outputs: Iterable, num_unfinished: int) -> bool:
        """Whether this step gave a request that asked and goes on its first token, with few
        enough requests unfinished that pausing for it delays almost nobody. A request is
        judged at its first token (or its end) only, and then forgotten."""
        owed = [out for out in outputs if out.request_id in self._owed and (out.new_token_ids or out.finished)]
        for out in owed:
            self._owed.discard(out.request_id)
        if not owed or num_unfinished > MAX_UNFINISHED:
            return False
        return any(out.new_token_ids and not out.finished and out.num_output_tokens == len(out.new_token_ids)
                   for out in owed)

    def after_step(self, outputs: Iterable, num_unfinished: int, wait: Callable[[float], object]) -> None:
        """Pause with ``wait(seconds)`` when the step calls for it (``due``)."""
        if self.pause_s and self.due(outputs, num_unfinished):
            self.num_pauses += 1
            wait(self.pause_s)

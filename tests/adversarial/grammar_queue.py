"""What the grammar compile-queue attacks share (test_grammar_compile_queue_*): a small
cache, compiles held until released, and the checks that nothing is left running."""
from __future__ import annotations

import threading

from services.executor.engine.sampling_params import GrammarSpec
from services.executor.grammar import GrammarCache, GrammarLimits

LONG = 60.0  # a deadline no test reaches: only what the test releases finishes
GUARD = 20.0  # wait_for's failure guard


def small_cache(info, timeout_s: float = LONG, threads: int = 2) -> GrammarCache:
    return GrammarCache(info, GrammarLimits(compile_timeout_s=timeout_s, compile_threads=threads))


class Holds:
    """``_compile_now`` patched: a text listed in ``held`` compiles only once its event is
    set; ``raising`` maps a text to the exception its compile raises; ``started`` lists every
    compile's text in start order."""

    def __init__(self, cache: GrammarCache, monkeypatch, held=(), raising=None) -> None:
        self.events = {text: threading.Event() for text in held}
        self.raising = dict(raising or {})
        self.started: list[str] = []
        real = cache._compile_now

        def compile_now(spec):
            self.started.append(spec.text)
            event = self.events.get(spec.text)
            if event is not None:
                event.wait()
            if spec.text in self.raising:
                raise self.raising[spec.text]
            return real(spec)

        monkeypatch.setattr(cache, "_compile_now", compile_now)

    def release(self, *texts: str) -> None:
        for text in texts or list(self.events):
            self.events[text].set()


def done(out: dict) -> bool:
    return "value" in out or "error" in out


def regex(i: int) -> GrammarSpec:
    return GrammarSpec("regex", f"x{i}[0-9]+")


def idle(cache: GrammarCache) -> bool:
    return not cache.workers and cache._waiting == 0 and not cache._inflight


def join_all(threads, what: str) -> None:
    for t in threads:
        t.join(GUARD)
        assert not t.is_alive(), f"{what} still running"

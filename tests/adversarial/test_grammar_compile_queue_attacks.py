"""Hostile clients and unlucky operators against the grammar compile queue (commit 83810dd):
a new grammar that finds every compiler busy now waits for one (up to its own
compile_timeout_s) instead of being refused at once; it is refused as busy (CapacityError,
RESOURCE_EXHAUSTED, never remembered) only when every worker is stuck past its deadline,
MAX_WAITING compiles already wait, or its wait runs out.

Compiles are held with events (``_compile_now`` patched, as in the unit tests) and every
step is synchronised on observable state (cache.workers, cache._waiting, finished threads)
with ``wait_for``; nothing here depends on how long a real compile takes."""
from __future__ import annotations

import contextlib
import gc
import threading
import types
import weakref

import pytest

from services.executor.engine.sampling_params import GrammarSpec
from services.executor.errors import CapacityError, InvalidRequestError
from services.executor.grammar import compiler, load_tokenizer_info
from services.executor.model.config import ModelConfig
from tests.integration.conftest import wait_for
from tests.adversarial.grammar_queue import GUARD, Holds, done, idle, join_all, regex, small_cache
from tests.threads import in_thread as _in_thread
from weft.testing.tiny_model import make_tiny_checkpoint

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


@pytest.fixture(scope="module")
def info(checkpoint):
    config = ModelConfig.from_dir(checkpoint)
    return load_tokenizer_info(checkpoint, config.vocab_size, config.eos_token_ids)


# -- a flood of distinct grammars ----------------------------------------------------------
def test_more_distinct_grammars_than_max_waiting_are_refused_at_once_and_the_rest_are_all_served(
        info, monkeypatch):
    cache = small_cache(info)
    held = [GrammarSpec("regex", "held-a[0-9]"), GrammarSpec("regex", "held-b[0-9]")]
    holds = Holds(cache, monkeypatch, held=[s.text for s in held])
    holders = [_in_thread(cache.get, s) for s in held]
    wait_for(lambda: len(cache.workers) == 2, GUARD, "both compilers held")
    waiters = [_in_thread(cache.get, regex(i)) for i in range(compiler.MAX_WAITING)]
    wait_for(lambda: cache._waiting == compiler.MAX_WAITING, GUARD, "a full queue of waiters")
    extras = [_in_thread(cache.get, regex(100 + i)) for i in range(3)]
    # refused while the two compiles are still held (so without waiting for a worker)
    wait_for(lambda: all(done(out) for _, out in extras), GUARD, "the extra grammars refused")
    assert len(cache.workers) == 2 and cache._waiting == compiler.MAX_WAITING
    for _, out in extras:
        assert isinstance(out.get("error"), CapacityError), out
        assert "busy" in str(out["error"])
    holds.release()
    join_all([t for t, _ in holders + waiters], "a held or waiting compile")
    for _, out in holders + waiters:
        assert "error" not in out, out
        assert out["value"] is not None
    assert cache.num_compiles == 2 + compiler.MAX_WAITING
    assert idle(cache)
    # the refused ones were not remembered: each compiles now
    for i in range(3):
        assert cache.get(regex(100 + i)) is not None
    assert cache.num_compiles == 2 + compiler.MAX_WAITING + 3
    cache.close()


def test_waiters_for_one_grammar_join_the_compile_that_one_of_them_starts(info, monkeypatch):
    cache = small_cache(info, threads=1)
    blocker, shared = GrammarSpec("regex", "blocker[0-9]"), GrammarSpec("regex", "shared[a-z]+")
    holds = Holds(cache, monkeypatch, held=[blocker.text, shared.text])
    first, _ = _in_thread(cache.get, blocker)
    wait_for(lambda: len(cache.workers) == 1, GUARD, "the only compiler held")
    same = [_in_thread(cache.get, shared) for _ in range(5)]
    wait_for(lambda: cache._waiting == 5, GUARD, "five requests for one grammar waiting")
    holds.release(blocker.text)
    # one of them takes the freed worker; the other four join its compile (still held)
    wait_for(lambda: cache._waiting == 0 and shared.text in holds.started, GUARD, "the waiters leaving the queue")
    assert holds.started.count(shared.text) == 1
    assert list(cache._inflight) == [("regex", shared.text)] and len(cache.workers) == 1
    holds.release(shared.text)
    join_all([first] + [t for t, _ in same], "a request")
    values = [out.get("value") for _, out in same]
    assert values[0] is not None and all(v is values[0] for v in values), [out for _, out in same]
    assert cache.num_compiles == 2 and idle(cache)
    cache.close()


# -- hung and failing compiles ------------------------------------------------------------
def test_one_hung_compile_does_not_stop_new_grammars_flowing_through_the_other_worker(info, monkeypatch):
    cache = small_cache(info)
    hung = GrammarSpec("regex", "hung[0-9]+")
    holds = Holds(cache, monkeypatch, held=[hung.text])
    hung_thread, hung_out = _in_thread(cache.get, hung)
    wait_for(lambda: len(cache.workers) == 1, GUARD, "the hung compile holding a worker")
    fast = [_in_thread(cache.get, regex(i)) for i in range(8)]  # more than one worker at once
    join_all([t for t, _ in fast], "a fast grammar")
    for _, out in fast:
        assert out.get("value") is not None, out
    assert not done(hung_out) and len(cache.workers) == 1  # still hung, the rest were served
    holds.release()
    join_all([hung_thread], "the hung compile")
    assert hung_out.get("value") is not None
    assert cache.num_compiles == 9 and idle(cache)
    cache.close()


def test_when_every_worker_is_stuck_past_its_deadline_a_new_grammar_is_refused_and_not_remembered(
        info, monkeypatch):
    cache = small_cache(info, timeout_s=0.3)
    hung = [GrammarSpec("regex", "hung-a[0-9]"), GrammarSpec("regex", "hung-b[0-9]")]
    holds = Holds(cache, monkeypatch, held=[s.text for s in hung])
    callers = [_in_thread(cache.get, s) for s in hung]
    join_all([t for t, _ in callers], "a hung compile's caller")  # each gives up at its deadline
    for _, out in callers:
        assert isinstance(out.get("error"), InvalidRequestError) and "did not compile within" in str(out["error"])
    assert len(cache.workers) == 2  # the compiles themselves still hold both workers
    fresh = GrammarSpec("regex", "fresh[0-9]+")
    with pytest.raises(CapacityError, match=r"^grammar\.regex: the grammar compilers are busy"):
        cache.get(fresh)
    assert cache._waiting == 0
    holds.release()
    wait_for(lambda: idle(cache), GUARD, "the stuck workers leaving")
    assert cache.get(fresh) is not None  # the busy refusal was not remembered
    compiles = cache.num_compiles
    for s in hung:  # the timed-out ones were: refused again without a compile
        with pytest.raises(InvalidRequestError, match="did not compile within"):
            cache.get(s)
    assert cache.num_compiles == compiles
    cache.close()


def test_waiters_whose_wait_runs_out_leave_no_trace_and_are_not_remembered(info, monkeypatch):
    cache = small_cache(info, timeout_s=0.3, threads=1)
    blocker = GrammarSpec("regex", "blocker[0-9]")
    holds = Holds(cache, monkeypatch, held=[blocker.text])
    first, first_out = _in_thread(cache.get, blocker)
    wait_for(lambda: len(cache.workers) == 1, GUARD, "the only compiler held")
    waiters = [_in_thread(cache.get, regex(i)) for i in range(5)]
    join_all([t for t, _ in waiters], "a waiter")
    for _, out in waiters:
        assert isinstance(out.get("error"), CapacityError), out
    assert cache._waiting == 0 and len(cache.workers) == 1
    holds.release()
    join_all([first], "the blocker's caller")
    wait_for(lambda: idle(cache), GUARD, "the blocker's worker leaving")
    for i in range(5):
        assert cache.get(regex(i)) is not None
    assert cache.num_compiles == 6
    cache.close()


def test_a_compile_that_raises_frees_its_worker_for_the_waiters_and_nothing_leaks(info, monkeypatch):
    cache = small_cache(info, threads=1)
    bad, odd = GrammarSpec("regex", "raises[0-9]"), GrammarSpec("regex", "oom[0-9]")
    holds = Holds(cache, monkeypatch, held=[bad.text, odd.text],
                   raising={bad.text: RuntimeError("[12:00:00] /x/y.cc:1: boom"), odd.text: MemoryError()})
    bad_thread, bad_out = _in_thread(cache.get, bad)
    wait_for(lambda: len(cache.workers) == 1, GUARD, "the failing compile holding the only worker")
    waiters = [_in_thread(cache.get, regex(i)) for i in range(3)]
    wait_for(lambda: cache._waiting == 3, GUARD, "three grammars waiting")
    holds.release(bad.text)
    join_all([bad_thread] + [t for t, _ in waiters], "a request")
    assert isinstance(bad_out.get("error"), InvalidRequestError)
    assert str(bad_out["error"]) == "grammar.regex: boom"  # xgrammar's prefix stripped
    for _, out in waiters:
        assert out.get("value") is not None, out
    assert idle(cache)
    # an unexpected error type (not a grammar fault) reaches the caller, frees the worker, is not remembered
    odd_thread, odd_out = _in_thread(cache.get, odd)
    wait_for(lambda: len(cache.workers) == 1, GUARD, "the odd compile holding the worker")
    holds.release(odd.text)
    join_all([odd_thread], "the odd compile")
    assert isinstance(odd_out.get("error"), MemoryError)
    assert idle(cache) and ("regex", odd.text) not in cache._entries
    cache.close()


# -- invalid grammars among waiters -------------------------------------------------------
def test_an_invalid_grammar_that_waited_for_a_worker_is_still_invalid_argument_and_remembered(info, monkeypatch):
    cache = small_cache(info, threads=1)
    blocker, bad, good = (GrammarSpec("regex", "blocker[0-9]"), GrammarSpec("regex", "([a-"),
                          GrammarSpec("regex", "good[0-9]"))
    holds = Holds(cache, monkeypatch, held=[blocker.text])
    first, _ = _in_thread(cache.get, blocker)
    wait_for(lambda: len(cache.workers) == 1, GUARD, "the only compiler held")
    bad_thread, bad_out = _in_thread(cache.get, bad)
    good_thread, good_out = _in_thread(cache.get, good)
    wait_for(lambda: cache._waiting == 2, GUARD, "the bad and the good grammar waiting")
    holds.release()
    join_all([first, bad_thread, good_thread], "a request")
    err = bad_out.get("error")
    assert isinstance(err, InvalidRequestError) and not isinstance(err, CapacityError), bad_out
    assert err.field == "grammar.regex"
    assert good_out.get("value") is not None
    compiles = cache.num_compiles
    with pytest.raises(InvalidRequestError):
        cache.get(bad)
    assert cache.num_compiles == compiles and idle(cache)
    cache.close()


@pytest.mark.parametrize("spec", [
    GrammarSpec("regex", "a" * (64 * 1024 + 1)),  # over max_grammar_bytes
    GrammarSpec("json_schema", "{not json"),
    GrammarSpec("json_schema", '{"type": "object", "properties": {"p": {"type": "string", '
                               '"pattern": "([a-z]{1,30}){1,30}"}}}'),  # pattern_cost bomb
], ids=["oversize", "malformed-json", "pattern-bomb"])
def test_a_grammar_refused_before_compiling_is_refused_at_once_even_with_every_worker_busy(
        info, monkeypatch, spec):
    cache = small_cache(info, threads=1)
    blocker = GrammarSpec("regex", "blocker[0-9]")
    holds = Holds(cache, monkeypatch, held=[blocker.text])
    first, _ = _in_thread(cache.get, blocker)
    wait_for(lambda: len(cache.workers) == 1, GUARD, "the only compiler held")
    t, out = _in_thread(cache.get, spec)
    wait_for(lambda: done(out), GUARD, "the refusal")  # while the worker is still held (60 s deadline)
    assert len(cache.workers) == 1 and cache._waiting == 0
    err = out.get("error")
    assert isinstance(err, InvalidRequestError) and err.field == f"grammar.{spec.kind}", out
    holds.release()
    join_all([first, t], "a request")
    assert holds.started == [blocker.text] and idle(cache)
    cache.close()


# -- bugs this attack found (each fixed in compiler.py / async_engine.py) --------------------------------------------------------------
# Found by this attack, fixed since: compiler.py registers the worker in `workers` and its Future
# in `_inflight` under the lock, then calls worker.start() outside any try: when the thread cannot
# start (RuntimeError "can't start new thread": a pids/threads limit, memory) both entries stay
# forever. The slot is lost for good (with compile_threads workers lost so, every later grammar is
# refused as busy), and the same grammar sent again joins a Future nobody completes, times out and
# is remembered as 'did not compile within', a valid grammar cached as invalid.
def test_a_compile_whose_worker_thread_cannot_start_does_not_hold_a_worker_forever(info, monkeypatch):
    cache = small_cache(info, timeout_s=2.0, threads=1)

    class NoThread(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    broken = types.SimpleNamespace(Thread=NoThread, current_thread=threading.current_thread)
    monkeypatch.setattr(compiler, "threading", broken)
    spec = GrammarSpec("regex", "x[0-9]+")
    with pytest.raises(CapacityError, match=r"^grammar.regex: no compile thread could start"):
        cache.get(spec)
    monkeypatch.setattr(compiler, "threading", threading)
    assert not cache.workers and not cache._inflight, (cache.workers, cache._inflight)
    assert cache.get(spec) is not None  # the thread limit passed: the grammar compiles
    cache.close()


# Found by this attack, fixed since: GrammarCache.get re-raises the one remembered
# InvalidRequestError instance (`raise hit`); every raise prepends the raising frames to its
# __traceback__, so the cached exception keeps every caller's frame, and all their locals
# (prompts, params, contexts), alive for as long as the entry lives. A client repeating one bad
# grammar grows the executor's memory without bound.
def test_repeating_a_remembered_bad_grammar_does_not_keep_each_callers_frame_alive(info):
    cache = small_cache(info)
    bad = GrammarSpec("regex", "([a-")
    with pytest.raises(InvalidRequestError):
        cache.get(bad)

    class Payload:  # stands for a request's prompt / params held by the calling frame
        pass

    def one_request() -> weakref.ref:
        payload = Payload()
        with contextlib.suppress(InvalidRequestError):
            cache.get(bad)
        return weakref.ref(payload)

    refs = [one_request() for _ in range(50)]
    gc.collect()
    alive = sum(r() is not None for r in refs)
    depth, tb = 0, cache._entries[("regex", bad.text)].__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    assert alive == 0, f"{alive} of 50 callers' frames kept alive by the cached error (traceback depth {depth})"
    cache.close()


# Found by this attack, fixed since: A waiter that wakes after its grammar was compiled (and
# remembered) by another request does not look at the cache: the wait loop in _compiling checks
# only `_inflight` and then starts a second compile of a grammar the cache already holds (or
# already knows to be invalid / too slow, so a hostile grammar gets a second worker for its full
# run). Every worker leaving wakes all waiters at once (notify_all), so a waiter late to reacquire
# the lock behind up to MAX_WAITING others and the GIL is the ordinary case, simulated here by
# holding one waiter between its wake-up and its recheck.
def test_a_waiter_whose_grammar_was_compiled_meanwhile_uses_the_cached_result(info, monkeypatch):
    cache = small_cache(info, threads=1)
    blocker, target = GrammarSpec("regex", "blocker[0-9]"), GrammarSpec("regex", "target[0-9]+")
    holds = Holds(cache, monkeypatch, held=[blocker.text])
    woken, gate = threading.Event(), threading.Event()
    victim: list[threading.Thread] = []
    real = cache._freed

    class LateWake:  # the victim waiter is scheduled late after its wake-up (lock released meanwhile)
        def wait(self, timeout=None):
            result = real.wait(timeout)
            if victim and threading.current_thread() is victim[0] and not woken.is_set():
                woken.set()
                real.release()
                gate.wait(GUARD)
                real.acquire()
            return result

        def notify_all(self):
            real.notify_all()

    monkeypatch.setattr(cache, "_freed", LateWake())
    first, _ = _in_thread(cache.get, blocker)
    wait_for(lambda: len(cache.workers) == 1, GUARD, "the only compiler held")
    late, late_out = _in_thread(cache.get, target)
    victim.append(late)
    wait_for(lambda: cache._waiting == 1, GUARD, "the victim waiting")
    holds.release()
    wait_for(woken.is_set, GUARD, "the victim woken by the worker leaving")
    join_all([first], "the blocker's caller")
    compiled = cache.get(target)  # another request gets the free worker and compiles it
    assert cache.num_compiles == 2
    gate.set()
    join_all([late], "the victim")
    assert late_out.get("value") is compiled, late_out
    assert cache.num_compiles == 2, "the waiter compiled an already cached grammar again"
    cache.close()

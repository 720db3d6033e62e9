"""The engine watchdog (services/executor/engine/watchdog.py): the pure policy with a fake
clock, the hook firing once, and the probes a real AsyncEngine gives when its thread dies
or is held inside a step's work."""
from __future__ import annotations

import asyncio
import threading

import pytest

from services.executor.engine.async_engine import AsyncEngine, EngineDeadError
from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.engine.watchdog import EngineProbe, EngineVerdict, EngineWatchdog, WatchdogPolicy
from services.executor.engine.sampling_params import SamplingParams
from weft.testing.tiny_model import make_tiny_checkpoint

DEADLINE_S = 20.0
STALL_S = 60.0
BUSY = EngineProbe(thread_alive=True, stopping=False, idle=False, last_progress_s=100.0)


@pytest.mark.parametrize("probe, now_s, verdict", [
    (BUSY, 100.0 + STALL_S - 0.001, EngineVerdict.OK),  # busy, progress just inside the window
    (BUSY, 100.0 + STALL_S, EngineVerdict.WEDGED),  # busy and silent for stall_s
    (EngineProbe(True, False, True, 100.0), 100.0 + 10 * STALL_S, EngineVerdict.OK),  # idle for long: fine
    (EngineProbe(False, False, True, 100.0), 100.0, EngineVerdict.DEAD),  # ended without a shutdown
    (EngineProbe(False, True, False, 100.0), 100.0 + 10 * STALL_S, EngineVerdict.OK),  # a planned shutdown
])
def test_policy_verdicts_with_a_fake_clock(probe, now_s, verdict):
    assert WatchdogPolicy(STALL_S).decide(probe, now_s) is verdict


def test_a_zero_stall_disables_the_wedge_check_but_not_the_death_check():
    policy = WatchdogPolicy(0.0)
    assert policy.decide(BUSY, 1e9) is EngineVerdict.OK
    assert policy.decide(EngineProbe(False, False, False, 0.0), 0.0) is EngineVerdict.DEAD


def test_a_negative_stall_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="engine_stall_s"):
        WatchdogPolicy(-1.0)


def test_the_failure_hook_fires_once_with_the_stalled_time():
    now = [100.0]
    fired: list[tuple[EngineVerdict, float]] = []

    async def on_failure(verdict, stalled_s):
        fired.append((verdict, stalled_s))

    dog = EngineWatchdog(lambda: BUSY, WatchdogPolicy(STALL_S), on_failure, clock=lambda: now[0])

    async def main():
        assert await dog.check_once() is EngineVerdict.OK
        now[0] = 100.0 + STALL_S + 5
        assert await dog.check_once() is EngineVerdict.WEDGED
        now[0] += 100
        assert await dog.check_once() is EngineVerdict.WEDGED

    asyncio.run(main())
    assert fired == [(EngineVerdict.WEDGED, STALL_S + 5)]


# -- probes of a real engine thread -------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


@pytest.fixture
def ae(checkpoint):
    engine = AsyncEngine(LLMEngine(checkpoint, EngineConfig(num_kv_blocks=64)))
    yield engine
    engine.shutdown(timeout_s=5.0)


def test_an_idle_engine_is_never_wedged_and_a_shut_down_one_is_not_dead(ae):
    policy = WatchdogPolicy(STALL_S)
    probe = ae.probe()
    assert policy.decide(probe, probe.last_progress_s + 10 * STALL_S) is EngineVerdict.OK
    ae.shutdown(timeout_s=DEADLINE_S)
    assert policy.decide(ae.probe(), 0.0) is EngineVerdict.OK


def test_a_thread_held_with_a_request_waiting_reads_as_wedged_once_the_stall_passes(ae):
    held, release = threading.Event(), threading.Event()
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    def hold(engine):
        held.set()
        release.wait(DEADLINE_S)

    async def main():
        pending = asyncio.ensure_future(ae.call(hold))
        assert await asyncio.to_thread(held.wait, DEADLINE_S)
        stream = ae.generate("waiting", [3, 4, 5, 6], long)
        first = asyncio.ensure_future(stream.__anext__())  # its add waits behind the held thread
        await asyncio.sleep(0)
        probe = ae.probe()
        release.set()
        await asyncio.wait_for(pending, DEADLINE_S)
        await asyncio.wait_for(first, DEADLINE_S)  # released, the engine serves it
        await stream.aclose()
        return probe

    probe = asyncio.run(main())
    policy = WatchdogPolicy(STALL_S)
    assert not probe.idle and probe.thread_alive
    assert policy.decide(probe, probe.last_progress_s + STALL_S) is EngineVerdict.WEDGED
    assert policy.decide(probe, probe.last_progress_s + 1.0) is EngineVerdict.OK


def test_a_thread_ended_by_a_base_exception_reads_as_dead_and_answers_callers(ae):
    def escape(engine):
        raise SystemExit("injected: escapes any except Exception")

    async def main():
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(ae.call(escape), DEADLINE_S)
        await asyncio.to_thread(ae._thread.join, DEADLINE_S)
        with pytest.raises(EngineDeadError):  # later callers are refused, never left waiting
            await asyncio.wait_for(ae.call(lambda e: e.num_steps), DEADLINE_S)

    asyncio.run(main())
    probe = ae.probe()
    assert WatchdogPolicy(STALL_S).decide(probe, probe.last_progress_s) is EngineVerdict.DEAD

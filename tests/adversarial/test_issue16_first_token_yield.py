"""Attacks on the executor's first-token yield (async_engine.py's NOTE, commit 2382801):
bad values of WEFT_EXECUTOR_FIRST_TOKEN_YIELD_MS through the real config loader, a caller
that leaves at its first token, a shutdown while the engine thread is inside the pause,
more than two requests at once, and prompt logprobs through a pausing engine.

Every wait is on a condition with a deadline; no assertion reads a clock."""
from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from services.executor.config import DESCRIPTION, ExecutorConfig
from services.executor.engine.async_engine import AsyncEngine, EngineDeadError, _Add
from services.executor.engine.first_token_yield import MAX_UNFINISHED as FIRST_TOKEN_YIELD_MAX_REQUESTS
from services.executor.engine.sampling_params import SamplingParams
from services.mesh.env_config import load_config
from tests.unit.executor.test_async_engine import (  # noqa: F401  (fixtures)
    NUM_KV_BLOCKS, PROMPTS, _collect, checkpoint, make_async_engine,
)

DEADLINE_S = 30.0
ENV = "WEFT_EXECUTOR_FIRST_TOKEN_YIELD_MS"


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _load(tmp_path, environ: dict[str, str], *flags: str) -> ExecutorConfig:
    return load_config(ExecutorConfig, "executor", DESCRIPTION, ["--model-dir", str(tmp_path), *flags], environ)


# -- the option through the real loader (flag > env > default; usage error, exit 2) ------------

@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "1e400", "-1e400", "abc", "", " ", "0x10",
                                  "1.5ms", "-0.001", "50.0001", "51"])
def test_a_bad_environment_value_is_a_usage_error_naming_the_option(tmp_path, capsys, text):
    with pytest.raises(SystemExit) as exit_:
        _load(tmp_path, {ENV: text})
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "first_token_yield" in err.lower(), err
    assert "Traceback" not in err


@pytest.mark.parametrize("text", ["nan", "inf", "1e400", "abc", "-1"])
def test_a_bad_flag_value_is_a_usage_error_naming_the_option(tmp_path, capsys, text):
    with pytest.raises(SystemExit) as exit_:
        _load(tmp_path, {}, "--first-token-yield-ms", text)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "first-token-yield-ms" in err or "first_token_yield_ms" in err, err


@pytest.mark.parametrize("text, seconds", [("-0", 0.0), ("-0.0", 0.0), ("1e-400", 0.0), ("0", 0.0),
                                           (" 2 ", 0.002), ("50", 0.05), ("1_0", 0.01), ("1.5", 0.0015)])
def test_edge_values_the_loader_accepts_give_a_pause_the_driver_accepts(tmp_path, text, seconds):
    config = _load(tmp_path, {ENV: text})
    assert math.isfinite(config.first_token_yield_s)
    assert config.first_token_yield_s == pytest.approx(seconds)
    if seconds == 0.0:
        assert not config.first_token_yield_s  # -0.0 too: the driver never pauses
    # the driver's own range check agrees with the loader's on every value it let through
    assert 0.0 <= config.first_token_yield_s <= 0.05


def test_the_flag_wins_over_a_bad_environment_value_and_cuda_ignores_the_option(tmp_path):
    assert _load(tmp_path, {ENV: "nan"}, "--first-token-yield-ms", "3").first_token_yield_s == pytest.approx(0.003)
    assert _load(tmp_path, {ENV: "50", "WEFT_EXECUTOR_DEVICE": "cuda:1"}).first_token_yield_s == 0.0


def test_minus_zero_through_a_real_engine_never_pauses(tmp_path, make_async_engine):
    ae = make_async_engine(first_token_yield_s=_load(tmp_path, {ENV: "-0"}).first_token_yield_s)
    tokens = asyncio.run(asyncio.wait_for(_collect(ae, "z", PROMPTS[0], _greedy(4)), DEADLINE_S))
    assert len(tokens) == 4
    assert ae.num_first_token_yields == 0


# -- a caller that leaves at its first token ---------------------------------------------------

async def _num_requests(ae: AsyncEngine) -> int:
    # A _Call is applied between steps, so it also waits for any pause in progress.
    return await asyncio.wait_for(ae.call(lambda e: len(e.requests)), DEADLINE_S)


async def _all_blocks_free(ae: AsyncEngine) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if await asyncio.wait_for(ae.call(lambda e: e.pool.num_free_blocks), DEADLINE_S) == NUM_KV_BLOCKS:
            return True
    return False


def test_a_caller_that_hangs_up_at_its_first_token_is_aborted_and_the_engine_serves_on(make_async_engine):
    ae, plain = make_async_engine(first_token_yield_s=0.05), make_async_engine()

    async def main():
        stream = ae.generate("gone", PROMPTS[0], _greedy(500))
        async for out in stream:
            assert len(out.new_token_ids) == 1
            break  # hang up right at the first token, while the engine is (likely) in its pause
        await stream.aclose()
        assert await _all_blocks_free(ae)
        assert await _num_requests(ae) == 0 and ae.num_active == 0
        after = await _collect(ae, "next", PROMPTS[1], _greedy(5))
        expected = await _collect(plain, "ref", PROMPTS[1], _greedy(5))
        return after, expected

    after, expected = asyncio.run(asyncio.wait_for(main(), DEADLINE_S * 2))
    assert after == expected
    assert ae.is_alive
    assert ae.num_first_token_yields == 2  # the abandoned request's first token, then "next"'s


def test_a_caller_whose_loop_is_gone_at_its_first_token_is_dropped_and_the_engine_serves_on(make_async_engine):
    """The sink refuses the first token (its event loop closed): the engine drops the
    request. (It still takes the pause for that token: see the report; only survival and
    the freed blocks are asserted here.)"""
    ae = make_async_engine(first_token_yield_s=0.05)
    seen: list = []

    def sink(item) -> bool:
        seen.append(item)
        return False  # the caller is gone

    cmd = _Add("orphan", list(PROMPTS[0]), _greedy(500), "default", "", 0.0, sink)
    ae._send(cmd)
    assert cmd.accepted.result(timeout=DEADLINE_S) is None

    async def main():
        assert await _all_blocks_free(ae)
        return await _num_requests(ae), await _collect(ae, "next", PROMPTS[1], _greedy(3))

    num_requests, tokens = asyncio.run(asyncio.wait_for(main(), DEADLINE_S * 2))
    assert num_requests == 0 and ae.num_active == 0
    assert len(seen) == 1 and len(seen[0].new_token_ids) == 1  # nothing more was sent to a gone caller
    assert len(tokens) == 3 and ae.is_alive
    assert ae.num_first_token_yields <= 2


# -- shutdown while the engine thread is inside the pause --------------------------------------

class _SpyStopping(threading.Event):
    """The driver's ``_stopping`` event, telling when the engine thread enters the pause."""

    def __init__(self, pause_s: float) -> None:
        super().__init__()
        self.pause_s = pause_s
        self.in_pause = threading.Event()
        self.woken: list[bool] = []

    def wait(self, timeout=None):
        if timeout == self.pause_s:
            self.in_pause.set()
            woken = super().wait(timeout)
            self.woken.append(woken)
            return woken
        return super().wait(timeout)


def test_shutdown_ends_a_pause_at_once_and_fails_the_stream(make_async_engine):
    ae = make_async_engine(first_token_yield_s=0.05)
    # A pause far longer than any deadline here (past the driver's own range check): had
    # shutdown to wait it out, the thread could not end within shutdown's join below.
    ae.first_token_yield.pause_s = 3600.0
    spy = _SpyStopping(ae.first_token_yield.pause_s)
    ae._stopping = spy  # the thread is idle, blocked on its inbox; it reads the attribute per loop

    async def main():
        stream = ae.generate("long", PROMPTS[0], _greedy(500))
        first = await stream.__anext__()
        assert len(first.new_token_ids) == 1
        assert await asyncio.to_thread(spy.in_pause.wait, DEADLINE_S), "the engine never paused"
        await asyncio.to_thread(ae.shutdown, DEADLINE_S)
        assert not ae.is_alive, "shutdown waited for the pause (or the thread hung)"
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(main(), DEADLINE_S * 3))
    assert spy.woken == [True]  # the pause ended because of the stop, not by running out
    assert ae.num_first_token_yields == 1


def test_shutdown_during_a_valid_pause_ends_the_thread(make_async_engine):
    ae = make_async_engine(first_token_yield_s=0.05)
    spy = _SpyStopping(0.05)
    ae._stopping = spy

    async def main():
        stream = ae.generate("r", PROMPTS[1], _greedy(200))
        await stream.__anext__()
        assert await asyncio.to_thread(spy.in_pause.wait, DEADLINE_S)
        await asyncio.to_thread(ae.shutdown, DEADLINE_S)
        assert not ae.is_alive
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await ae.call(lambda e: None)

    asyncio.run(asyncio.wait_for(main(), DEADLINE_S * 3))


# -- how many requests are unfinished ----------------------------------------------------------

def _gated_batch(ae: AsyncEngine, n: int, max_tokens: int) -> list[list[int]]:
    """Add ``n`` requests while the engine thread is held inside a call, so one step
    prefills all of them and gives each its first token at once."""
    in_gate, gate = threading.Event(), threading.Event()

    def hold(_engine):
        in_gate.set()
        return gate.wait(DEADLINE_S)

    async def main():
        held = asyncio.ensure_future(ae.call(hold))
        assert await asyncio.to_thread(in_gate.wait, DEADLINE_S)
        tasks = [asyncio.ensure_future(_collect(ae, f"r{i}", PROMPTS[i % 2], _greedy(max_tokens)))
                 for i in range(n)]
        deadline = time.monotonic() + DEADLINE_S
        while ae._inbox.qsize() < n and time.monotonic() < deadline:  # every add queued behind the gate
            await asyncio.sleep(0)
        assert ae._inbox.qsize() >= n
        gate.set()
        assert await held is True
        return await asyncio.gather(*tasks)

    return asyncio.run(asyncio.wait_for(main(), DEADLINE_S * 2))


@pytest.mark.parametrize("n", [FIRST_TOKEN_YIELD_MAX_REQUESTS + 1, 4, 8])
def test_more_than_two_unfinished_requests_never_pause_and_get_the_same_tokens(make_async_engine, n):
    paused, plain = make_async_engine(first_token_yield_s=0.05), make_async_engine()
    with_pause, without = _gated_batch(paused, n, 6), _gated_batch(plain, n, 6)
    assert with_pause == without and all(len(t) == 6 for t in with_pause)
    assert paused.num_first_token_yields == 0


def test_two_requests_whose_first_tokens_share_a_step_pause_once(make_async_engine):
    paused, plain = make_async_engine(first_token_yield_s=0.002), make_async_engine()
    assert _gated_batch(paused, 2, 6) == _gated_batch(plain, 2, 6)
    assert paused.num_first_token_yields == 1


def test_prompt_logprobs_and_logprobs_are_the_same_through_a_pausing_engine(make_async_engine):
    paused, plain = make_async_engine(first_token_yield_s=0.002), make_async_engine()
    params = _greedy(5, prompt_logprobs=2, logprobs=True, top_logprobs=2)

    async def outputs(ae, rid):
        return [o async for o in ae.generate(rid, PROMPTS[0], params)]

    async def main():
        return await outputs(paused, "a"), await outputs(plain, "b")

    a, b = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    strip = lambda outs: [(o.new_token_ids, o.new_logprobs, o.new_top_logprobs, o.prompt_logprobs,  # noqa: E731
                           o.prompt_top_logprobs, o.finished) for o in outs]
    assert strip(a) == strip(b)
    assert a[0].prompt_logprobs and not any(o.prompt_logprobs for o in a[1:])
    assert paused.num_first_token_yields == 1

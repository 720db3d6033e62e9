"""The engine driver's first-token yield (async_engine.py's NOTE): after a step that gave a
request that asked for it and goes on its first token, the engine thread pauses, when at
most two requests are unfinished; the tokens are the same either way; the executor asks
for it for interactive requests only; its option is refused out of range and is 0 on CUDA."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.executor.config import ExecutorConfig
from services.executor.engine.async_engine import AsyncEngine
from services.executor.engine.first_token_yield import MAX_UNFINISHED, FirstTokenYield
from services.executor.engine.sampling_params import SamplingParams
from services.executor.server import wants_first_token_yield
from weft.v1 import common_pb2, executor_pb2
from tests.unit.executor.test_async_engine import PROMPTS, _collect, checkpoint, make_async_engine  # noqa: F401

DEADLINE_S = 20.0


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_a_lone_request_gets_one_pause_after_its_first_token_and_the_same_tokens(make_async_engine):
    paused, plain = make_async_engine(first_token_yield_s=0.002), make_async_engine()

    async def main():
        a = await _collect(paused, "a", PROMPTS[0], _greedy(6))
        b = await _collect(plain, "b", PROMPTS[0], _greedy(6))
        return a, b

    with_pause, without = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert with_pause == without and len(with_pause) == 6
    assert paused.num_first_token_yields == 1
    assert plain.num_first_token_yields == 0


def test_a_request_that_does_not_ask_for_the_pause_gets_none(make_async_engine):
    ae = make_async_engine(first_token_yield_s=0.002)

    async def main():
        tokens = []
        async for out in ae.generate("hop", PROMPTS[0], _greedy(6), first_token_yield=False):
            tokens.extend(out.new_token_ids)
        return tokens

    assert len(asyncio.run(asyncio.wait_for(main(), DEADLINE_S))) == 6
    assert ae.num_first_token_yields == 0
    assert not ae.first_token_yield._owed  # nothing left behind


def test_a_reply_that_ends_at_its_first_token_needs_no_pause(make_async_engine):
    ae = make_async_engine(first_token_yield_s=0.002)
    tokens = asyncio.run(asyncio.wait_for(_collect(ae, "one", PROMPTS[1], _greedy(1)), DEADLINE_S))
    assert len(tokens) == 1
    assert ae.num_first_token_yields == 0


def _out(rid: str, n_new: int, n_out: int, finished: bool = False):
    return SimpleNamespace(request_id=rid, new_token_ids=(7,) * n_new, num_output_tokens=n_out, finished=finished)


def _owing(*request_ids: str) -> FirstTokenYield:
    rule = FirstTokenYield(0.001)
    for rid in request_ids:
        rule.admit(rid, True)
    return rule


def test_the_pause_rule_first_tokens_of_going_requests_that_asked_with_few_unfinished():
    assert _owing("a").due([_out("a", 1, 1)], MAX_UNFINISHED)  # asked, goes on
    assert _owing("a").due([_out("x", 1, 5), _out("a", 1, 1)], 2)  # one of the step's outputs
    assert not _owing("a").due([_out("x", 1, 1)], 2)  # did not ask
    assert not _owing("a").due([_out("a", 1, 1, finished=True)], 2)  # nothing follows it
    assert not _owing("a").due([_out("a", 0, 0)], 2)  # a prefill chunk without a token
    assert not _owing("a").due([], 2)
    assert not _owing("a").due([_out("a", 1, 1)], MAX_UNFINISHED + 1)  # would delay the others


def test_each_request_is_judged_once_at_its_first_token_or_its_end():
    rule = _owing("a", "b", "c")
    assert not rule.due([_out("a", 0, 0)], 1)  # still prefilling: still owed
    assert rule._owed == {"a", "b", "c"}
    assert rule.due([_out("a", 1, 1)], 1)
    assert not rule.due([_out("a", 1, 1)], 1)  # judged already
    rule.due([_out("b", 0, 0, finished=True)], 1)  # ended without a token
    rule.forget("c")  # aborted
    assert rule._owed == set()
    rule = _owing("a")
    assert not rule.due([_out("a", 1, 1)], MAX_UNFINISHED + 1) and not rule._owed  # judged (no pause) all the same


def test_nobody_is_owed_a_pause_of_zero_or_one_not_asked_for():
    rule = FirstTokenYield(0.0)
    rule.admit("a", True)
    rule = FirstTokenYield(0.001)
    rule.admit("b", False)
    assert not rule._owed


def test_a_due_step_waits_the_pause_and_counts_it():
    waits: list[float] = []
    rule = _owing("a")
    rule.after_step([_out("a", 1, 1)], 1, waits.append)
    rule.after_step([_out("a", 1, 2)], 1, waits.append)  # a later token: no pause
    assert waits == [0.001] and rule.num_pauses == 1


@pytest.mark.parametrize("request_class,asks", [
    (common_pb2.REQUEST_CLASS_UNSPECIFIED, True), (common_pb2.REQUEST_CLASS_INTERACTIVE, True),
    (common_pb2.REQUEST_CLASS_AGENTIC, False), (common_pb2.REQUEST_CLASS_BATCH, False),
    (common_pb2.REQUEST_CLASS_DETERMINISTIC, False),
])
def test_the_executor_asks_for_the_pause_for_interactive_requests_only(request_class, asks):
    request = executor_pb2.ExecuteRequest(request_id="r", prompt_token_ids=[1, 2],
                                          session=common_pb2.SessionInfo(request_class=request_class))
    assert wants_first_token_yield(request) is asks


@pytest.mark.parametrize("value", [-0.001, 0.051])
def test_the_driver_refuses_a_pause_out_of_range(value):
    with pytest.raises(ValueError, match="first_token_yield_s"):
        AsyncEngine(None, first_token_yield_s=value)


def test_the_executor_option_is_seconds_on_cpu_zero_on_cuda_and_refused_out_of_range(tmp_path):
    assert ExecutorConfig(model_dir=str(tmp_path)).first_token_yield_s == pytest.approx(0.0015)
    assert ExecutorConfig(model_dir=str(tmp_path), first_token_yield_ms=0.0).first_token_yield_s == 0.0
    assert ExecutorConfig(model_dir=str(tmp_path), device="cuda:0").first_token_yield_s == 0.0
    for bad in (-1.0, 51.0):
        with pytest.raises(ValueError, match="first_token_yield_ms"):
            ExecutorConfig(model_dir=str(tmp_path), first_token_yield_ms=bad)

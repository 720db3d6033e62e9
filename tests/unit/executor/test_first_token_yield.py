"""The engine driver's first-token yield (async_engine.py's NOTE): after a step that gave a
request that goes on its first token, the engine thread pauses, when at most two requests
are unfinished; the tokens are the same either way; the executor's option is refused out
of range and is 0 on CUDA."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.executor.config import ExecutorConfig
from services.executor.engine.async_engine import FIRST_TOKEN_YIELD_MAX_REQUESTS, AsyncEngine
from services.executor.engine.sampling_params import SamplingParams
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


def test_a_reply_that_ends_at_its_first_token_needs_no_pause(make_async_engine):
    ae = make_async_engine(first_token_yield_s=0.002)
    tokens = asyncio.run(asyncio.wait_for(_collect(ae, "one", PROMPTS[1], _greedy(1)), DEADLINE_S))
    assert len(tokens) == 1
    assert ae.num_first_token_yields == 0


def _out(n_new: int, n_out: int, finished: bool = False):
    return SimpleNamespace(new_token_ids=(7,) * n_new, num_output_tokens=n_out, finished=finished)


def _driver(num_unfinished: int) -> AsyncEngine:
    """``_yields_after`` reads only the engine's unfinished requests: no thread needed."""
    ae = object.__new__(AsyncEngine)
    ae.engine = SimpleNamespace(requests={f"r{i}": None for i in range(num_unfinished)})
    return ae


def test_the_pause_rule_first_tokens_of_going_requests_with_few_unfinished():
    few = _driver(FIRST_TOKEN_YIELD_MAX_REQUESTS)
    assert few._yields_after([_out(1, 1)])  # a first token, the request goes on
    assert few._yields_after([_out(1, 5), _out(1, 1)])  # one of the step's outputs is a first token
    assert not few._yields_after([_out(1, 5)])  # a later token
    assert not few._yields_after([_out(1, 1, finished=True)])  # nothing follows it
    assert not few._yields_after([_out(0, 0)])  # a prefill chunk without a token
    assert not few._yields_after([])
    many = _driver(FIRST_TOKEN_YIELD_MAX_REQUESTS + 1)
    assert not many._yields_after([_out(1, 1)])  # the pause would delay the others


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

"""Issue 16, the native decode path as the engine drives it, token for token against the
torch path (EngineConfig.native_decode=False), greedy: 65 rows (one more than a native
step takes) shrinking to 64 and below as rows finish, a pool small enough to preempt and
recompute, a row reaching max_model_len, lengths ~1000x apart in one batch, copies of one
prompt sharing every block but their last."""
from __future__ import annotations

import os
import shutil

import pytest

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import FinishReason
from services.executor.model.native import library
from weft.testing.tiny_model import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 17 * i) % 1000 + 3 for i in range(n)]


# name: (requests as (prompt, max_tokens), engine config)
SCENARIOS = {
    # r0 stops after 3 tokens: the later steps have 64 rows
    "65_rows_then_fewer": ([(_prompt(3 + i % 17, i), 3 if i == 0 else 6) for i in range(65)], {"max_num_seqs": 65}),
    "preempted_and_recomputed": ([(_prompt(20, i), 30) for i in range(6)], {"block_size": 4, "num_kv_blocks": 40}),
    "up_to_max_model_len": ([(_prompt(60, 1), 50), (_prompt(5, 2), 50)], {"max_model_len": 64}),
    "lengths_1000x_apart": ([(_prompt(2, 1), 8), (_prompt(1900, 2), 8), (_prompt(3, 3), 8)], {}),
    "copies_share_blocks": ([(_prompt(40, 9), 12)] * 4, {"block_size": 4}),
}


def _run(path, native: bool, requests, config):
    engine = LLMEngine(path, EngineConfig(native_decode=native, **{"num_kv_blocks": 512, **config}))
    rows: list[int] = []
    preemptions: list[str] = []
    if native:
        step_rows = engine.runner.native.step_rows
        engine.runner.native.step_rows = lambda ids, *a: rows.append(ids.shape[0]) or step_rows(ids, *a)
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: preemptions.append(seq.request_id) or preempt(seq)
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, _greedy(max_tokens))
    out: dict[str, tuple[list[int], object]] = {f"r{i}": ([], None) for i in range(len(requests))}
    while engine.has_unfinished_requests:
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            if o.finished:
                out[o.request_id] = (out[o.request_id][0], o.finish_reason)
    return out, rows, preemptions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", "llama", seed=6)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_engine_greedy_tokens_native_equal_torch(checkpoint, name):
    requests, config = SCENARIOS[name]
    native, rows, preempted = _run(checkpoint, True, requests, config)
    reference, _, _ = _run(checkpoint, False, requests, config)
    assert native == reference
    assert rows and max(rows) <= 64  # the native step ran, never over its row limit
    if name == "65_rows_then_fewer":
        assert 64 in rows  # the 65-row steps went through torch, the 64-row one natively
    if name == "preempted_and_recomputed":
        assert preempted
    if name == "up_to_max_model_len":
        assert len(native["r0"][0]) == 64 - 60 and native["r0"][1] is FinishReason.LENGTH

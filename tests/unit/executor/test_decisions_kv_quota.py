"""A KV-quota cut is its own finish reason (issue 17): the engine ends a request at its task
contract's KV quota with KV_QUOTA, not LENGTH (LENGTH reads as "ask for more tokens"), and
the executor's wire says FINISH_REASON_KV_QUOTA. ``max_tokens`` reached first, or a quota
larger than the model's context, is still LENGTH."""
from __future__ import annotations

from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import FinishReason, SessionOptions
from services.executor.server import step_to_proto
from tests.unit.executor.test_sessions import _engine, _prompt, _run, checkpoint  # noqa: F401 (fixture)
from weft.v1 import common_pb2


def _finish(checkpoint, max_tokens: int, quota_blocks: int, max_model_len: int | None = None):
    engine = _engine(checkpoint, **({"max_model_len": max_model_len} if max_model_len else {}))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("q", _prompt(10, 3), params, session=SessionOptions(kv_quota_blocks=quota_blocks))
    return _run(engine)["q"]


def test_a_request_cut_by_its_kv_quota_finishes_kv_quota_on_the_wire(checkpoint):
    out = _finish(checkpoint, max_tokens=50, quota_blocks=4)  # 4 blocks of 4 tokens: 16 tokens in all
    assert out.finish_reason is FinishReason.KV_QUOTA
    assert out.num_prompt_tokens + out.num_output_tokens == 16
    assert step_to_proto(out, "e").finish_reason == common_pb2.FINISH_REASON_KV_QUOTA


def test_max_tokens_reached_inside_the_quota_is_still_length(checkpoint):
    out = _finish(checkpoint, max_tokens=3, quota_blocks=4)
    assert out.finish_reason is FinishReason.LENGTH and out.num_output_tokens == 3
    assert step_to_proto(out, "e").finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_quota_above_the_models_context_leaves_the_context_cut_a_length(checkpoint):
    out = _finish(checkpoint, max_tokens=50, quota_blocks=20, max_model_len=16)
    assert out.finish_reason is FinishReason.LENGTH and out.num_prompt_tokens + out.num_output_tokens == 16

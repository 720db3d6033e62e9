"""A mixed step (decodes beside prefill chunks) runs its decodes natively and only its
prefill chunks through the model (ModelRunner.execute): every request gets what it gets
when it runs alone, prompt logprobs and sampled rows included, and the model's forward
never sees a decode row while the native step covers them."""
from __future__ import annotations

import os
import shutil

import pytest

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.model.native import library
from weft.testing.tiny_model import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")

VOCAB = 1024  # the "tiny" preset's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mixed") / "tiny", preset="tiny", arch="llama")


def engine(tiny, native_mixed_steps: bool = True, min_context: int = 0) -> LLMEngine:
    """An engine that splits every mixed step (``min_context`` 0: these contexts are short)."""
    e = LLMEngine(tiny, EngineConfig(block_size=16, max_model_len=256, num_kv_blocks=64, max_num_seqs=8,
                                     max_prefill_chunk=24, max_num_batched_tokens=64))
    e.runner.native_mixed_steps = native_mixed_steps
    e.runner.native_mixed_min_context = min_context
    return e


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % (VOCAB - 10) + 5 for i in range(n)]


# (request id, step it arrives at, prompt, params): two greedy decoders running when the
# others arrive; a prompt of 70 tokens in three chunks (two that sample nothing) with
# prompt logprobs; a seeded sampled request with top logprobs; one with a stop token.
REQUESTS = [
    ("a", 0, prompt(20, 1), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
    ("b", 0, prompt(33, 2), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=True)),
    ("c", 3, prompt(70, 3), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2)),
    ("d", 4, prompt(40, 4), SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True,
                                           logprobs=True, top_logprobs=3)),
    ("e", 5, prompt(18, 5), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
]


def run(e: LLMEngine, requests) -> tuple[dict, list[int]]:
    """Outputs per request, and the decode rows the model's forward saw in each step that
    had prefill chunks."""
    got: dict[str, dict] = {}
    forward_decodes: list[int] = []
    real_forward = e.model.forward

    def forward(input_ids, positions, kv_caches, meta):
        if meta.num_prefills:
            forward_decodes.append(meta.num_decodes)
        return real_forward(input_ids, positions, kv_caches, meta)

    e.model.forward = forward
    pending = sorted(requests, key=lambda r: r[1])
    step = 0
    while pending or e.has_unfinished_requests:
        while pending and pending[0][1] <= step:
            rid, _, p, params = pending.pop(0)
            e.add_request(rid, p, params)
            got[rid] = dict(tokens=[], logprobs=[], top=[], prompt=[], finish=None)
        for out in e.step():
            r = got[out.request_id]
            r["tokens"] += out.new_token_ids
            r["logprobs"] += out.new_logprobs
            r["top"] += [sorted(t) for t in out.new_top_logprobs]
            r["prompt"] += out.prompt_logprobs
            r["finish"] = out.finish_reason if out.finished else r["finish"]
        step += 1
        assert step < 500
    return got, forward_decodes


def assert_close(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"] and got["finish"] == want["finish"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
    assert got["prompt"] == pytest.approx(want["prompt"], abs=1e-4)
    assert [[i for i, _ in t] for t in got["top"]] == [[i for i, _ in t] for t in want["top"]]


def test_a_mixed_step_gives_each_request_what_it_gets_alone(tiny):
    together, forward_decodes = run(engine(tiny), REQUESTS)
    # the batch did mix: prefill chunks ran while decodes were running, and the model's
    # forward got none of those decode rows
    assert forward_decodes and all(n == 0 for n in forward_decodes)
    for rid, _, p, params in REQUESTS:
        alone, _ = run(engine(tiny), [(rid, 0, p, params)])
        assert_close(together[rid], alone[rid])
    assert len(together["c"]["prompt"]) == 69 and len(together["d"]["top"]) == 10


def test_the_baseline_sends_mixed_steps_decodes_through_the_model(tiny):
    # the ablation the benchmark compares against: the spy above can tell the two apart
    _, forward_decodes = run(engine(tiny, native_mixed_steps=False), REQUESTS)
    assert any(n > 0 for n in forward_decodes)


def test_decodes_with_short_contexts_stay_in_the_models_one_pass(tiny):
    # below the threshold a second pass over the weights costs more than the gathers it saves
    _, forward_decodes = run(engine(tiny, min_context=10_000), REQUESTS)
    assert any(n > 0 for n in forward_decodes)

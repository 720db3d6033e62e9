"""A mixed step (decodes beside prefill chunks) hands its decode rows to native code
(ModelRunner.execute): by default one pass of the model's forward over every row with the
decode rows' attention native (``single``), or, as an ablation, the decodes in the native
step and only the prefill chunks through the model (``split``). Either way every request
gets what it gets when it runs alone, prompt logprobs and sampled rows included."""
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


def engine(tiny, mode: str = "single", min_context: int = 0) -> LLMEngine:
    """An engine whose mixed steps run in ``mode``: single (the default), split (every one:
    ``min_context`` 0, these contexts are short) or model (all through the forward, gathered)."""
    e = LLMEngine(tiny, EngineConfig(block_size=16, max_model_len=256, num_kv_blocks=64, max_num_seqs=8,
                                     max_prefill_chunk=24, max_num_batched_tokens=64))
    e.runner.native_decode_attention = mode == "single"
    e.runner.native_mixed_steps = mode == "split"
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
    """Outputs per request, and per step that had prefill chunks: the decode rows the
    model's forward saw, and how many of those its layers attended natively (in all)."""
    got: dict[str, dict] = {}
    forward_decodes: list[tuple[int, int]] = []
    real_forward = e.model.forward
    attended: list[int] = []
    if e.runner.native is not None:
        real_attend = e.runner.native.attend_rows

        def attend(cache, q, block_tables, seq_lens):
            attended.append(q.shape[0])
            return real_attend(cache, q, block_tables, seq_lens)

        e.runner.native.attend_rows = attend

    def forward(input_ids, positions, kv_caches, meta):
        attended.clear()
        out = real_forward(input_ids, positions, kv_caches, meta)
        if meta.num_prefills:
            forward_decodes.append((meta.num_decodes, sum(attended)))
        return out

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


@pytest.mark.parametrize("mode", ["single", "split"])
def test_a_mixed_step_gives_each_request_what_it_gets_alone(tiny, mode):
    together, forward_decodes = run(engine(tiny, mode), REQUESTS)
    # the batch did mix: prefill chunks ran while decodes were running. Single: the forward
    # took those decode rows and every layer attended them natively; split: it got none
    layers = engine(tiny).model.num_layers
    assert forward_decodes
    if mode == "single":
        assert any(n for n, _ in forward_decodes) and all(native == n * layers for n, native in forward_decodes)
    else:
        assert all(n == 0 and native == 0 for n, native in forward_decodes)
    for rid, _, p, params in REQUESTS:
        alone, _ = run(engine(tiny, mode), [(rid, 0, p, params)])
        assert_close(together[rid], alone[rid])
    assert len(together["c"]["prompt"]) == 69 and len(together["d"]["top"]) == 10


def test_the_baseline_sends_mixed_steps_decodes_through_the_model_gathered(tiny):
    # the ablation the benchmark compares against: the spy above can tell it apart
    _, forward_decodes = run(engine(tiny, "model"), REQUESTS)
    assert any(n > 0 for n, _ in forward_decodes) and all(native == 0 for _, native in forward_decodes)


def test_split_decodes_with_short_contexts_stay_in_the_models_one_pass(tiny):
    # the split's threshold: below it a second pass over the weights cost more than the
    # gathers it saved
    _, forward_decodes = run(engine(tiny, "split", min_context=10_000), REQUESTS)
    assert any(n > 0 for n, _ in forward_decodes) and all(native == 0 for _, native in forward_decodes)

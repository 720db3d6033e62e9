"""Mixed steps whose decode rows the native code handles (ModelRunner.execute), attacked as
a hostile client and an unlucky operator would, in both of its shapes (``mode``):

- ``single``: the default. One pass of the model's forward over every row; the decode
  rows' attention runs natively (``NativeDecoder.attend_rows``) instead of gathering;
- ``split``: the decodes in the native step, only the prefill chunks through the model
  (``native_decode_attention`` off, ``native_mixed_min_context`` 0: tiny contexts split).

Every test drives that engine and the ablation (the whole step through the model, decode
rows gathered, as before either) through one schedule of adds and aborts and asks for the
same tokens, finish reasons, logprobs, top logprobs, prompt logprobs and entropies. A spy
on the runner says what each mixed step did (``native``: its decode rows were handled
natively; ``gathered``: they went through the gather path), so each test also checks that
the case it attacks actually happened:

- prompt logprobs of chunked prefills (row offsets), several chunks in one step, a step
  whose chunks sample nothing beside decodes that do;
- decode rows that are a prompt's last token (a 1-token remainder with prompt logprobs,
  a prefix hit leaving 1 token) beside prefill chunks; a 1-token chunk that samples
  nothing (a budget remainder, scheduled as a decode row: the step stays in one pass);
- seeded, penalised, biased, stopping, top-logprob, regex-constrained and entropy-tracking
  rows on both sides of the split in one step;
- preemption in a tiny pool, an abort between steps, a prefix hit on a running prompt;
- 65 decode rows (past the native step's 64: one pass) and 64 (split), int8 KV and KV
  compression by attention (no native step), KV compression of the oldest blocks (native
  decode rows with evicted tokens beside prefills).
"""
from __future__ import annotations

import os
import shutil

import pytest

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
from services.executor.engine.sequence import FinishReason, SessionOptions
from services.executor.model.native import library
from tests.adversarial.graph_parity import VOCAB, assert_same, drive, greedy, prompt, tiny_checkpoint

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(params=["single", "split"])
def mode(request) -> str:
    return request.param


def engine(tiny, mode: str, **extra) -> tuple[LLMEngine, list[dict]]:
    """An engine on the torch back end (``mode``: single, split, or model: the ablation),
    and the list its spy fills: one dict per step that had decode rows and prefill chunks."""
    options = dict(block_size=16, max_model_len=256, num_kv_blocks=64, max_num_seqs=8, max_prefill_chunk=24,
                   max_num_batched_tokens=64)
    options.update(extra)
    e = LLMEngine(tiny, EngineConfig(**options))
    runner = e.runner
    runner.native_decode_attention = mode == "single"
    runner.native_mixed_steps = mode == "split"
    runner.native_mixed_min_context = 0
    steps: list[dict] = []
    forward_decodes: list[int] = []
    attended: list[int] = []  # rows of each native attention call (one per layer)
    real_forward, real_execute = e.model.forward, runner.execute
    if runner.native is not None:
        real_attend = runner.native.attend_rows

        def attend(cache, q, block_tables, seq_lens):
            attended.append(q.shape[0])
            return real_attend(cache, q, block_tables, seq_lens)

        runner.native.attend_rows = attend

    def forward(input_ids, positions, kv_caches, meta):
        forward_decodes.append(meta.num_decodes)
        return real_forward(input_ids, positions, kv_caches, meta)

    def execute(plan):
        forward_decodes.clear()
        attended.clear()
        step = dict(d=len(plan.decodes), p=len(plan.prefills), p_sample=sum(s.samples for s in plan.prefills),
                    prompt_decodes=sum(d.seq.num_computed_tokens + 1 == d.seq.num_prompt_tokens for d in plan.decodes),
                    evicted=any(d.seq.num_evicted_tokens for d in plan.decodes),
                    idle_decodes=sum(not d.samples for d in plan.decodes),
                    recompute=any(p.seq.num_preemptions for p in plan.prefills))
        result = real_execute(plan)
        one_pass = forward_decodes == [step["d"]]
        # native: the split's step took every decode row, or the one pass attended them all natively
        step["native"] = forward_decodes == [0] or (
            one_pass and len(attended) == e.model.num_layers and all(n == step["d"] for n in attended))
        step["gathered"] = one_pass and not attended
        if plan.decodes and plan.prefills:
            steps.append(step)
        return result

    e.model.forward = forward
    runner.execute = execute
    return e, steps


def compare(tiny, mode: str, schedule, **extra) -> tuple[dict, list[dict], LLMEngine]:
    """Run ``schedule`` in ``mode`` and on the ablation; assert the same outputs. Returns
    the ``mode`` engine's outputs, its mixed steps and the engine."""
    want = drive(engine(tiny, "model", **extra)[0], schedule)
    e, steps = engine(tiny, mode, **extra)
    got = drive(e, schedule)
    assert_same(got, want)
    return got, steps, e


def test_prompt_logprobs_of_several_chunks_beside_decodes_keep_their_rows(tiny, mode):
    # a, b decode while c (70 tokens: chunks of 24, 24, 22) and d (30: 24, 6) prefill,
    # both asking for prompt logprobs; the first mixed step's chunks sample nothing
    schedule = {0: [("add", "a", prompt(20, 1), greedy(12, logprobs=True, top_logprobs=2)),
                    ("add", "b", prompt(9, 2), greedy(12))],
                2: [("add", "c", prompt(70, 3), greedy(4, prompt_logprobs=3)),
                    ("add", "d", prompt(30, 4), greedy(3, logprobs=True, prompt_logprobs=0))]}
    got, steps, _ = compare(tiny, mode, schedule)
    assert any(s["native"] and s["p"] == 2 and s["p_sample"] == 0 for s in steps)
    assert any(s["native"] and s["p"] == 2 and s["p_sample"] == 1 for s in steps)
    assert len(got["c"]["prompt"]) == 69 and all(len(t) == 3 for t in got["c"]["prompt_top"])
    assert len(got["d"]["prompt"]) == 29 and got["d"]["prompt_top"] in ([], [()] * 29)


def test_a_prompts_last_token_scheduled_as_a_decode_row_beside_a_prefill(tiny, mode):
    # e (25 tokens, prompt logprobs) leaves 1 token after its 24-token chunk: a decode row
    # beside f's next chunk; g repeats f's first 33 tokens: a 32-token prefix hit leaves 1
    f = prompt(60, 6)
    schedule = {0: [("add", "a", prompt(20, 1), greedy(10))],
                1: [("add", "e", prompt(25, 5), greedy(5, prompt_logprobs=2, logprobs=True)),
                    ("add", "f", f, greedy(3))],
                3: [("add", "g", f[:33], greedy(4, logprobs=True, top_logprobs=1))]}
    got, steps, _ = compare(tiny, mode, schedule)
    assert sum(s["prompt_decodes"] for s in steps if s["native"]) >= 2
    assert len(got["e"]["prompt"]) == 24 and got["g"]["cached"] == 32


def test_sampler_features_on_both_sides_of_the_split(tiny, mode):
    """Seeded draws, penalties, a logit bias (one outside the vocabulary), a stop token
    after min_tokens, top logprobs, a regex grammar and entropy tracking: as decode rows
    and as prefill rows of the same mixed steps."""
    kinds = [
        lambda i: SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11 + i, logprobs=True,
                                 ignore_eos=True),
        lambda i: SamplingParams(max_tokens=6, temperature=1.3, top_k=20, min_p=0.05, seed=5 + i, top_logprobs=2,
                                 logprobs=True, ignore_eos=True),
        lambda i: greedy(8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7,
                         logit_bias={3: 5.0, 9: -100.0, VOCAB + 50: 40.0}, logprobs=True),
        lambda i: greedy(8, logit_bias={7: 100.0}, stop_token_ids=(7,), min_tokens=3),
        lambda i: SamplingParams(max_tokens=8, temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{2,4}-[a-z]{1,3}")),
    ]
    entropy = SessionOptions(track_entropy=True)
    decoders = [("add", f"d{i}", prompt(6 + i, i), k(i)) for i, k in enumerate(kinds)]
    decoders.append(("add", "d5", prompt(5, 9), greedy(10), entropy))
    prefills = [("add", f"p{i}", prompt(30 + i, 20 + i), k(i)) for i, k in enumerate(kinds[:2])]
    later = [("add", f"q{i}", prompt(26, 30 + i), k(i)) for i, k in enumerate(kinds) if i >= 2]
    later.append(("add", "q5", prompt(27, 40), SamplingParams(max_tokens=5, temperature=0.7, seed=3), entropy))
    got, steps, _ = compare(tiny, mode, {0: decoders, 2: prefills, 3: later}, max_num_seqs=16,
                            max_num_batched_tokens=128)
    assert sum(s["native"] for s in steps) >= 2 and all(not s["gathered"] for s in steps)
    for rid in ("d3", "q3"):
        assert got[rid]["tokens"] == [7, 7, 7] and got[rid]["finish"] is FinishReason.STOP
    for rid in ("d5", "q5"):
        assert got[rid]["entropy"] > 0


def test_preemption_aborts_and_prefix_hits_in_a_tiny_pool(tiny, mode):
    # 8 blocks of 16: a, b and c cannot all grow, so one is preempted and recomputed (its
    # chunk beside native decodes);
    # x is aborted mid-prefill, y hits a's first block while a decodes, z asks for prompt
    # logprobs across the pressure
    a = prompt(20, 1)
    schedule = {0: [("add", "a", a, greedy(40)), ("add", "b", prompt(18, 2), greedy(40, logprobs=True))],
                2: [("add", "x", prompt(60, 3), greedy(4)), ("add", "c", prompt(40, 4), greedy(12))],
                3: [("abort", "x")],
                5: [("add", "y", a[:16] + prompt(10, 5), greedy(6))],
                8: [("add", "z", prompt(30, 6), SamplingParams(max_tokens=6, temperature=0.9, seed=1,
                                                                prompt_logprobs=1))]}
    got, steps, e = compare(tiny, mode, schedule, num_kv_blocks=8, max_model_len=128)
    assert e.num_preemptions > 0 and any(s["native"] and s["recompute"] for s in steps)
    assert got["x"]["finish"] is FinishReason.ABORT and got["y"]["cached"] == 16 and len(got["z"]["prompt"]) == 29


def test_more_decode_rows_than_the_native_step_covers_run_in_one_pass(tiny, mode):
    # 65 one-block requests: 64 prefill in step 0 (128 tokens), the 65th beside 64 decodes
    # (split); then w's chunks beside 65 decodes (past MAX_ROWS = 64: one pass)
    schedule = {0: [("add", f"r{i}", prompt(2, i), greedy(6)) for i in range(65)],
                3: [("add", "w", prompt(40, 99), greedy(3, prompt_logprobs=1))]}
    _, steps, _ = compare(tiny, mode, schedule, max_num_seqs=72, num_kv_blocks=96, max_num_batched_tokens=128,
                          max_prefill_chunk=24)
    assert any(s["d"] == 64 and s["native"] for s in steps)
    wide = [s for s in steps if s["d"] > 64]
    # the single pass attends any number of rows natively; the split's step stops at 64
    assert wide and all(s["native"] if mode == "single" else s["gathered"] for s in wide)


def test_a_one_token_chunk_that_does_not_sample_keeps_the_step_in_one_pass(tiny, mode):
    # budget 8: a, b decode, c's 5-token prompt takes 5, d's 40-token prompt gets the
    # remaining 1: a decode row that samples nothing (the native step must not take it)
    schedule = {0: [("add", "a", prompt(4, 1), greedy(8)), ("add", "b", prompt(3, 2), greedy(8))],
                2: [("add", "c", prompt(5, 3), greedy(3)), ("add", "d", prompt(40, 4), greedy(3, prompt_logprobs=2))]}
    got, steps, _ = compare(tiny, mode, schedule, max_num_batched_tokens=8, max_prefill_chunk=8)
    assert any((s["native"] if mode == "single" else s["gathered"]) and s["idle_decodes"] == 1 for s in steps)
    assert any(s["native"] for s in steps) and len(got["d"]["prompt"]) == 39


@pytest.mark.parametrize("extra, native", [
    (dict(kv_cache_dtype="int8"), False),
    (dict(kv_compress_budget_blocks=3, kv_compress_sink_blocks=1, kv_compress_recent_blocks=1), False),
    (dict(kv_compress_budget_blocks=3, kv_compress_sink_blocks=1, kv_compress_recent_blocks=1,
          kv_compress_policy="oldest"), True),
], ids=["int8", "compress-attention", "compress-oldest"])
def test_caches_without_a_native_step_and_compressed_decode_rows(tiny, mode, extra, native):
    # a, b decode past 3 blocks (compression drops middle blocks); prefills arrive late
    schedule = {0: [("add", "a", prompt(40, 1), greedy(24, logprobs=True)), ("add", "b", prompt(35, 2), greedy(24))],
                12: [("add", "c", prompt(50, 3), greedy(3, prompt_logprobs=1))],
                16: [("add", "d", prompt(30, 4), greedy(3))]}
    got, steps, e = compare(tiny, mode, schedule, **extra)
    assert (e.runner.native is not None) is native and len(got["a"]["tokens"]) == 24
    assert steps and all(s["native"] if native else s["gathered"] for s in steps)
    if "kv_compress_budget_blocks" in extra:
        assert e.num_compressed_blocks > 0 and any(s["evicted"] for s in steps)

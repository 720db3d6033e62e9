"""Issue 16, the native multi-row decode step at its edges, against the torch forward
pass (logits at 1e-4, the K/V slots written): rows at block boundaries, lengths 1000x
apart, the last RoPE position, rows sharing every block but their last (n > 1), 64 rows,
MHA / GQA / MQA, head_dim and hidden off every vector width, RoPE scaling, thread counts
changed between steps; and in the engine, a decode batch mixing sampling parameters
(seeded sampling, penalties, logprobs, a grammar, stop tokens mid-batch) gives the
tokens and logprobs the torch path gives (the native step returns logits only)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.selector import backend_class
from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
from services.executor.model.config import ModelConfig
from services.executor.model.llama import LlamaModel
from services.executor.model.native import library
from weft.testing.tiny_model import make_tiny_checkpoint, model_config_dict, random_weights

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")

MAX_POS = 2048  # the tiny preset's RoPE table

# name: (arch, config overrides, block size, row lengths, share every block but the last)
CASES = {
    "block_edges": ("llama", {}, 16, [15, 16, 17, 32, 33, 1, 2], False),
    "lengths_1000x_apart": ("llama", {}, 16, [2, 2000, 3, 1999], False),
    "last_rope_position": ("llama", {}, 16, [MAX_POS, 5], False),
    "64_rows": ("llama", {}, 16, [1 + (37 * r) % 300 for r in range(64)], False),
    "n_gt_1_shared_blocks": ("llama", {}, 16, [40] * 6, True),
    "mha": ("llama", {"num_key_value_heads": 4}, 8, [5, 20, 33], False),
    "gqa_4": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}, 8, [5, 20, 33], False),
    "mqa": ("llama", {"num_key_value_heads": 1}, 8, [5, 20, 33], False),
    "head_dim_6": ("llama", {"head_dim": 6}, 3, [5, 20, 33, 9], False),
    "hidden_100": ("llama", {"hidden_size": 100, "head_dim": 24}, 1, [5, 20, 33], False),
    # AVX2 attend_row keeps a head's output in registers 8 chunks (64 floats) at a time:
    # 128 takes two full groups, 76 a second group of one masked chunk
    "head_dim_128": ("llama", {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}, 16,
                     [5, 20, 33, 9], False),
    "head_dim_76": ("llama", {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 76}, 16,
                    [5, 20, 33, 9], False),
    "tiny_dims": ("llama", {"hidden_size": 8, "head_dim": 2, "intermediate_size": 3, "vocab_size": 5}, 4,
                  [5, 20, 33], False),
    "qwen2_tied_bias": ("qwen2", {}, 16, [5, 20, 33, 64], False),
    "rope_llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
                    16, [5, 300, 1500], False),
}



def _compare(model: LlamaModel, bs: int, lens: list[int], share: bool, threads: int | None = None,
             cache_tol: float = 1e-5) -> None:
    gen = torch.Generator().manual_seed(len(lens))
    rows, width = len(lens), max(-(-n // bs) for n in lens)
    num_blocks = width * rows + 2
    free = iter(torch.randperm(num_blocks, generator=gen).tolist())
    common = [next(free) for _ in range(width)]
    table = torch.zeros((rows, width), dtype=torch.int32)
    for r, n in enumerate(lens):
        own = -(-n // bs)
        blocks = common[:own - 1] + [next(free)] if share else [next(free) for _ in range(own)]
        table[r, :own] = torch.tensor(blocks, dtype=torch.int32)
    shape = (2, num_blocks, bs, model.num_kv_heads, model.head_dim)
    caches_torch = [torch.randn(shape, generator=gen) for _ in range(model.num_layers)]
    caches_native = [c.clone() for c in caches_torch]
    slots = torch.tensor([int(table[r, (n - 1) // bs]) * bs + (n - 1) % bs for r, n in enumerate(lens)])
    positions = torch.tensor([n - 1 for n in lens])
    tokens = torch.randint(0, model.lm_head.out_features, (rows,), generator=gen)
    meta = AttentionMetadata.decode_only(slots, table, lens)
    expected = model.compute_logits(model.forward(tokens, positions, caches_torch, meta))
    before = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        logits = model.native_decoder(caches_native).step_rows(
            tokens, positions, slots, table, torch.tensor(lens, dtype=torch.int32), tuple(lens))
    finally:
        torch.set_num_threads(before)
    for r in range(rows):
        torch.testing.assert_close(logits[r], expected[r], rtol=1e-4, atol=1e-4, msg=lambda m: f"row {r}: {m}")
    for native, ref in zip(caches_native, caches_torch):
        torch.testing.assert_close(native, ref, rtol=cache_tol, atol=cache_tol)


@pytest.mark.parametrize("case", list(CASES))
def test_native_rows_match_torch_at_the_edges(case):
    arch, overrides, bs, lens, share = CASES[case]
    config = ModelConfig.from_dict({**model_config_dict("tiny", arch), **overrides})
    model = LlamaModel(config, random_weights(config, seed=1), backend_class("torch"), native_decode=True)
    assert model.cos.shape[0] >= max(lens) and (case != "last_rope_position" or model.cos.shape[0] == max(lens))
    _compare(model, bs, lens, share)


@pytest.mark.parametrize("threads", [1, 3, 8])  # 8: more threads than this box's cores
def test_thread_count_changed_between_steps(threads):
    config = ModelConfig.from_dict(model_config_dict("tiny", "llama"))
    model = LlamaModel(config, random_weights(config, seed=1), backend_class("torch"), native_decode=True)
    _compare(model, 16, [5, 20, 33, 64, 100], False, threads=threads)


def _run(path, native: bool, requests, **config):
    engine = LLMEngine(path, EngineConfig(block_size=4, native_decode=native, **config))
    rows: list[int] = []
    if engine.runner.native is not None:
        step_rows = engine.runner.native.step_rows
        engine.runner.native.step_rows = lambda ids, *a: rows.append(ids.shape[0]) or step_rows(ids, *a)
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out = {rid: ([], [], [], None) for rid, _, _ in requests}
    while engine.has_unfinished_requests:
        for o in engine.step():
            tokens, logprobs, tops, _ = out[o.request_id]
            tokens.extend(o.new_token_ids)
            logprobs.extend(o.new_logprobs)
            tops.extend(o.new_top_logprobs)
            if o.finished:
                out[o.request_id] = (tokens, logprobs, tops, o.finish_reason)
    return out, rows


def test_engine_mixed_sampling_batch_is_unchanged_by_native_rows(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "tiny", "llama", seed=3)
    prompts = [[5 + i, 9, 200 + i] * (1 + i % 4) for i in range(8)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain, _ = _run(path, False, [(f"r{i}", p, greedy) for i, p in enumerate(prompts)])
    kinds = [
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=100, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.3, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{1,6}")),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=5, min_p=0.05, seed=3, logit_bias=((7, 5.0),),
                       ignore_eos=True),
    ]
    requests = [(f"r{i}", p, kinds[i]) for i, p in enumerate(prompts[:5])]
    # rows 5-7 stop on their own greedy token of step 3-5: the batch shrinks mid-decode
    requests += [(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0,
                                             stop_token_ids=(plain[f"r{i}"][0][i - 2],)))
                 for i, p in enumerate(prompts) if i >= 5]
    native, rows = _run(path, True, requests)
    reference, _ = _run(path, False, requests)
    assert rows and max(rows) == len(requests) and min(rows) < len(requests)
    for rid, (tokens, logprobs, tops, reason) in reference.items():
        got_tokens, got_logprobs, got_tops, got_reason = native[rid]
        assert (got_tokens, got_reason) == (tokens, reason), rid
        torch.testing.assert_close(got_logprobs, logprobs, rtol=0, atol=1e-4)
        assert [[t for t, _ in alt] for alt in got_tops] == [[t for t, _ in alt] for alt in tops], rid

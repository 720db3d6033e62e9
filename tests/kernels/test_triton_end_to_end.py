"""A whole greedy generation through the Triton back end (interpreted on CPU, compiled on a
GPU) equals the torch back end's: the kernels are wired into the engine, not only correct
in isolation."""
from __future__ import annotations

import torch

from services.executor.attention.base import QuantizedKVCache
from weft import LLM, SamplingParams
from weft.testing.tiny_model import make_tiny_checkpoint


def test_triton_backend_generation_equals_torch_backend(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny", preset="tiny", arch="llama")
    # one short prompt and one spanning two prefill chunks, then a prefix-cache hit
    prompts = [[5, 9, 200, 31, 7], list(range(40, 60)), list(range(40, 60)) + [3]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    options = dict(max_prefill_chunk=16, max_num_batched_tokens=32, block_size=16, num_kv_blocks=16,
                   device="cuda" if torch.cuda.is_available() else "cpu")

    expected = LLM(path, attention_backend="torch", **options).generate(prompts, params)
    triton_llm = LLM(path, attention_backend="triton", **options)
    assert triton_llm.engine.model.attn.name == "triton"
    got = triton_llm.generate(prompts[:2], params) + triton_llm.generate(prompts[2:], params)

    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert got[2].num_cached_tokens == 16


def test_triton_backend_on_an_int8_cache_generates_what_the_torch_backend_does(tmp_path):
    """The int8 cache (quantised on write, read by the int8 kernels) gives the torch back
    end's greedy tokens: both quantise bit-identically and differ only in attention rounding."""
    path = make_tiny_checkpoint(tmp_path / "tiny", preset="tiny", arch="llama")
    prompts = [[5, 9, 200, 31, 7], list(range(40, 60))]  # the second spans two prefill chunks
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    options = dict(max_prefill_chunk=16, max_num_batched_tokens=32, block_size=16, num_kv_blocks=16,
                   kv_cache_dtype="int8", device="cuda" if torch.cuda.is_available() else "cpu")

    expected = LLM(path, attention_backend="torch", **options).generate(prompts, params)
    triton_llm = LLM(path, attention_backend="triton", **options)
    assert triton_llm.engine.model.attn.name == "triton"
    assert isinstance(triton_llm.engine.runner.kv_caches[0], QuantizedKVCache)
    got = triton_llm.generate(prompts, params)

    assert [o.token_ids for o in got] == [o.token_ids for o in expected]

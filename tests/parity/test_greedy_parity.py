"""Greedy output equals Hugging Face transformers token for token: batch sizes 1/4/16,
prompts longer than a prefill chunk, a second pass through the prefix cache, and a pool
so small that preemption must happen."""
from __future__ import annotations

import random

import pytest
import torch

from weft import LLM, SamplingParams
from weft.testing.tiny_model import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")

NUM_NEW = 20
CHUNK = 32  # max_prefill_chunk in these tests: several prompts span 2-5 chunks


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), preset="tiny", arch=request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 7, 16, 17, 33, 70, 150]
    # a shared "system prompt" on half of them exercises prefix sharing within a batch
    system = [rng.randrange(10, vocab) for _ in range(40)]
    out = []
    for i in range(n):
        body = [rng.randrange(10, vocab) for _ in range(lengths[i % len(lengths)])]
        out.append(system + body if i % 2 else body)
    return out


def _reference(hf, prompts: list[list[int]]) -> list[list[int]]:
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            refs.append(out[0, len(p):].tolist())
    return refs


GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_greedy_matches_transformers_then_again_from_prefix_cache(checkpoint, batch_size):
    path, hf = checkpoint
    prompts = _prompts(batch_size, hf.config.vocab_size, seed=batch_size)
    expected = _reference(hf, prompts)
    llm = LLM(path, max_prefill_chunk=CHUNK, max_num_batched_tokens=4 * CHUNK)

    first = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == expected

    second = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in second] == expected
    block = llm.engine.config.block_size
    for prompt, out in zip(prompts, second):
        # every full block but the one holding the last prompt token is a hit
        assert out.num_cached_tokens == ((len(prompt) - 1) // block) * block


def test_greedy_matches_transformers_when_the_pool_forces_preemption(checkpoint):
    path, hf = checkpoint
    prompts = _prompts(16, hf.config.vocab_size, seed=99)
    expected = _reference(hf, prompts)
    longest = max(len(p) for p in prompts) + NUM_NEW
    # room for roughly two of the longest sequences at a time
    num_blocks = 2 * (-(-longest // 16)) + 2
    llm = LLM(path, num_kv_blocks=num_blocks, max_prefill_chunk=CHUNK, max_num_batched_tokens=4 * CHUNK)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.num_preemptions > 0
    assert llm.engine.pool.num_free_blocks == num_blocks  # everything given back


def test_a_request_that_outgrows_the_pool_ends_with_length_instead_of_hanging(checkpoint):
    path, _ = checkpoint
    llm = LLM(path, num_kv_blocks=4, block_size=16)
    (out,) = llm.generate([list(range(10, 39))], SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    assert out.finish_reason == "length"
    # the last sampled token needs no slot until it is fed back
    assert 0 < len(out.token_ids) <= 4 * 16 - 29 + 1
    assert llm.engine.pool.num_free_blocks == 4


@pytest.mark.parametrize("route", ["mkl", "onednn", "packed"])
def test_greedy_matches_transformers_when_one_step_is_a_long_prefill(checkpoint, route, monkeypatch):
    """8 prompts prefilled in one step of more than MKL_MIN_ROWS tokens: on a CPU where MKL
    was measured ahead the linears go through its sgemm on the plain weights there, oneDNN
    elsewhere, and on AVX2 CPUs native/gemm.c's packed GEMM (model/linear.py); every route
    forced here that this CPU can take (the packed one needs an AVX2 build without AVX-512)."""
    from services.executor.model import linear as linear_mod
    from services.executor.model.linear import MKL_MIN_ROWS, PackedLinear, packed_usable
    from services.executor.model.native import library as native_library

    if route == "packed":
        if not packed_usable(native_library.load()):
            pytest.skip("the packed GEMM is built for AVX2 CPUs without AVX-512 only")
    else:
        monkeypatch.setenv("WEFT_PACKED_GEMM", "0")
    monkeypatch.setattr(linear_mod, "mkl_prefill_wins", lambda: route == "mkl")

    path, hf = checkpoint
    rng = random.Random(7)
    prompts = [[rng.randrange(10, hf.config.vocab_size) for _ in range(90 + 7 * i)] for i in range(8)]
    assert sum(map(len, prompts)) > MKL_MIN_ROWS
    llm = LLM(path, max_num_batched_tokens=2048, max_prefill_chunk=512)
    steps = []
    forward = llm.engine.model.forward

    def spy(input_ids, *args, **kwargs):
        steps.append(input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)

    llm.engine.model.forward = spy
    gate_up = llm.engine.model.layers[0].gate_up  # the route taken
    assert isinstance(gate_up, PackedLinear) is (route == "packed")
    assert (getattr(gate_up, "_mkl_weight", None) is not None) is (route == "mkl")
    outs = llm.generate(prompts, GREEDY)
    assert max(steps) >= MKL_MIN_ROWS
    assert [o.token_ids for o in outs] == _reference(hf, prompts)

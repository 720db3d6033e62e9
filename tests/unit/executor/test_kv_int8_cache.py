"""The int8 KV cache (the kv_int8 rung): storage format, attention over it, block
budget, end-to-end generation, hash separation from float blocks, and the configs
it refuses. Generation quality is the lead's benchmark, not asserted here."""
from __future__ import annotations

import pytest
import torch

import weft
from services.executor.attention.base import AttentionMetadata, QuantizedKVCache, dequantize_int8, quantize_int8
from services.executor.attention.torch_backend import TorchAttentionBackend
from services.shared.block_hash import extra_keys_for, hash_block_chain
from services.executor.kv.block_pool import BlockStored
from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.tiers.kv_transfer import KvPayload, block_layout, export_blocks, import_blocks
from services.executor.engine.sampling_params import SamplingParams
from weft.testing.tiny_model import make_tiny_checkpoint

MAX_STEPS = 400  # no test here needs more; a loop past it is a hang
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(10, 50))  # 40 tokens: two full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-int8"), preset="tiny")


def _within_half_scale(approx: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> bool:
    # float32 division/rounding may add a few ulps on top of the scale/2 bound
    bound = scale[..., None] / 2 * (1 + 1e-5) + 1e-30
    return bool(((approx.float() - x.float()).abs() <= bound).all())


# -- storage format -------------------------------------------------------------------
def test_quantize_round_trip_error_is_at_most_half_a_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 16, generator=g) * torch.logspace(-6, 3, 64)[:, None, None]
    x[3, 1] = 0.0  # an all-zero row
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (64, 4)
    assert int(q.abs().max()) <= 127
    assert torch.equal(scale, x.abs().amax(-1) / 127)
    assert scale[3, 1] == 0 and not q[3, 1].any()
    assert _within_half_scale(dequantize_int8(q, scale, torch.float32), x, scale)


def test_quantize_puts_each_rows_largest_magnitude_at_127():
    x = torch.tensor([[[0.5, -2.0, 1.0]], [[3.0, 0.0, -1.5]]])
    q, _ = quantize_int8(x)
    assert q[:, 0].abs().amax(-1).tolist() == [127, 127]
    assert q[0, 0, 1] == -127 and q[1, 0, 0] == 127


def test_quantized_cache_write_fills_only_the_named_slots():
    cache = QuantizedKVCache.zeros(num_blocks=4, block_size=2, num_kv_heads=2, head_dim=8,
                                   dtype=torch.float32, device="cpu")
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5, 0, 6])  # block 2 offset 1, block 0 offset 0, block 3 offset 0
    cache.write(slots, k, v)
    keys = cache.gather(0, torch.arange(4)).view(8, 2, 8)  # [slots, kvh, d]
    values = cache.gather(1, torch.arange(4)).view(8, 2, 8)
    k_scale = cache.scales[0].view(8, 2)[slots]
    assert _within_half_scale(keys[slots], k, k_scale)
    assert _within_half_scale(values[slots], v, cache.scales[1].view(8, 2)[slots])
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert not keys[untouched].any() and not cache.scales[:, :, :].view(2, 8, 2)[:, untouched].any()


def test_int8_attention_equals_float_attention_over_the_dequantised_keys():
    """The int8 path differs from the float path only by the quantisation of K/V: a float
    cache fed the dequantised K/V gives the same output (decodes and a prefill with context)."""
    g = torch.Generator().manual_seed(1)
    heads, kvh, d, bs, nblocks = 4, 2, 16, 4, 8
    backend = TorchAttentionBackend(heads, kvh, d, scale=d ** -0.5)
    int8_cache = QuantizedKVCache.zeros(nblocks, bs, kvh, d, torch.float32, "cpu")
    float_cache = torch.zeros(2, nblocks, bs, kvh, d)
    # history: sequence A holds 6 tokens in blocks [1, 2]; sequence B holds 5 in [3, 4]
    hist_slots = torch.tensor([4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16])
    hk, hv = torch.randn(11, kvh, d, generator=g), torch.randn(11, kvh, d, generator=g)
    int8_cache.write(hist_slots, hk, hv)
    for i, x in enumerate((hk, hv)):
        float_cache[i].view(-1, kvh, d)[hist_slots] = dequantize_int8(*quantize_int8(x), torch.float32)
    # this step: A decodes its 7th token (slot 10); B prefills 3 more tokens (slots 17, 18, 19)
    new_slots = torch.tensor([10, 17, 18, 19])
    q = torch.randn(4, heads, d, generator=g)
    k, v = torch.randn(4, kvh, d, generator=g), torch.randn(4, kvh, d, generator=g)
    meta = AttentionMetadata(
        slot_mapping=new_slots, num_decodes=1,
        decode_block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
        decode_seq_lens=torch.tensor([7], dtype=torch.int32),
        num_prefills=1, prefill_query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        prefill_context_lens=torch.tensor([5], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([8], dtype=torch.int32),
        prefill_block_tables=torch.tensor([[3, 4]], dtype=torch.int32),
        prefill_query_lens_host=(3,), prefill_context_lens_host=(5,), decode_seq_lens_host=(7,),
    )
    out_int8 = backend.forward(q, k, v, int8_cache, meta)
    dk = dequantize_int8(*quantize_int8(k), torch.float32)
    dv = dequantize_int8(*quantize_int8(v), torch.float32)
    out_float = backend.forward(q, dk, dv, float_cache, meta)
    torch.testing.assert_close(out_int8, out_float, rtol=1e-5, atol=1e-6)


# -- the engine -----------------------------------------------------------------------
def test_int8_engine_gets_at_least_three_times_the_blocks_of_float32(checkpoint):
    budget = 4 << 20
    f32 = LLMEngine(checkpoint, EngineConfig(kv_cache_memory_bytes=budget))
    int8 = LLMEngine(checkpoint, EngineConfig(kv_cache_memory_bytes=budget, kv_cache_dtype="int8"))
    assert int8.num_blocks >= 3 * f32.num_blocks
    cache = int8.runner.kv_caches[0]
    assert isinstance(cache, QuantizedKVCache) and cache.data.dtype == torch.int8
    assert cache.data.shape[1] == int8.num_blocks
    assert len(int8.runner.kv_caches) == len(f32.runner.kv_caches)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_llm_generates_the_requested_lengths_and_reuses_cached_prefixes(checkpoint, dtype):
    llm = weft.LLM(checkpoint, dtype=dtype, kv_cache_dtype="int8", num_kv_blocks=64)
    prompts = [PROMPT, list(range(100, 117)), list(range(200, 205))]
    params = [GREEDY, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), GREEDY]
    first = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in first] == [6, 3, 6]
    assert all(o.finish_reason == "length" for o in first)
    again = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32  # the two full blocks of the prompt
    assert len(again.token_ids) == 6


def test_int8_and_float_engines_hash_the_same_tokens_differently(checkpoint):
    def stored_hashes(engine: LLMEngine) -> list[int]:
        engine.add_request("r", PROMPT, GREEDY)
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished_requests:
                break
            engine.step()
        return [h for ev in engine.take_kv_events() if isinstance(ev, BlockStored) for h in ev.block_hashes]

    float_hashes = stored_hashes(LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32)))
    int8_hashes = stored_hashes(LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32, kv_cache_dtype="int8")))
    assert len(float_hashes) == len(int8_hashes) >= 2
    assert not set(float_hashes) & set(int8_hashes)
    # the float cache's hashes are the ones every other component computes
    model_id = checkpoint.name
    assert float_hashes[:2] == hash_block_chain(PROMPT, 16, extra_keys_for(model_id))[:2]
    assert int8_hashes[:2] == hash_block_chain(PROMPT, 16, extra_keys_for(model_id, "", "int8"))[:2]


def test_extra_keys_of_the_model_dtype_cache_are_unchanged():
    assert extra_keys_for("m", "t") == extra_keys_for("m", "t", "auto") == b"m\x00t"
    assert extra_keys_for("m", "t", "int8") != b"m\x00t"


def test_int8_engine_blocks_do_not_transfer_to_the_cachestore(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32, kv_cache_dtype="int8"))
    engine.add_request("r", PROMPT, GREEDY)
    while engine.has_unfinished_requests:
        engine.step()
    hashes = hash_block_chain(PROMPT, 16, extra_keys_for(checkpoint.name, "", "int8"))
    assert engine.pool.cached_block(hashes[0]) is not None
    assert export_blocks(engine, hashes) == []
    payload = KvPayload(1234, "float32", (2, 2, 16, 2, 16), b"\x00" * (2 * 2 * 16 * 2 * 16 * 4))
    result = import_blocks(engine, [payload], None)
    assert (result.num_imported, result.num_refused) == (0, 1)
    with pytest.raises(ValueError, match="int8"):
        block_layout(engine)


# -- config ---------------------------------------------------------------------------
def test_triton_backend_accepts_an_int8_cache():
    config = EngineConfig(attention_backend="triton", kv_cache_dtype="int8",
                          device="cuda" if torch.cuda.is_available() else "cpu")
    assert config.resolved_attention_backend == "triton"


def test_auto_backend_picks_triton_on_cuda_and_torch_on_cpu_for_an_int8_cache():
    assert EngineConfig(device="cuda", kv_cache_dtype="int8").resolved_attention_backend == "triton"
    assert EngineConfig(device="cuda").resolved_attention_backend == "triton"
    assert EngineConfig(device="cpu", kv_cache_dtype="int8").resolved_attention_backend == "torch"

"""The native multi-row decode step (model/native/decode_batch.c) computes, row by row,
what the torch forward pass computes for a batch of decodes (each row its own length,
position and block table, some rows sharing prefix blocks), writes the same K/V slots,
and is what the engine runs for a decode-only batch, with the same greedy tokens."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.selector import backend_class
from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.model.config import ModelConfig
from services.executor.model.llama import LlamaModel
from services.executor.model.native import decoder as native_decoder
from services.executor.model.native import library
from weft.testing.tiny_model import make_tiny_checkpoint, model_config_dict, random_weights

# without a compiler (or with WEFT_NATIVE_DECODE=0) there is no native step to test; the
# torch fallback is tested in test_native_decode.py
pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")

BLOCK_SIZE = 4
NUM_BLOCKS = 128
SHARED_BLOCKS = 2  # rows 0 and 1 share their first two blocks (a prefix-cache hit)

# "odd": shapes that leave tails everywhere: hidden 72 (a masked 8-float chunk after 64),
# intermediate 131 and vocab 1022 (a last weight tile of 3 and 2 rows)
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # tied embeddings, qkv bias
    "odd": ("llama", {"hidden_size": 72, "head_dim": 18, "intermediate_size": 131, "vocab_size": 1022}),
    # head_dim 64 / 128: the AVX-512 attention's values pass takes every query head of a KV
    # head at once (llama_step.h pv_kv_head), in passes of 4 (64) or 2 (128) heads. Groups of
    # 5 and 3 leave a short last pass; head_dim 56 a masked last chunk.
    "gqa64": ("llama", {"hidden_size": 320, "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 64}),
    "gqa128": ("llama", {"hidden_size": 384, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 128}),
    "gqa56": ("llama", {"hidden_size": 336, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 56}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request) -> LlamaModel:
    arch, overrides = VARIANTS[request.param]
    config = ModelConfig.from_dict({**model_config_dict("tiny", arch), **overrides})
    return LlamaModel(config, random_weights(config, seed=5), backend_class("torch"), native_decode=True)


def _tables(num_rows: int, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Block tables [num_rows, width] int32 over scattered blocks and the rows' lengths
    (varied; rows 0 and 1 start with the same SHARED_BLOCKS blocks and end past them)."""
    lens = [9 + (5 * r) % 17 for r in range(num_rows)]
    lens[1] = 12  # row 1 fills its third block exactly
    width = max(-(-n // BLOCK_SIZE) for n in lens)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    shared, free = perm[:SHARED_BLOCKS], iter(perm[SHARED_BLOCKS:])
    table = torch.zeros((num_rows, width), dtype=torch.int32)
    for r, n in enumerate(lens):
        own = -(-n // BLOCK_SIZE)
        first = shared if r < 2 else []
        table[r, :own] = torch.tensor(first + [next(free) for _ in range(own - len(first))], dtype=torch.int32)
    return table, lens



@pytest.mark.parametrize("num_rows", [2, 3, 4, 7, 17])
def test_native_rows_match_the_torch_forward_pass(model, num_rows):
    """Per row, logits agree with the torch path to fp32 tolerance and every row's K/V
    slot is written as torch writes it; rows differ in length, position (row 2 sits past
    its cache length, as after KV compression) and block table, rows 0 and 1 share blocks."""
    gen = torch.Generator().manual_seed(num_rows)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    caches_torch = [torch.randn(shape, generator=gen) for _ in range(model.num_layers)]
    caches_native = [c.clone() for c in caches_torch]
    table, lens = _tables(num_rows, gen)
    idx = [n - 1 for n in lens]
    slots = torch.tensor([int(table[r, i // BLOCK_SIZE]) * BLOCK_SIZE + i % BLOCK_SIZE for r, i in enumerate(idx)])
    positions = torch.tensor([i + (6 if r == 2 else 0) for r, i in enumerate(idx)])
    tokens = torch.randint(0, model.lm_head.out_features, (num_rows,), generator=gen)

    meta = AttentionMetadata.decode_only(slots, table, lens)
    expected = model.compute_logits(model.forward(tokens, positions, caches_torch, meta))
    decoder = model.native_decoder(caches_native)
    assert decoder is not None
    logits = decoder.step_rows(tokens, positions, slots, table, torch.tensor(lens, dtype=torch.int32), tuple(lens))

    assert logits.shape == expected.shape == (num_rows, model.lm_head.out_features)
    for r in range(num_rows):
        torch.testing.assert_close(logits[r], expected[r], rtol=1e-4, atol=1e-4, msg=lambda m: f"row {r}: {m}")
    for native, ref in zip(caches_native, caches_torch):
        torch.testing.assert_close(native, ref, rtol=1e-5, atol=1e-5)  # the new slots, nothing else


def test_each_row_equals_its_own_single_row_step(model):
    """A row's logits do not depend on the other rows of its batch: batch of 5 vs five
    batch-1 native steps over the same cache."""
    gen = torch.Generator().manual_seed(11)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    caches_rows = [torch.randn(shape, generator=gen) for _ in range(model.num_layers)]
    caches_one = [c.clone() for c in caches_rows]
    table, lens = _tables(5, gen)
    slots = torch.tensor([int(table[r, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                          for r, n in enumerate(lens)])
    positions = torch.tensor([n - 1 for n in lens])
    tokens = torch.randint(0, model.lm_head.out_features, (5,), generator=gen)
    rows = model.native_decoder(caches_rows).step_rows(tokens, positions, slots, table,
                                                       torch.tensor(lens, dtype=torch.int32), tuple(lens))
    one = model.native_decoder(caches_one)
    for r, n in enumerate(lens):
        single = one.step(int(tokens[r]), int(positions[r]), int(slots[r]), table[r].contiguous(), n)
        torch.testing.assert_close(rows[r], single[0], rtol=1e-4, atol=1e-4)


def test_bad_inputs_are_refused_before_the_call(model):
    decoder = model.native_decoder([torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
                                    for _ in range(model.num_layers)])
    ok = dict(token_ids=torch.tensor([1, 2]), positions=torch.tensor([0, 0]), slots=torch.tensor([0, 4]),
              block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
              seq_lens=torch.tensor([1, 1], dtype=torch.int32), seq_lens_host=(1, 1))
    assert decoder.step_rows(**ok).shape[0] == 2
    with pytest.raises(ValueError, match="RoPE"):
        decoder.step_rows(**{**ok, "positions": torch.tensor([0, 10**6])})
    with pytest.raises(ValueError, match="contiguous"):
        decoder.step_rows(**{**ok, "seq_lens": torch.tensor([1, 1])})  # int64


def _greedy(path, monkeypatch, native: str, prompts: list[list[int]], calls: list[int]) -> list[list[int]]:
    """Greedy tokens of ``prompts`` run together; ``calls`` collects the row count of
    every native multi-row step."""
    monkeypatch.setenv("WEFT_NATIVE_DECODE", native)
    engine = LLMEngine(path, EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=96, enable_prefix_caching=True))
    if engine.runner.native is not None:
        step_rows = engine.runner.native.step_rows
        monkeypatch.setattr(engine.runner.native, "step_rows",
                            lambda ids, *a: calls.append(ids.shape[0]) or step_rows(ids, *a))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_greedy_tokens_are_the_same_with_native_rows(arch, monkeypatch, tmp_path):
    """Six requests decoding together (four share a two-block prompt prefix through the
    prefix cache; lengths differ) give the tokens the torch path gives, and their decode
    steps ran as native multi-row steps."""
    path = make_tiny_checkpoint(tmp_path / arch, "tiny", arch, seed=3)
    prefix = [5, 9, 200, 31, 7, 12, 90, 4]
    prompts = [prefix + [1], prefix + [2, 3], prefix + [8, 8, 8, 8, 8], prefix, [44, 3, 900], [6] * 11]
    native_calls: list[int] = []
    native = _greedy(path, monkeypatch, "1", prompts, native_calls)
    plain = _greedy(path, monkeypatch, "0", prompts, [])
    assert native == plain
    assert native_calls and max(native_calls) == len(prompts)


def test_more_rows_than_max_rows_take_the_torch_path(monkeypatch):
    """The routing bound is the decoder's MAX_ROWS."""
    monkeypatch.setattr(native_decoder, "MAX_ROWS", 3)
    assert native_decoder.NativeDecoder.covers(3) and not native_decoder.NativeDecoder.covers(4)
    assert not native_decoder.NativeDecoder.covers(0)

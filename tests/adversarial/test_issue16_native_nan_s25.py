"""Issue 16, the native multi-row step with a NaN in a row's K/V cache (a corrupted slot,
an overflow upstream): the torch forward pass gives that row NaN logits and the others
their usual ones. exp16 clamped its input with the NaN operand first, so a NaN score
became e^88.7, won its softmax outright and the row came out finite: greedy sampling then
picked a made-up token where the torch path (and the native argmax's NaN rule) see NaN.
Also the native argmax on ties the existing tests leave out (signed zeros, many rows,
thread counts)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.selector import backend_class
from services.executor.model.config import ModelConfig
from services.executor.model.llama import LlamaModel
from services.executor.model.native import library
from weft.testing.tiny_model import model_config_dict, random_weights

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")

BS = 16


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    config = ModelConfig.from_dict(model_config_dict("tiny", "llama"))
    return LlamaModel(config, random_weights(config, seed=1), backend_class("torch"), native_decode=True)


# where the NaN goes: (row, token, K or V), in rows of 40 tokens (39 is the slot written now)
@pytest.mark.parametrize("row,token,kv", [(0, 0, 0), (2, 17, 0), (1, 5, 1), (5, 38, 0)])
def test_a_nan_in_one_rows_cache_gives_that_row_nan_logits_as_torch_does(model, row, token, kv):
    lens = [40] * 6  # 6 rows: one attention item per row on 2 or 3 threads
    width = -(-max(lens) // BS)
    gen = torch.Generator().manual_seed(7)
    table = torch.arange(len(lens) * width, dtype=torch.int32).reshape(len(lens), width)
    shape = (2, len(lens) * width, BS, model.num_kv_heads, model.head_dim)
    caches = [torch.randn(shape, generator=gen) for _ in range(model.num_layers)]
    block, offset = int(table[row, token // BS]), token % BS
    caches[0][kv, block, offset] = float("nan")  # every KV head of one token, layer 0
    native_caches = [c.clone() for c in caches]
    slots = torch.tensor([int(table[r, (n - 1) // BS]) * BS + (n - 1) % BS for r, n in enumerate(lens)])
    positions = torch.tensor([n - 1 for n in lens])
    tokens = torch.randint(0, model.lm_head.out_features, (len(lens),), generator=gen)
    meta = AttentionMetadata.decode_only(slots, table, lens)
    expected = model.compute_logits(model.forward(tokens, positions, caches, meta))
    got = model.native_decoder(native_caches).step_rows(
        tokens, positions, slots, table, torch.tensor(lens, dtype=torch.int32), tuple(lens))
    assert torch.isnan(expected[row]).all()
    assert torch.isnan(got[row]).all(), "the native row came out finite"
    others = [r for r in range(len(lens)) if r != row]
    torch.testing.assert_close(got[others], expected[others], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 3])
def test_argmax_ties_signed_zeros_and_many_rows(model, threads):
    decoder = model.native_decoder([torch.zeros((2, 4, 4, model.num_kv_heads, model.head_dim))
                                    for _ in range(model.num_layers)])
    cases = [torch.tensor([[-0.0, 0.0, 0.0], [0.0, -0.0, 0.0]]), torch.full((2, 33), -0.0),
             torch.tensor([[1e-45, 1e-45, 0.0]]), torch.full((3, 40), -3.4e38)]
    for rows, vocab in ((65, 17), (300, 33), (64, 1000)):  # more rows than a native step takes
        g = torch.Generator().manual_seed(rows * vocab)
        cases.append(torch.randint(-2, 2, (rows, vocab), generator=g).float())  # ties everywhere
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for logits in cases:
            assert decoder.argmax_rows(logits) == logits.argmax(-1).tolist()
    finally:
        torch.set_num_threads(before)

"""The torch forward's row-wise work in one native call each (native/rows.c, model/llama.py's
_NativeRows) and the in-place residual add (Linear.add_into): RoPE bit-identical to
apply_rope_, RMSNorm equal to F.rms_norm to fp32 rounding, a row's bits independent of its
batch and of the thread count, positions outside the tables left to torch's indexing (which
refuses them) instead of read out of bounds, the residual add bit-identical to
``h + linear(x)``, and a prefill chunk with nothing cached attending to the keys it just
wrote exactly as it did through the cache."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.selector import backend_class
from services.executor.attention.torch_backend import TorchAttentionBackend
from services.executor.model.config import ModelConfig
from services.executor.model.linear import Linear, PackedLinear, packed_usable
from services.executor.model.llama import LlamaModel, apply_rope_
from services.executor.model.native import library
from tests.adversarial.native_kernel_shim import pytestmark as native_only
from weft.testing.tiny_model import model_config_dict, random_weights

LIB = library.load() if library.native_enabled() else None
pytestmark = native_only


def _tables(d: int, max_pos: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(max_pos).float()[:, None] * inv[None]
    emb = torch.cat((f, f), -1)
    sin = emb.sin()
    return emb.cos(), torch.cat((-sin[:, : d // 2], sin[:, d // 2:]), -1)


def _rope(qkv: torch.Tensor, positions: torch.Tensor, heads: int, d: int, threads: int = 2) -> torch.Tensor:
    cos, sin_signed = _tables(d)
    out = qkv.clone()
    LIB.weft_rope_rows(out.data_ptr(), out.shape[1], positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
                       heads, d, out.shape[0], threads)
    return out


@pytest.mark.parametrize("d", [8, 20, 64, 128])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_rope_is_bit_identical_to_apply_rope_and_leaves_v_alone(d, rows):
    gen = torch.Generator().manual_seed(d * 100 + rows)
    heads, kv = 5, 2  # q + k heads rotate; the v heads after them do not
    qkv = torch.randn(rows, (heads + kv) * d, generator=gen) * 30  # large values: any FMA shows
    positions = torch.randint(0, 300, (rows,), generator=gen)
    cos, sin_signed = _tables(d)
    expected = qkv.clone()
    apply_rope_(expected[:, : heads * d].view(rows, heads, d), cos[positions].unsqueeze(1),
                sin_signed[positions].unsqueeze(1))
    assert torch.equal(_rope(qkv, positions, heads, d), expected)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 576])
def test_rms_norm_matches_torch_and_may_write_in_place(n):
    gen = torch.Generator().manual_seed(n)
    x, w = torch.randn(9, n, generator=gen) * 4, torch.randn(n, generator=gen)
    y = torch.empty_like(x)
    LIB.weft_rms_norm_rows(x.data_ptr(), w.data_ptr(), y.data_ptr(), 9, n, 1e-5, 2)
    torch.testing.assert_close(y, F.rms_norm(x, (n,), w, 1e-5), rtol=2e-6, atol=2e-6)
    same = x.clone()
    LIB.weft_rms_norm_rows(same.data_ptr(), w.data_ptr(), same.data_ptr(), 9, n, 1e-5, 2)
    assert torch.equal(same, y)


def test_a_rows_bits_depend_on_neither_its_batch_nor_the_threads():
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(40, 96, generator=gen), torch.randn(96, generator=gen)
    qkv, positions = torch.randn(40, 3 * 32, generator=gen), torch.randint(0, 300, (40,), generator=gen)
    batch = torch.empty_like(x)
    LIB.weft_rms_norm_rows(x.data_ptr(), w.data_ptr(), batch.data_ptr(), 40, 96, 1e-6, 2)
    for r in (0, 19, 39):
        alone = torch.empty(1, 96)
        LIB.weft_rms_norm_rows(x[r:r + 1].contiguous().data_ptr(), w.data_ptr(), alone.data_ptr(), 1, 96, 1e-6, 1)
        assert torch.equal(alone[0], batch[r])
    assert torch.equal(_rope(qkv, positions, 2, 32, threads=1), _rope(qkv, positions, 2, 32, threads=2))
    assert torch.equal(_rope(qkv[7:8].contiguous(), positions[7:8].contiguous(), 2, 32)[0],
                       _rope(qkv, positions, 2, 32)[7])


def _model(monkeypatch, packed: bool = True) -> LlamaModel:
    monkeypatch.setenv("WEFT_PACKED_GEMM", "1" if packed else "0")
    config = ModelConfig.from_dict({**model_config_dict("tiny", "llama"), "num_hidden_layers": 2})
    return LlamaModel(config, random_weights(config, seed=4), backend_class("torch"), native_decode=True)


def _prefill_meta(query_lens: list[int], block_size: int,
                  context_lens: list[int] | None = None) -> tuple[AttentionMetadata, int]:
    """Prefill chunks (nothing cached unless ``context_lens``), each sequence's blocks
    consecutive from block 1, its context's first; also the number of blocks used."""
    context_lens = context_lens or [0] * len(query_lens)
    seqs = [c + q for c, q in zip(context_lens, query_lens)]
    per = [-(-s // block_size) for s in seqs]
    width, tables, slots, first = max(per), [], [], 1
    for ctx, s, b in zip(context_lens, seqs, per):
        blocks = list(range(first, first + b))
        tables.append(blocks + [0] * (width - b))
        slots += [blocks[t // block_size] * block_size + t % block_size for t in range(ctx, s)]
        first += b
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decodes=0, decode_block_tables=torch.zeros((0, 1), dtype=torch.int32),
        decode_seq_lens=i32([]), num_prefills=len(query_lens),
        prefill_query_start_loc=i32([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        prefill_context_lens=i32(context_lens), prefill_seq_lens=i32(seqs),
        prefill_block_tables=i32(tables), prefill_query_lens_host=tuple(query_lens),
        prefill_context_lens_host=tuple(context_lens), decode_seq_lens_host=())
    return meta, first


def _forward(model: LlamaModel, ids: torch.Tensor, positions: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
    meta, blocks = _prefill_meta(query_lens, 4)
    caches = [torch.zeros(2, blocks, 4, model.num_kv_heads, model.head_dim) for _ in model.layers]
    return model.forward(ids, positions, caches, meta)


@pytest.mark.parametrize("packed", [True, False])
def test_the_forward_with_native_rows_matches_the_torch_ops(monkeypatch, packed):
    model = _model(monkeypatch, packed)
    gen = torch.Generator().manual_seed(1)
    lens = [5, 11, 1]
    ids = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    native = _forward(model, ids, positions, lens)
    monkeypatch.setattr(LlamaModel, "_row_ops", lambda self, p: None)  # torch's RMSNorm and RoPE
    torch.testing.assert_close(native, _forward(model, ids, positions, lens), rtol=1e-5, atol=1e-5)


def test_positions_past_the_tables_go_to_torch_which_refuses_them(monkeypatch):
    model = _model(monkeypatch)
    n = model.cos.shape[0]
    assert model._row_ops(torch.tensor([0, n - 1])) is not None
    for bad in (torch.tensor([0, n]), torch.tensor([-1, 0]), torch.tensor([0, 1], dtype=torch.int32)):
        assert model._row_ops(bad) is None, bad
    with pytest.raises(IndexError):
        _forward(model, torch.tensor([1, 2]), torch.tensor([0, n + 5]), [2])


@pytest.mark.skipif(not packed_usable(LIB), reason="the packed GEMM is built for AVX2 CPUs without AVX-512 only")
@pytest.mark.parametrize("rows", [1, 6, 16, 130])
def test_add_into_is_h_plus_the_product_bit_for_bit(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    x, h = torch.randn(rows, 24, generator=gen), torch.randn(rows, 40, generator=gen)
    for bias in (None, b):
        lin = PackedLinear(w, bias, LIB)
        out = h.clone()
        assert lin.add_into(x, out) is out
        assert torch.equal(out, h + lin(x))
        # what the kernel does not take goes through torch's add: same sum
        strided = torch.randn(rows, 80, generator=gen)[:, ::2]
        want = strided + lin(x)
        assert torch.equal(lin.add_into(x, strided), want)
    plain = Linear(w, b)
    out = h.clone()
    assert torch.equal(plain.add_into(x, out), h + F.linear(x, w, b))


def test_a_fresh_prefill_attends_to_its_own_keys_exactly_as_through_the_cache():
    backend = TorchAttentionBackend(num_heads=4, num_kv_heads=2, head_dim=8, scale=8 ** -0.5)
    gen = torch.Generator().manual_seed(2)
    lens = [3, 9, 4]
    meta, blocks = _prefill_meta(lens, 4)
    n = sum(lens)
    qkv = torch.randn(n, (4 + 2 + 2) * 8, generator=gen)  # k and v as strided views, as the model has them
    q, k, v = qkv[:, :32].view(n, 4, 8), qkv[:, 32:48].view(n, 2, 8), qkv[:, 48:].view(n, 2, 8)
    cache = torch.zeros(2, blocks, 4, 2, 8)
    out = backend.forward(q, k, v, cache, meta)
    start = 0
    for i, qlen in enumerate(lens):  # the cache route: keys and values gathered from the blocks written
        kc, vc = backend._gather(cache, meta.prefill_block_tables[i:i + 1], -(-qlen // 4))
        ref = F.scaled_dot_product_attention(q[start:start + qlen].transpose(0, 1).unsqueeze(0), kc[:, :, :qlen],
                                             vc[:, :, :qlen], is_causal=True, scale=backend.scale, enable_gqa=True)
        assert torch.equal(out[start:start + qlen], ref[0].transpose(0, 1))
        start += qlen

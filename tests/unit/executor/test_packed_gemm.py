"""native/gemm.c's packed GEMM (model/linear.py's PackedLinear): the product, bias,
residual add and fused silu(gate) * up match a float64 reference for every row count and
for output counts that leave a partial panel; odd inputs (3-D, strided, empty, no bias)
are served; a row's bits do not depend on its call's row count; a model on an AVX2 CPU
takes it for every projection and hands the packed copies to the native multi-row decode
step, and ``WEFT_PACKED_GEMM=0`` keeps oneDNN."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.executor.attention.selector import backend_class
from services.executor.model.config import ModelConfig
from services.executor.model.linear import OneDnnLinear, PackedLinear, packed_usable
from services.executor.model.llama import LlamaModel
from services.executor.model.native import library
from tests.adversarial.native_kernel_shim import pytestmark as native_only
from weft.testing.tiny_model import model_config_dict, random_weights

LIB = library.load() if library.native_enabled() else None
pytestmark = [
    native_only,
    pytest.mark.skipif(not packed_usable(LIB), reason="the packed GEMM is built for AVX2 CPUs without AVX-512 only"),
]


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 17, 64, 121, 250])
@pytest.mark.parametrize("out_features", [1, 8, 15, 16, 17, 40, 100])
def test_the_product_matches_float64_for_every_row_and_output_count(rows, out_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w, b = torch.randn(out_features, 37, generator=gen), torch.randn(out_features, generator=gen)
    x = torch.randn(rows, 37, generator=gen)
    for bias in (b, None):
        y = PackedLinear(w, bias, LIB)(x)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), _reference(x, w, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k", [63, 64, 65, 200, 256, 257, 600])
def test_a_row_has_the_same_bits_in_a_decode_step_and_in_a_prefill(k):
    # a few-row block runs 64 columns at a time, a many-row block 256 (gemm.c's
    # column_block): each output is still one left-to-right sum, so a row's bits match
    gen = torch.Generator().manual_seed(k)
    w, x = torch.randn(40, k, generator=gen), torch.randn(130, k, generator=gen)
    lin, gate_up = PackedLinear(w, None, LIB), PackedLinear(w, None, LIB, gate_up=True)
    many, many_act = lin(x), gate_up.silu_mul(x)
    for rows in (slice(0, 1), slice(3, 19), slice(100, 130)):
        assert torch.equal(lin(x[rows]), many[rows]), rows
        assert torch.equal(gate_up.silu_mul(x[rows]), many_act[rows]), rows


@pytest.mark.parametrize("rows", [3, 16, 130])
def test_the_residual_add_adds_into_y(rows):
    # the multi-row decode step adds o(attn) and down(act) into the residual in place
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(23, 19, generator=gen), torch.randn(23, generator=gen)
    x, y = torch.randn(rows, 19, generator=gen), torch.randn(rows, 23, generator=gen)
    lin = PackedLinear(w, b, LIB)
    out = y.clone()
    LIB.weft_gemm_packed(lin.packed.data_ptr(), b.data_ptr(), x.data_ptr(), 19, out.data_ptr(), 23, 23, 19, rows, 1, 2)
    torch.testing.assert_close(out.double(), y.double() + _reference(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("inter", [1, 7, 8, 9, 24, 131])
@pytest.mark.parametrize("rows", [1, 6, 16, 200])
def test_silu_mul_is_silu_of_gate_times_up(inter, rows):
    gen = torch.Generator().manual_seed(inter * 7 + rows)
    gate_up, x = torch.randn(2 * inter, 29, generator=gen), torch.randn(rows, 29, generator=gen)
    lin = PackedLinear(gate_up, None, LIB, gate_up=True)
    g, u = _reference(x, gate_up[:inter], None), _reference(x, gate_up[inter:], None)
    torch.testing.assert_close(lin.silu_mul(x).double(), F.silu(g) * u, rtol=1e-5, atol=1e-4)
    # a gate_up linear called plainly still gives [gate | up]
    torch.testing.assert_close(lin(x).double(), torch.cat([g, u], dim=1), rtol=1e-5, atol=1e-4)


def test_odd_inputs_are_served():
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(20, 12, generator=gen), torch.randn(20, generator=gen)
    lin, gu = PackedLinear(w, b, LIB), PackedLinear(torch.randn(20, 12, generator=gen), None, LIB, gate_up=True)
    x3 = torch.randn(2, 5, 12, generator=gen)  # 3-D
    torch.testing.assert_close(lin(x3), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)
    assert gu.silu_mul(x3).shape == (2, 5, 10)
    strided = torch.randn(12, 9, generator=gen).t()  # [9, 12], not contiguous
    torch.testing.assert_close(lin(strided), F.linear(strided, w, b), rtol=1e-5, atol=1e-5)
    empty = torch.empty(0, 12)
    assert lin(empty).shape == (0, 20) and gu.silu_mul(empty).shape == (0, 10)
    assert lin.plain_weight.data_ptr() == w.data_ptr()  # the plain weight is the caller's, not a copy


def test_an_odd_gate_up_is_refused_with_its_shape():
    with pytest.raises(ValueError, match="even number of rows, got 5"):
        PackedLinear(torch.randn(5, 4), None, LIB, gate_up=True)


def _model(monkeypatch, packed: bool) -> LlamaModel:
    monkeypatch.setenv("WEFT_PACKED_GEMM", "1" if packed else "0")
    config = ModelConfig.from_dict({**model_config_dict("tiny", "llama"), "num_hidden_layers": 2})
    return LlamaModel(config, random_weights(config, seed=2), backend_class("torch"), native_decode=True)


def test_a_model_packs_every_projection_and_the_wide_decode_step_reads_the_packed_copies(monkeypatch):
    model = _model(monkeypatch, packed=True)
    linears = [model.lm_head, *(getattr(lw, n) for lw in model.layers for n in ("qkv", "o", "gate_up", "down"))]
    assert all(isinstance(lin, PackedLinear) for lin in linears)
    decoder = model.native_decoder([torch.zeros(2, 4, 4, model.num_kv_heads, model.head_dim)
                                    for _ in model.layers])
    for name in ("qkv", "o", "gate_up", "down"):
        for i, lw in enumerate(model.layers):
            lin = getattr(lw, name)
            assert decoder._arrays[f"{name}_p"][i] == lin.packed.data_ptr(), name
            assert decoder._arrays[name][i] == lin.plain_weight.data_ptr(), name  # few-row steps stream it
    assert decoder._struct.lm_head_p == model.lm_head.packed.data_ptr()


def test_weft_packed_gemm_0_keeps_onednn_and_passes_no_packed_copy(monkeypatch):
    model = _model(monkeypatch, packed=False)
    assert isinstance(model.layers[0].qkv, OneDnnLinear) and not isinstance(model.layers[0].qkv, PackedLinear)
    decoder = model.native_decoder([torch.zeros(2, 4, 4, model.num_kv_heads, model.head_dim)
                                    for _ in model.layers])
    assert "qkv_p" not in decoder._arrays and not decoder._struct.lm_head_p and not decoder._struct.qkv_p


@pytest.mark.parametrize("rows", [3, 40])
def test_packed_and_onednn_models_agree(monkeypatch, rows):
    # the same weights through both back ends: a layer's products for `rows` tokens
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, model_config_dict("tiny", "llama")["hidden_size"], generator=gen)
    outs = []
    for packed in (True, False):
        model = _model(monkeypatch, packed)
        lw = model.layers[0]
        outs.append((lw.qkv(x), lw.down(lw.gate_up.silu_mul(x)), model.lm_head(x)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

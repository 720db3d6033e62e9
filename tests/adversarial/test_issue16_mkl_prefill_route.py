"""Issue 16, attacks on the seventh pass's long-prefill route (959c30a, 3b7f095):
model/linear.py's ``OneDnnLinear`` that keeps its plain weight sends 2-D inputs of
``MKL_MIN_ROWS`` (512) rows or more to MKL's sgemm (``F.linear`` on ``_mkl_weight``) on
Intel AVX-512 CPUs (``mkl_prefill_wins``), oneDNN's packed weight otherwise. (The same
pass's attention: test_issue16_avx512_attention.py.)

What is attacked, and what is expected (deterministic, no timing):

Exactly 511 / 512 / 513 rows take oneDNN / MKL / MKL and all give the
reference product; a non-contiguous 2-D input (a transposed view, a column slice) on
both routes; a 3-D input of 2 x 512 rows stays on oneDNN; ``_mkl_weight`` is the very
tensor (the same storage) as ``plain_weight`` and, in a model, the one the native
decoder streams (no third copy of the weights); a model without the native library
(``WEFT_NATIVE_DECODE=0``: no plain weight kept) never takes MKL, whatever the CPU;
``mkl_prefill_wins`` is False when /proc/cpuinfo cannot be read."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.executor.model import linear as linear_mod
from services.executor.model.linear import MKL_MIN_ROWS, OneDnnLinear, onednn_usable
from tests.adversarial.native_kernel_shim import pytestmark as native_only
from tests.adversarial.test_issue16_native_avx2_attacks import _model

onednn_only = pytest.mark.skipif(not onednn_usable(torch.device("cpu"), torch.float32),
                                 reason="this torch build has no oneDNN linear")


def _weights(out_features=48, in_features=40):
    g = torch.Generator().manual_seed(0)
    return torch.randn(out_features, in_features, generator=g) * 0.1, torch.randn(out_features, generator=g)


REF_LINEAR = F.linear  # the reference product, before any spy replaces F.linear


@pytest.fixture
def mkl_calls(monkeypatch):
    """Routes forced onto an MKL CPU; the row counts F.linear (MKL) saw."""
    monkeypatch.setattr(linear_mod, "mkl_prefill_wins", lambda: True)
    calls = []
    monkeypatch.setattr(linear_mod.F, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or REF_LINEAR(x, w, b))
    return calls


@onednn_only
def test_the_threshold_is_exactly_512_rows_and_both_sides_agree(mkl_calls):
    w, b = _weights()
    lin = OneDnnLinear(w, b, keep_plain=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MKL_MIN_ROWS + 1, w.shape[1], generator=g)
    outs = {}
    for rows in (MKL_MIN_ROWS - 1, MKL_MIN_ROWS, MKL_MIN_ROWS + 1):
        outs[rows] = lin(x[:rows])
        torch.testing.assert_close(outs[rows], REF_LINEAR(x[:rows], w, b), rtol=1e-5, atol=1e-5)
    assert mkl_calls == [MKL_MIN_ROWS, MKL_MIN_ROWS + 1]
    # a row's product does not depend on which side of the threshold its batch fell
    torch.testing.assert_close(outs[MKL_MIN_ROWS - 1], outs[MKL_MIN_ROWS][:-1], rtol=1e-5, atol=1e-6)


@onednn_only
def test_non_contiguous_and_three_dimensional_inputs_on_both_routes(mkl_calls):
    w, b = _weights()
    lin = OneDnnLinear(w, b, keep_plain=True)
    g = torch.Generator().manual_seed(2)
    ref = REF_LINEAR
    for rows in (MKL_MIN_ROWS - 1, MKL_MIN_ROWS + 7):
        wide = torch.randn(rows, 2 * w.shape[1] + 3, generator=g)
        for x in (wide[:, 3:3 + w.shape[1]], torch.randn(w.shape[1], rows, generator=g).T, wide[:, ::2][:, :40]):
            assert not x.is_contiguous()
            torch.testing.assert_close(lin(x), ref(x.contiguous(), w, b), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rows={rows} strides={x.stride()}: {m}")
    assert mkl_calls == [MKL_MIN_ROWS + 7] * 3
    mkl_calls.clear()
    x3 = torch.randn(2, MKL_MIN_ROWS, w.shape[1], generator=g)  # 1,024 rows in 3-D: oneDNN, shape kept
    y3 = lin(x3)
    assert y3.shape == (2, MKL_MIN_ROWS, w.shape[0]) and mkl_calls == []
    torch.testing.assert_close(y3, ref(x3, w, b), rtol=1e-5, atol=1e-5)


@onednn_only
def test_the_mkl_weight_is_the_plain_weight_not_a_copy(monkeypatch):
    monkeypatch.setattr(linear_mod, "mkl_prefill_wins", lambda: True)
    w, b = _weights()
    lin = OneDnnLinear(w, b, keep_plain=True)
    assert lin._mkl_weight is lin.plain_weight and lin.plain_weight.data_ptr() == w.data_ptr()
    assert OneDnnLinear(w, b, keep_plain=False)._mkl_weight is None


@native_only
@onednn_only
def test_a_models_mkl_weights_are_the_ones_the_native_step_streams(monkeypatch):
    # one row-major copy of every weight, shared by the native decode and long prefills
    # (an MKL CPU has AVX-512, where native/gemm.c's packed linears are never made)
    monkeypatch.setattr(linear_mod, "mkl_prefill_wins", lambda: True)
    monkeypatch.setenv("WEFT_PACKED_GEMM", "0")
    model = _model({"head_dim": 8, "hidden_size": 16, "intermediate_size": 24, "vocab_size": 31})
    assert model.use_onednn
    decoder = model.native_decoder([torch.zeros(2, 2, 4, model.num_kv_heads, model.head_dim)])
    streamed = decoder._arrays
    for name in ("qkv", "o", "gate_up", "down"):
        lin = getattr(model.layers[0], name)
        assert lin._mkl_weight is not None and lin._mkl_weight.data_ptr() == streamed[name][0], name
    assert model.lm_head._mkl_weight is not None
    assert model.lm_head._mkl_weight.data_ptr() == decoder._struct.lm_head


@onednn_only
def test_without_the_native_library_no_linear_takes_mkl(monkeypatch):
    # WEFT_NATIVE_DECODE=0 (or a build failure): no plain weight is kept, so even on an MKL
    # CPU every long prefill stays on oneDNN's packed weight
    from services.executor.attention.selector import backend_class
    from services.executor.model.config import ModelConfig
    from services.executor.model.llama import LlamaModel
    from weft.testing.tiny_model import model_config_dict, random_weights

    monkeypatch.setattr(linear_mod, "mkl_prefill_wins", lambda: True)
    monkeypatch.setenv("WEFT_NATIVE_DECODE", "0")
    config = ModelConfig.from_dict({**model_config_dict("tiny", "llama"), "num_hidden_layers": 1})
    model = LlamaModel(config, random_weights(config, seed=1), backend_class("torch"))
    assert model.use_onednn and model.native_decoder([]) is None
    linears = [model.lm_head, *(getattr(model.layers[0], n) for n in ("qkv", "o", "gate_up", "down"))]
    assert all(lin._mkl_weight is None and lin.plain_weight is None for lin in linears)


def test_mkl_is_not_chosen_when_cpuinfo_cannot_be_read(monkeypatch):
    class Unreadable:
        def __init__(self, _path):
            pass

        def read_text(self):
            raise PermissionError("/proc/cpuinfo")

    linear_mod.mkl_prefill_wins.cache_clear()
    try:
        monkeypatch.setattr(linear_mod, "Path", Unreadable)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        assert linear_mod.mkl_prefill_wins() is False
    finally:
        linear_mod.mkl_prefill_wins.cache_clear()

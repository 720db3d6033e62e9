"""A oneDNN linear hands long prefills to MKL when it kept its plain weight and the CPU is
one where MKL was measured ahead, and gives the same product either way
(services/executor/model/linear.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.executor.model import linear as linear_mod
from services.executor.model.linear import MKL_MIN_ROWS, OneDnnLinear, onednn_usable

pytestmark = pytest.mark.skipif(
    not onednn_usable(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN linear"
)


def _weights(out_features=48, in_features=40, bias=True):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g) * 0.1
    b = torch.randn(out_features, generator=g) if bias else None
    return w, b


@pytest.fixture(params=[True, False], ids=["mkl-cpu", "other-cpu"])
def mkl_cpu(request, monkeypatch):
    monkeypatch.setattr(linear_mod, "mkl_prefill_wins", lambda: request.param)
    return request.param


@pytest.mark.parametrize("rows", [1, 16, MKL_MIN_ROWS - 1, MKL_MIN_ROWS, 2 * MKL_MIN_ROWS + 3])
@pytest.mark.parametrize("keep_plain", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_gives_the_reference_product(rows, keep_plain, bias, mkl_cpu):
    w, b = _weights(bias=bias)
    lin = OneDnnLinear(w, b, keep_plain=keep_plain)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_long_inputs_go_to_mkl_only_with_a_plain_weight_on_an_mkl_cpu(monkeypatch, mkl_cpu):
    calls = []
    real_linear = F.linear

    def spy(x, w, b=None):
        calls.append(x.shape[0])
        return real_linear(x, w, b)

    monkeypatch.setattr(linear_mod.F, "linear", spy)
    w, b = _weights()
    kept, packed_only = OneDnnLinear(w, b, keep_plain=True), OneDnnLinear(w, b)
    long_x, short_x = torch.randn(MKL_MIN_ROWS, w.shape[1]), torch.randn(MKL_MIN_ROWS - 1, w.shape[1])
    kept(long_x)
    kept(short_x)
    packed_only(long_x)
    # only the long input with a kept plain weight, and only where MKL was measured ahead
    assert calls == ([MKL_MIN_ROWS] if mkl_cpu else [])


def test_mkl_is_chosen_only_on_intel_avx512(monkeypatch, tmp_path):
    linear_mod.mkl_prefill_wins.cache_clear()
    try:
        for vendor, capability, expected in [("GenuineIntel", "AVX512", True), ("GenuineIntel", "AVX2", False),
                                             ("AuthenticAMD", "AVX512", False), ("AuthenticAMD", "AVX2", False)]:
            cpuinfo = tmp_path / vendor
            cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\n")
            monkeypatch.setattr(linear_mod, "Path", lambda _p, f=cpuinfo: f)
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
            linear_mod.mkl_prefill_wins.cache_clear()
            assert linear_mod.mkl_prefill_wins() is expected, (vendor, capability)
    finally:
        linear_mod.mkl_prefill_wins.cache_clear()


def test_a_three_dimensional_input_keeps_its_shape(mkl_cpu):
    w, b = _weights()
    lin = OneDnnLinear(w, b, keep_plain=True)
    x = torch.randn(2, MKL_MIN_ROWS, w.shape[1])
    y = lin(x)
    assert y.shape == (2, MKL_MIN_ROWS, w.shape[0])
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)

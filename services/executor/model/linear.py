"""Matmul back ends for the model's projections.

On a CPU, torch's default fp32 ``F.linear`` runs these decode-shaped matmuls (a handful
of rows against a large weight) on one MKL thread whatever ``torch.set_num_threads``
says. oneDNN's linear with the weight reordered once at load (for a 16-row batch,
which also serves 1 row and long prefills well) uses every thread: on the 2-core
machines the model's matmuls take 8.9 ms instead of 27 ms at 16 rows, 6.4 instead of
8.6 at one row, and no longer at 512 rows (``benchmarks/results/offline_throughput.md``).

``plain_weight`` is the row-major weight the native batch-1 decode step streams
(model/native/): the plain linear's own weight, or, for oneDNN, a copy kept beside the
packed one when the model asks for it (``keep_plain``; the packed layout is oneDNN's own).

Long prefills on an Intel AVX-512 CPU are the other way round: from ``MKL_MIN_ROWS`` rows
up, MKL's sgemm (torch's ``F.linear`` on the plain weight, every thread at that size) beats
oneDNN on the 16-row layout, most on the MLP's wide products (gate_up / down on SmolLM2 at
2,048 rows on a Sapphire Rapids: ~190 against ~177 GFLOPS, the whole prefill forward
1.03-1.07x; equal at 256-1,024 rows; docs/architecture.md, "Seventh pass"). So there a
oneDNN linear that keeps its plain weight hands such calls to MKL. On the AVX2 Zen 2
machines MKL read 128-150 GFLOPS against oneDNN's 150-167 ("Sixth pass"): elsewhere
(``mkl_prefill_wins`` false) every call stays on oneDNN.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F


class Linear:
    """``y = x @ W.T + b`` with the weight held in the layout its back end wants."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.num_bytes = weight.numel() * weight.element_size() + (
            bias.numel() * bias.element_size() if bias is not None else 0
        )
        self.weight = weight  # [out_features, in_features]
        self.bias = bias  # [out_features]
        self.plain_weight: torch.Tensor | None = weight  # [out_features, in_features] row-major

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        return F.linear(x, self.weight, self.bias)


_PACK_ROWS = 16  # the batch size oneDNN lays the weight out for
MKL_MIN_ROWS = 512  # from here up a kept plain weight goes through MKL's sgemm instead


@functools.cache
def mkl_prefill_wins() -> bool:
    """True on an Intel CPU whose torch kernels run AVX-512: where MKL was measured ahead."""
    try:
        intel = "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return intel and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


class OneDnnLinear(Linear):
    """fp32 CPU linear through oneDNN with the weight reordered once at load."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_plain: bool = False) -> None:
        super().__init__(weight, bias)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
        self.plain_weight = weight.contiguous() if keep_plain else None
        self._mkl_weight = self.plain_weight if mkl_prefill_wins() else None  # long inputs' route

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's case: no reshape ops on the hot path
            if x.shape[0] >= MKL_MIN_ROWS and self._mkl_weight is not None:
                return F.linear(x, self._mkl_weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.weight, self.bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, use_onednn: bool, keep_plain: bool = False) -> Linear:
    return OneDnnLinear(weight, bias, keep_plain) if use_onednn else Linear(weight, bias)

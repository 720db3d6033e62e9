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

On AVX2 CPUs without AVX-512 (the AMD Zen boxes) every projection is a ``PackedLinear``
instead (when the native library is built, ``WEFT_PACKED_GEMM`` not 0): native/gemm.c's
outer-product GEMM over a copy packed in panels of 16 outputs, in place of oneDNN's copy
(the same memory), with the plain weight beside it for the native steps of a few rows. It
read 123-151 GFLOPS at 16 rows where oneDNN read 92-105, and 144-153 at 2,048 rows against
132-139 (2 threads, Zen 3); the native multi-row decode step reads the same packed copies
past 6 rows (docs/architecture.md, "Thirteenth pass").
"""
from __future__ import annotations

import functools
import os
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

    def add_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # out [rows, out] += self(x)
        """The residual add ``out += x @ W.T + b``, in place in ``out``: the same sum as
        ``out + self(x)`` (the product rounds first, then the add)."""
        return out.add_(self(x))

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out // 2]
        """For gate_up (gate rows, then up rows): ``silu(x @ gate.T) * (x @ up.T)``."""
        gate_up = self(x)
        inter = self.out_features // 2
        return F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])


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


class PackedLinear(Linear):
    """fp32 CPU linear through native/gemm.c over the weight packed in panels of 16
    (native/gemm_packed.h), the plain row-major weight kept beside it for the native
    decode steps of a few rows. Made only where the native library says the packed GEMM
    is built (AVX2 without AVX-512; make_linear). ``gate_up``: the two halves' panels are
    interleaved and ``silu_mul`` gives the activation in one pass (``__call__`` on such a
    linear falls back to torch on the plain weight)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib, gate_up: bool = False) -> None:
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
                raise ValueError(f"the packed GEMM needs a float32 CPU {name}, got {t.dtype} on {t.device}")
        super().__init__(weight, bias)
        n, k = weight.shape
        plain = weight.contiguous()
        self.plain_weight = plain
        self._lib = lib
        self._gate_up = gate_up
        if gate_up:
            if n % 2:
                raise ValueError(f"gate_up needs an even number of rows, got {n}")
            self.packed = torch.empty(((n // 2 + 7) // 8) * k * 16, dtype=torch.float32)
            lib.weft_pack_gate_up(plain.data_ptr(), n // 2, k, self.packed.data_ptr())
        else:
            self.packed = torch.empty(((n + 15) // 16) * k * 16, dtype=torch.float32)
            lib.weft_pack_panels(plain.data_ptr(), n, k, self.packed.data_ptr())
        self.weight = plain
        self.bias = bias.contiguous() if bias is not None else None

    def _torch_route(self, x: torch.Tensor) -> bool:
        """Inputs the kernel does not take (torch's linear serves or refuses them): other
        dtypes or devices, no input features (the product is the bias)."""
        return x.dtype != torch.float32 or x.device.type != "cpu" or self.in_features == 0

    def _rows(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> contiguous [rows, in]
        x2 = x.reshape(-1, self.in_features)
        return x2 if x2.is_contiguous() else x2.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up or self._torch_route(x):
            return F.linear(x, self.plain_weight, self.bias)
        shape, x2 = x.shape, self._rows(x)
        rows = x2.shape[0]
        y = torch.empty((rows, self.out_features), dtype=torch.float32)
        if rows:
            self._lib.weft_gemm_packed(self.packed.data_ptr(), self.bias.data_ptr() if self.bias is not None else None,
                                       x2.data_ptr(), self.in_features, y.data_ptr(), self.out_features,
                                       self.out_features, self.in_features, rows, 0, torch.get_num_threads())
        return y.view(*shape[:-1], self.out_features)

    def add_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The kernel's own epilogue adds the finished product to ``out`` (one pass, no
        temporary): the same two roundings as ``out + self(x)``."""
        if (self._gate_up or self._torch_route(x) or out.dtype != torch.float32 or out.device.type != "cpu"
                or not out.is_contiguous() or out.shape != (*x.shape[:-1], self.out_features)
                or x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()):
            # (x in out's memory: the kernel would read inputs it has already overwritten)
            return super().add_into(x, out)
        x2 = self._rows(x)
        if x2.shape[0]:
            self._lib.weft_gemm_packed(self.packed.data_ptr(), self.bias.data_ptr() if self.bias is not None else None,
                                       x2.data_ptr(), self.in_features, out.data_ptr(), self.out_features,
                                       self.out_features, self.in_features, x2.shape[0], 1, torch.get_num_threads())
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not self._gate_up or self.bias is not None or self._torch_route(x):  # (the kernel adds no bias)
            return super().silu_mul(x)
        shape, x2 = x.shape, self._rows(x)
        rows, inter = x2.shape[0], self.out_features // 2
        act = torch.empty((rows, inter), dtype=torch.float32)
        if rows:
            self._lib.weft_gate_up_packed(self.packed.data_ptr(), x2.data_ptr(), self.in_features, act.data_ptr(),
                                          inter, inter, self.in_features, rows, torch.get_num_threads())
        return act.view(*shape[:-1], inter)


def packed_usable(lib, environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """Whether ``lib`` (the native library, or None) has the packed GEMM built and
    ``WEFT_PACKED_GEMM`` does not turn it off (0/false/off/no: oneDNN as before)."""
    if environ.get("WEFT_PACKED_GEMM", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return lib is not None and bool(lib.weft_gemm_packed_available())


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, use_onednn: bool, keep_plain: bool = False,
                packed_lib=None, gate_up: bool = False) -> Linear:
    """The linear for one projection: packed (native/gemm.c) where ``packed_lib`` is given
    (the native library on a CPU where ``packed_usable``), else oneDNN where usable, else
    torch's. ``gate_up``: the projection is gate rows then up rows (``silu_mul``)."""
    if packed_lib is not None and weight.dtype == torch.float32 and weight.device.type == "cpu":
        return PackedLinear(weight, bias, packed_lib, gate_up=gate_up)
    return OneDnnLinear(weight, bias, keep_plain) if use_onednn else Linear(weight, bias)

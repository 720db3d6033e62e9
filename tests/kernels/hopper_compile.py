"""Compile every kernel for Hopper (sm_90) through its real launcher, without a GPU.

The interpreter runs the kernels' arithmetic but not Triton's compiler, so it misses what
only compiled code rejects (a non-constexpr global, a dot shape a tensor core refuses, a
bf16 path the interpreter never runs). This script swaps in a driver that reports an
sm_90 target and makes every launch a compile-only ``warmup``, then calls the public
launchers with CPU tensors in the GPU configuration (bf16 / fp16 / fp32 / int8, head dims
64 and 128, GQA groups 1 to 8, split-K on and off). ptxas from Triton's own wheel does
the final step, so no CUDA toolkit is needed.

    python -m tests.kernels.hopper_compile      # TRITON_INTERPRET must be unset

Prints one line per compiled kernel (registers, shared memory, spill stack); exits
non-zero on the first failure. Used by test_compiles_for_hopper.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

HOPPER = GPUTarget("cuda", 90, 32)


class CompileOnlyDriver:
    """The slice of Triton's active-driver interface that compiling needs."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return HOPPER

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _resource_usage(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                              capture_output=True, text=True).stdout
    lines = [line.strip() for line in text.splitlines() if "REG:" in line]
    return " ".join(lines[0].split()[:4]) if lines else ""


def install_compile_only() -> list[str]:
    """Route every kernel launch to a compile for HOPPER; returns the growing report."""
    triton.runtime.driver.set_active(CompileOnlyDriver())
    report: list[str] = []
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        report.append(f"{self.fn.__name__:24s} warps={kernel.metadata.num_warps} "
                      f"shared={kernel.metadata.shared:6d} {_resource_usage(kernel.asm['cubin'])}")
        print(report[-1], flush=True)
        return kernel

    JITFunction.run = compile_only
    return report


def compile_all() -> None:
    from kernels.kv_cache_write import write_kv_cache
    from kernels.kv_int8 import dequantize_kv_blocks, paged_decode_attention_int8, quantize_kv_blocks
    from kernels.kv_int8_token import (
        paged_decode_attention_int8_token,
        paged_prefill_attention_int8_token,
        write_kv_cache_int8,
    )
    from kernels.paged_decode import is_interpreted, paged_decode_attention
    from kernels.paged_prefill import paged_prefill_attention

    assert not is_interpreted(), "unset TRITON_INTERPRET: this compiles, it does not interpret"
    batch, block_size, num_blocks = 2, 16, 8
    # (dtype, num_heads, num_kv_heads, head_dim): the production shapes and GQA groups.
    shapes = [
        (torch.bfloat16, 32, 8, 128),
        (torch.float16, 32, 8, 128),
        (torch.float32, 32, 8, 128),
        (torch.bfloat16, 32, 32, 64),
        (torch.bfloat16, 64, 8, 128),
    ]
    for dtype, num_heads, num_kv_heads, head_dim in shapes:
        print(f"-- {dtype} H={num_heads} KVH={num_kv_heads} D={head_dim}", flush=True)
        kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        q = torch.zeros(batch, num_heads, head_dim, dtype=dtype)
        kv = torch.zeros(batch, num_kv_heads, head_dim, dtype=dtype)
        block_tables = torch.zeros(batch, 4, dtype=torch.int32)
        lens = torch.zeros(batch, dtype=torch.int32)
        starts = torch.zeros(batch + 1, dtype=torch.int32)
        for num_splits in (1, 4):
            paged_decode_attention(q, kv_cache, block_tables, lens, 0.1, num_splits=num_splits)
        paged_prefill_attention(q, kv_cache, block_tables, starts, lens, lens, 0.1)
        write_kv_cache(kv, kv, kv_cache, torch.zeros(batch, dtype=torch.int64))
        if dtype != torch.float32 and num_heads == 32 and num_kv_heads == 8:
            cache_int8 = torch.zeros(kv_cache.shape, dtype=torch.int8)
            scales = torch.zeros(2, num_blocks, num_kv_heads)
            quantize_kv_blocks(kv_cache, lens, cache_int8, scales)
            dequantize_kv_blocks(cache_int8, scales, lens, kv_cache)
            paged_decode_attention_int8(q, cache_int8, scales, block_tables, lens, 0.1, num_splits=4)
        if num_heads == 32 and num_kv_heads == 8:  # the per-token int8 cache (QuantizedKVCache)
            data = torch.zeros(kv_cache.shape, dtype=torch.int8)
            token_scales = torch.zeros(kv_cache.shape[:4])
            write_kv_cache_int8(kv, kv, data, token_scales, torch.zeros(batch, dtype=torch.int64))
            for num_splits in (1, 4):
                paged_decode_attention_int8_token(q, data, token_scales, block_tables, lens, 0.1,
                                                  num_splits=num_splits)
            paged_prefill_attention_int8_token(q, data, token_scales, block_tables, starts, lens, lens, 0.1)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1 is set: unset it to compile", file=sys.stderr)
        return 2
    report = install_compile_only()
    compile_all()
    print(f"compiled {len(report)} kernels for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())

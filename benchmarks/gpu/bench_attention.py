"""Paged decode attention on a GPU: achieved K/V read bandwidth against the device's peak.

For every batch x context size, one decode step (one query token per sequence, every
sequence at that context length) over a paged bf16 cache with shuffled block ids:

  triton auto     kernels.paged_decode with the split-K heuristic's choice
  triton 1 split  the same kernel without split-K (shows what splitting buys)
  torch ref       kernels.reference.ref_paged_decode_attention (the baseline)

A second, short table compares the int8 KV cache the executor runs with
kv_cache_dtype=int8 (one fp32 scale per token and KV head, kernels.kv_int8_token) with the
bf16 cache on the same data, at --int8-batches x --int8-contexts (default 64 x 4k, 16k):
both times and both achieved bandwidths (int8 bytes: K/V data plus their scales).

Bandwidth counts the bytes a decode step must read or write once (K and V of every
context token, q, out, block tables) over the measured time, and is compared with the
device's peak memory bandwidth (table below, or --peak-tbps). Times are medians of
triton.testing.do_bench (L2 flushed between runs) on CUDA.

--smoke runs one tiny size on CPU under the Triton interpreter, in fp32, to check that
the script runs at all; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Peak memory bandwidth in TB/s by a substring of torch.cuda.get_device_name(); the
# first match wins, so more specific names come first. Vendor datasheet figures.
PEAK_TBPS: list[tuple[str, float]] = [
    ("GH200", 4.0),
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),
    ("H800", 3.35),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),
    ("L40S", 0.864),
    ("L4", 0.3),
    ("A10G", 0.6),
    ("RTX 4090", 1.008),
]
DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64",
                   help="comma-separated batch sizes (sequences per decode step); default 1,8,64")
    p.add_argument("--contexts", default="1024,4096,16384,32768",
                   help="comma-separated context lengths in tokens; default 1024,4096,16384,32768")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="cache and query dtype; default bfloat16")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension; default 128")
    p.add_argument("--num-heads", type=int, default=32, help="query heads; default 32")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (GQA); default 8")
    p.add_argument("--block-size", type=int, default=16, help="tokens per cache block; default 16")
    p.add_argument("--peak-tbps", type=float, default=None,
                   help="device peak memory bandwidth in TB/s; default: looked up by device name "
                        "(H200 4.8, H100 SXM 3.35, ...), 'n/a' for an unknown device")
    p.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up time per measurement; default 25")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per measurement; default 100")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the torch reference timing (it is the slowest part of the run)")
    p.add_argument("--seed", type=int, default=0, help="random seed for the cache, queries and block order")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the Markdown section to this file (it is always printed)")
    p.add_argument("--int8-batches", default="64",
                   help="batch sizes of the int8 vs bf16 table; default 64 ('' skips the table)")
    p.add_argument("--int8-contexts", default="4096,16384",
                   help="context lengths of the int8 vs bf16 table; default 4096,16384")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny fp32 size on CPU under the Triton interpreter: checks the script runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.contexts, args.dtype = "2", "600", "float32"  # 600: split-K kicks in
        args.int8_batches, args.int8_contexts = "2", "600"
        args.head_dim, args.num_heads, args.num_kv_heads = 32, 4, 2
    return args


def peak_tbps(device_name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    for key, tbps in PEAK_TBPS:
        if key in device_name:
            return tbps
    return None


def make_timer(device, warmup_ms: int, rep_ms: int):
    """fn -> seconds per call: do_bench's median on CUDA, one wall-clock call elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        def time_cuda(fn) -> float:
            try:
                ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
            except TypeError:  # a Triton without return_mode
                ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms)
            return ms / 1e3
        return time_cuda

    def time_cpu(fn) -> float:
        fn()  # warm-up (interpreter set-up)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return time_cpu


def decode_inputs(args, torch, device, dtype, batch: int, context: int):
    """(kv_cache, block_tables, seq_lens, q): every sequence at ``context`` tokens,
    shuffled block ids."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, args.block_size, args.num_kv_heads, args.head_dim,
                           generator=gen, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_tables = block_tables.reshape(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, args.num_heads, args.head_dim, generator=gen, device=device, dtype=dtype)
    return kv_cache, block_tables, seq_lens, q


def bench_size(args, torch, device, dtype, batch: int, context: int, timer) -> dict:
    from kernels.paged_decode import choose_num_splits, num_sms, paged_decode_attention
    from kernels.reference import ref_paged_decode_attention

    kv_cache, block_tables, seq_lens, q = decode_inputs(args, torch, device, dtype, batch, context)
    blocks_per_seq = block_tables.shape[1]
    out = torch.empty_like(q)
    scale = args.head_dim ** -0.5

    elem = kv_cache.element_size()
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * elem
    other_bytes = 2 * q.numel() * elem + block_tables.numel() * 4 + seq_lens.numel() * 4
    splits = choose_num_splits(batch, args.num_kv_heads, blocks_per_seq * args.block_size, num_sms(device))

    row = {"batch": batch, "context": context, "splits": splits, "bytes": kv_bytes + other_bytes}
    row["auto_s"] = timer(lambda: paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, out=out))
    row["one_s"] = (row["auto_s"] if splits == 1 else timer(
        lambda: paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, num_splits=1, out=out)))
    row["ref_s"] = None if args.no_baseline else timer(
        lambda: ref_paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale))
    # Correctness guard: a fast wrong kernel must not produce a table.
    expected = ref_paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale)
    got = paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    return row


def bench_int8_size(args, torch, device, dtype, batch: int, context: int, timer) -> dict:
    """The same decode step over the model-dtype cache and over its per-token int8 copy."""
    from kernels.kv_int8_token import paged_decode_attention_int8_token
    from kernels.paged_decode import paged_decode_attention
    from kernels.reference import ref_paged_decode_attention_int8_token
    from services.executor.attention.base import quantize_int8

    kv_cache, block_tables, seq_lens, q = decode_inputs(args, torch, device, dtype, batch, context)
    kv_data, kv_scales = quantize_int8(kv_cache)  # [2, NB, BS, KVH, D] int8, [2, NB, BS, KVH] fp32
    out = torch.empty_like(q)
    scale = args.head_dim ** -0.5
    tokens = 2 * batch * context * args.num_kv_heads  # K and V rows read
    other_bytes = 2 * q.numel() * q.element_size() + block_tables.numel() * 4 + seq_lens.numel() * 4
    row = {"batch": batch, "context": context,
           "fp_bytes": tokens * args.head_dim * kv_cache.element_size() + other_bytes,
           "int8_bytes": tokens * (args.head_dim + kv_scales.element_size()) + other_bytes}
    row["fp_s"] = timer(lambda: paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, out=out))
    row["int8_s"] = timer(lambda: paged_decode_attention_int8_token(
        q, kv_data, kv_scales, block_tables, seq_lens, scale, out=out))
    expected = ref_paged_decode_attention_int8_token(q, kv_data, kv_scales, block_tables, seq_lens, scale)
    got = paged_decode_attention_int8_token(q, kv_data, kv_scales, block_tables, seq_lens, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    return row


def render_int8(rows: list[dict], args, peak: float | None) -> str:
    from benchmarks.report import write_markdown

    table = []
    for r in rows:
        fp_gbps, int8_gbps = r["fp_bytes"] / r["fp_s"] / 1e9, r["int8_bytes"] / r["int8_s"] / 1e9
        table.append([
            r["batch"], f"{r['context']:,}", f"{r['fp_s'] * 1e6:,.1f}", f"{fp_gbps:,.0f}",
            f"{r['int8_s'] * 1e6:,.1f}", f"{int8_gbps:,.0f}",
            "n/a" if peak is None else f"{100 * int8_gbps / (peak * 1e3):.0f} %",
            f"{r['fp_s'] / r['int8_s']:.2f}×",
        ])
    headers = ["batch", "context", f"{args.dtype} µs", f"{args.dtype} GB/s", "int8 µs", "int8 GB/s",
               "int8 % of peak", "int8 speed-up"]
    return "\n".join([
        "## Paged decode attention, int8 KV cache (per-token scales)",
        "",
        f"The executor's kv_cache_dtype=int8 cache (int8 K/V, one fp32 scale per token and KV "
        f"head; kernels/kv_int8_token.py) against the {args.dtype} cache it quantises, split-K "
        "heuristic on both. int8 GB/s counts int8 K/V + scales + q + out + block tables.",
        "",
        write_markdown(headers, table),
        "",
    ])


def render(rows: list[dict], args, device_name: str, peak: float | None) -> str:
    from benchmarks.report import write_markdown

    def us(s):
        return "—" if s is None else f"{s * 1e6:,.1f}"

    table = []
    for r in rows:
        gbps = r["bytes"] / r["auto_s"] / 1e9
        table.append([
            r["batch"], f"{r['context']:,}", r["splits"], us(r["auto_s"]), f"{gbps:,.0f}",
            "n/a" if peak is None else f"{100 * gbps / (peak * 1e3):.0f} %",
            us(r["one_s"]), us(r["ref_s"]),
            "—" if r["ref_s"] is None else f"{r['ref_s'] / r['auto_s']:.1f}×",
        ])
    headers = ["batch", "context", "splits (auto)", "triton µs", "GB/s", "% of peak",
               "triton 1 split µs", "torch ref µs", "speed-up vs torch"]
    peak_text = "unknown (pass --peak-tbps)" if peak is None else f"{peak} TB/s"
    return "\n".join([
        "## Paged decode attention",
        "",
        f"Device: {device_name}; peak memory bandwidth {peak_text}. {args.dtype}, head_dim "
        f"{args.head_dim}, {args.num_heads} query / {args.num_kv_heads} KV heads, block "
        f"{args.block_size}, shuffled block ids. GB/s counts K/V + q + out + block tables once "
        "per step; split-K partials are overhead, not counted.",
        "",
        write_markdown(headers, table),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    from tqdm.auto import tqdm

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke to check the script on CPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    peak = peak_tbps(device_name, args.peak_tbps) if device.type == "cuda" else args.peak_tbps
    timer = make_timer(device, args.warmup_ms, args.rep_ms)

    sizes = [(int(b), int(c)) for b in args.batches.split(",") for c in args.contexts.split(",")]
    rows = []
    for batch, context in tqdm(sizes, desc="decode attention", unit="size"):
        rows.append(bench_size(args, torch, device, dtype, batch, context, timer))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = render(rows, args, device_name, peak)
    int8_sizes = [(int(b), int(c)) for b in args.int8_batches.split(",") if b
                  for c in args.int8_contexts.split(",") if c]
    if int8_sizes:
        int8_rows = []
        for batch, context in tqdm(int8_sizes, desc="int8 decode attention", unit="size"):
            int8_rows.append(bench_int8_size(args, torch, device, dtype, batch, context, timer))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        text += "\n" + render_int8(int8_rows, args, peak)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end decode throughput of a ~1B-parameter random-weight Llama through weft.LLM.

Writes a Hugging Face Llama checkpoint (config.json + model.safetensors, bf16 random
weights: hidden 2048, 16 layers, 32 query / 8 KV heads, intermediate 5632, vocab 32000,
about 0.85B parameters) into --model-dir, with the tokenizer files of a tiny checkpoint
from weft.testing.tiny_model (random_llama.py), unless that directory already holds the same
config. Then, for each batch size, runs greedy generation with EOS ignored:

  prefill   generate(prompts, max_tokens=1)          prompt processing + 1 token
  full      generate(prompts, max_tokens=N)          the same + N-1 decode steps
  decode tokens/s = batch * (N - 1) / (full - prefill)

and reports decode tokens/s, ms per decode step, and the weight bytes read per second
(every step reads every weight once) against the device's peak memory bandwidth. The
baseline, measured the same way in the same run, is Hugging Face transformers
`generate` (static batch, greedy, same checkpoint and dtype); the table gives Weft's
decode tokens/s as a ratio to it, and how many of the first prompt's greedy tokens the
two agree on (bf16 rounding may split them late in a random-weight model).

--smoke writes a tiny checkpoint and runs it on CPU (Triton interpreter for the triton
back end) to check that the script runs at all; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.bench_attention import peak_tbps  # noqa: E402
from benchmarks.gpu.random_llama import BENCH_1B, SMOKE, write_checkpoint  # noqa: E402

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "weft-bench-llama-1b",
                   help="where the checkpoint is written, or reused when its config matches; "
                        "default: <tmp>/weft-bench-llama-1b")
    p.add_argument("--batches", default="1,64", help="comma-separated batch sizes; default 1,64")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request; default 128")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request; default 128")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="weights and KV cache dtype; default bfloat16")
    p.add_argument("--attention-backend", default="triton", choices=("triton", "torch", "auto"),
                   help="weft attention back end; default triton")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size; default 16")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"),
                   help="weft KV cache storage (int8: the kv_int8 rung's cache); default auto (= --dtype)")
    p.add_argument("--kv-compress-budget-blocks", type=int, default=0,
                   help="weft KV compression budget per sequence in blocks (the kv_compress rung); "
                        "default 0 (off)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="engine token budget per step; default 4096")
    p.add_argument("--peak-tbps", type=float, default=None,
                   help="device peak memory bandwidth in TB/s; default: looked up by device name")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the Hugging Face transformers generate baseline")
    p.add_argument("--no-eager", action="store_true",
                   help="skip the eager run (the same engine without cuda_graphs)")
    p.add_argument("--profile", type=Path, default=None,
                   help="after the rounds, profile one run of the graphs engine per batch size "
                        "(cProfile, by own time) into this file")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed rounds per run after its warm-up, in rotating order; the median is "
                        "reported with the range; default 3")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the Markdown section to this file (it is always printed)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model on CPU, fp32, batches 1,2, 8-token prompts, 4 new tokens")
    args = p.parse_args(argv)
    args.shape = BENCH_1B
    if args.smoke:
        args.shape, args.batches, args.prompt_len, args.max_tokens = SMOKE, "1,2", 8, 4
        args.dtype = "float32"
        if args.model_dir == p.get_default("model_dir"):
            args.model_dir = Path(tempfile.gettempdir()) / "weft-bench-llama-smoke"
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (decode time is full minus prefill)")
    return args


def engine_options(args, torch, device: str, max_batch: int) -> dict:
    """LLM(...) options; the KV budget fits every sequence of the biggest batch."""
    shape = args.shape
    tokens = max_batch * (args.prompt_len + args.max_tokens + args.block_size)
    bytes_per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim \
        * torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    options = {
        "device": device, "dtype": args.dtype, "attention_backend": args.attention_backend,
        "block_size": args.block_size, "max_num_seqs": max_batch,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_bytes": int(tokens * bytes_per_token * 1.25),
        "max_prefill_chunk": min(512, args.max_num_batched_tokens),
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_compress_budget_blocks": args.kv_compress_budget_blocks,
    }
    try:  # pass only what this engine version knows
        from dataclasses import fields

        from services.executor.engine.config import EngineConfig

        known = {f.name for f in fields(EngineConfig)}
        options = {k: v for k, v in options.items() if k in known}
    except ImportError:
        pass
    return options


def measure(generate, batch: int, args, torch, gen) -> dict:
    """One round: time generate(prompts, max_tokens) the prefill/full way described above,
    on fresh prompts (no run gets an earlier one's prefix-cache hits)."""
    last: list[list[int]] = []

    def timed(max_tokens: int) -> float:
        # Ids start above the special tokens; the tokenizer's vocab matches the model's.
        prompts = torch.randint(10, args.shape.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = generate(prompts, max_tokens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        assert all(len(o) == max_tokens for o in outputs), "EOS was not ignored"
        last[:] = [prompts[0], outputs[0]]
        return elapsed

    prefill_s = timed(1)
    full_s = timed(args.max_tokens)
    decode_s = max(full_s - prefill_s, 1e-9)
    return {"batch": batch, "prefill_s": prefill_s, "full_s": full_s,
            "decode_tps": batch * (args.max_tokens - 1) / decode_s,
            "step_ms": 1e3 * decode_s / (args.max_tokens - 1),
            "first_prompt": last[0], "first_output": last[1]}


def measure_alternating(generators: dict, batch: int, args, torch, progress) -> dict[str, dict]:
    """Each configuration warmed up once, then ``args.rounds`` rounds, the order rotated
    every round so no configuration always runs first; per configuration the median round
    (by decode tokens/s) with the range of decode tokens/s."""
    gen = torch.Generator().manual_seed(args.seed + batch)
    names = list(generators)
    for name in names:  # warm-up: kernels compiled, allocator primed, graphs replayed once
        generators[name]([[11] * args.prompt_len] * batch, 2)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(measure(generators[name], batch, args, torch, gen))
            progress.update(1)
    out = {}
    for name, rs in runs.items():
        rs.sort(key=lambda x: x["decode_tps"])
        row = dict(rs[len(rs) // 2])
        row["tps_range"] = (rs[0]["decode_tps"], rs[-1]["decode_tps"])
        row["rounds"] = len(rs)
        out[name] = row
    return out


def weft_generate(llm, SamplingParams):
    def generate(prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return generate


def hf_generate(model, torch, device: str):
    @torch.inference_mode()
    def generate(prompts, max_tokens):
        ids = torch.tensor(prompts, device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()
    return generate


def agreement(gen_a, gen_b, prompt: list[int], max_tokens: int) -> str:
    """Leading tokens on which both greedy continuations of the same prompt agree."""
    a, b = gen_a([prompt], max_tokens)[0], gen_b([prompt], max_tokens)[0]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{same}/{max_tokens}"


def profile_host(generate, batches: list[int], args) -> None:
    """cProfile of one ``graphs`` run per batch size: where the host's time goes (the
    functions with the most own time), written to ``args.profile``."""
    import cProfile
    import io
    import pstats

    out = io.StringIO()
    for b in batches:
        prompts = [[11 + i] * args.prompt_len for i in range(b)]
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.runcall(generate, prompts, args.max_tokens)
        out.write(f"== batch {b}: {time.perf_counter() - start:.3f} s under cProfile, "
                  f"{args.max_tokens} tokens\n")
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    args.profile.parent.mkdir(parents=True, exist_ok=True)
    args.profile.write_text(out.getvalue(), encoding="utf-8")


def render(rows: list[dict], args, device_name: str, peak: float | None) -> str:
    """``rows``: one per (batch, configuration), each the median round with its range."""
    from benchmarks.report import write_markdown

    weight_bytes = args.shape.num_parameters() * (2 if args.dtype != "float32" else 4)
    table = []
    for r in rows:
        gbps = weight_bytes / (r["step_ms"] / 1e3) / 1e9
        lo, hi = r["tps_range"]
        base = r.get("vs")
        table.append([r["batch"], r["config"], f"{r['decode_tps']:,.0f} ({lo:,.0f}-{hi:,.0f})",
                      f"{r['step_ms']:.2f}", f"{gbps:,.0f}",
                      "n/a" if peak is None else f"{100 * gbps / (peak * 1e3):.0f} %",
                      f"{r['prefill_s']:.2f}", f"{r['full_s']:.2f}",
                      "" if base is None else ", ".join(f"{r['decode_tps'] / b['decode_tps']:.2f}x {n}"
                                                         for n, b in base.items()),
                      r.get("agreement", "")])
    headers = ["batch", "run", "decode tok/s, median (range)", "ms / step", "weight GB/s", "% of peak",
               "prefill run s", "full run s", "ratio (same rounds)", "greedy agreement"]
    s = args.shape
    return "\n".join([
        "## End-to-end decode (weft.LLM)",
        "",
        f"Device: {device_name}. Random-weight Llama, {s.num_parameters() / 1e9:.2f} B parameters "
        f"(hidden {s.hidden_size}, {s.num_hidden_layers} layers, {s.num_attention_heads}/"
        f"{s.num_key_value_heads} heads, intermediate {s.intermediate_size}, vocab {s.vocab_size}), "
        f"{args.dtype}, KV cache `{args.kv_cache_dtype}`"
        f"{f', compress budget {args.kv_compress_budget_blocks} blocks' if args.kv_compress_budget_blocks else ''}, "
        f"attention back end `{args.attention_backend}`, block {args.block_size}; "
        f"{args.prompt_len}-token prompts, {args.max_tokens} new tokens, greedy, EOS ignored. "
        f"Runs: `graphs` is Weft with `cuda_graphs=True` (decode steps replayed from CUDA graphs), "
        f"`eager` the same engine without, `hf` transformers `generate` (static batch, same "
        f"checkpoint and dtype). After one warm-up each, {args.rounds} rounds in rotating order; "
        "the median round is shown, with the range of decode tokens/s; ratios are of medians. "
        "Weight GB/s = weight bytes / decode step time (KV reads not counted). Greedy agreement: "
        "leading tokens of the first prompt equal to the `graphs` run's.",
        "",
        write_markdown(headers, table),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        if not args.smoke:
            print("no CUDA device: run with --smoke to check the script on CPU", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    from tqdm.auto import tqdm

    from weft import LLM, SamplingParams

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run)"
    peak = peak_tbps(device_name, args.peak_tbps) if device == "cuda" else args.peak_tbps
    write_checkpoint(args.model_dir, args.shape, args.dtype, args.seed)

    batches = [int(b) for b in args.batches.split(",")]
    options = engine_options(args, torch, device, max(batches))
    generators = {"graphs": weft_generate(LLM(str(args.model_dir), cuda_graphs=True, **options), SamplingParams)}
    if not args.no_eager:
        generators["eager"] = weft_generate(LLM(str(args.model_dir), **options), SamplingParams)
    if not args.no_baseline:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(args.model_dir), dtype=getattr(torch, args.dtype)).to(device).eval()
        generators["hf"] = hf_generate(model, torch, device)
    rows = []
    with tqdm(total=len(batches) * args.rounds * len(generators), desc="decode rounds", unit="run") as bar:
        for b in batches:
            got = measure_alternating(generators, b, args, torch, bar)
            for name, row in got.items():
                row["config"] = name
                if name == "graphs":
                    row["vs"] = {n: r for n, r in got.items() if n != "graphs"}
                elif b == batches[0]:  # one prompt's agreement, on the first batch size only
                    row["agreement"] = agreement(generators["graphs"], generators[name],
                                                 got["graphs"]["first_prompt"], args.max_tokens)
                rows.append(row)
    if args.profile is not None:
        profile_host(generators["graphs"], batches, args)
    text = render(rows, args, device_name, peak)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

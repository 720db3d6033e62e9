"""Offline throughput: Weft's LLM.generate vs transformers, same model, prompts and threads.

Workloads (all greedy, EOS ignored so every engine produces the same token count):
  uniform  16 concurrent, 128 prompt tokens / 64 new tokens
  mixed    16 prompts of mixed lengths, half behind one of two shared system prompts
  batch-1  one request, 128 new tokens: decode speed vs the machine's memory bandwidth

Baselines, measured in the same run: transformers `generate` (static batch, left
padding) and transformers `generate_batch` (its continuous batching, paged cache).
Writes benchmarks/results/offline_throughput.md and offline_throughput.png.

``--paired MODEL ...`` instead compares Weft with transformers `generate` on each model
(a preset or a real one, default: bench and smollm2-135m-instruct) in interleaved rounds,
batch-1 and --num-prompts concurrent, median and range (paired_throughput.py says why);
writes offline_throughput_paired.md and .png.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.bandwidth import measure_read_bandwidth  # noqa: E402
from benchmarks.report import write_bar_chart, write_markdown  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint directory, .gguf file or named model (smollm2-135m-instruct); "
                        "default: generate the --preset checkpoint under --cache-dir")
    p.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"],
                   help="tiny-model preset to generate when --model is not given (default: bench, ~55M params)")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models",
                   help="where generated checkpoints are kept between runs")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every engine (default: 2)")
    p.add_argument("--num-prompts", type=int, default=16, help="concurrent requests in the batch workloads")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens in the uniform workload")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request in the batch workloads")
    p.add_argument("--decode-len", type=int, default=128, help="new tokens in the batch-1 decode run")
    p.add_argument("--repeats", type=int, default=2, help="timed repetitions per measurement; the best is kept")
    p.add_argument("--skip-hf", action="store_true", help="skip both transformers baselines")
    p.add_argument("--skip-hf-cb", action="store_true", help="skip transformers' continuous batching baseline")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the operator profile of Weft's decode steps appended to the report")
    p.add_argument("--paired", nargs="*", default=None, metavar="MODEL", dest="paired_models",
                   help="interleaved Weft vs transformers generate on each MODEL (a preset name or a real "
                        "model; none given: bench smollm2-135m-instruct) instead of the workloads above")
    p.add_argument("--rounds", type=int, default=3, help="--paired: timed rounds per engine (default: 3)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="where results are written")
    args = p.parse_args(argv)
    if args.paired_models == []:
        args.paired_models = ["bench", "smollm2-135m-instruct"]
    return args


def make_workloads(vocab: int, args) -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    uniform = [tok(args.input_len) for _ in range(args.num_prompts)]
    systems = [tok(96), tok(96)]
    mixed = []
    for i in range(args.num_prompts):
        body = tok(rng.choice([16, 48, 96, 160, 256]))
        mixed.append(systems[i % 2] + body if i % 4 else body)
    return {"uniform": uniform, "mixed": mixed}


def best_of(fn, repeats: int) -> float:
    """Wall seconds of the fastest of ``repeats`` runs of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run_weft(model_dir: Path, workloads, args, results, bar) -> dict:
    from weft import LLM, SamplingParams

    llm = LLM(model_dir, num_threads=args.threads, max_num_batched_tokens=2048, max_prefill_chunk=512)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([[11, 12, 13]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm up
    traffic: dict = {}
    for name, prompts in workloads.items():
        # the prefix cache is reset between repeats so each run computes its prompts
        def once():
            llm.engine.pool.reset_prefix_cache()
            llm.generate(prompts, sp)
        dt = best_of(once, args.repeats)
        results[("weft", name)] = len(prompts) * args.output_len / dt
        bar.update(1)
    one = SamplingParams(max_tokens=args.decode_len, temperature=0.0, ignore_eos=True)
    prompt = workloads["uniform"][0][:8]
    dt = best_of(lambda: llm.generate([prompt], one), args.repeats)
    results[("weft", "batch-1")] = args.decode_len / dt
    bar.update(1)
    if not args.no_profile:
        traffic["profiles"] = {b: profile_decode(llm, b, prompt) for b in (1, args.num_prompts)}
    model = llm.engine.model
    kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype.itemsize
    avg_ctx = len(prompt) + args.decode_len / 2
    traffic.update(weight_bytes=model.param_bytes(), kv_bytes=kv_per_token * avg_ctx)
    return traffic


def profile_decode(llm, batch: int, prompt: list[int], steps: int = 20) -> list[tuple[str, float, int]]:
    """Top operators of ``steps`` pure-decode engine steps at ``batch`` concurrent:
    (name, ms per step, calls per step), plus the wall ms per step as ``step``."""
    from torch.profiler import ProfilerActivity, profile

    from weft import SamplingParams

    engine = llm.engine
    sp = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profile-{batch}-{i}", prompt, sp)
    for _ in range(4):  # prefill and settle
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t0) / steps
    while engine.has_unfinished_requests:
        engine.step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    out = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in rows]
    return [("step (wall, profiled)", wall * 1e3, 1)] + out


def run_hf_static(model_dir: Path, workloads, args, results, bar) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, prompts in workloads.items():
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def once():
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                               min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
        results[("hf-generate", name)] = len(prompts) * args.output_len / best_of(once, args.repeats)
        bar.update(1)
    prompt = torch.tensor([workloads["uniform"][0][:8]])

    def one():
        with torch.inference_mode():
            model.generate(prompt, max_new_tokens=args.decode_len, min_new_tokens=args.decode_len,
                           do_sample=False, pad_token_id=0)
    results[("hf-generate", "batch-1")] = args.decode_len / best_of(one, args.repeats)
    bar.update(1)


def run_hf_cb(model_dir: Path, workloads, args, results, bar) -> None:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    gen = GenerationConfig(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    # Sized for the CPU: a small paged cache, all requests in one batch, no CUDA graphs.
    cb = ContinuousBatchingConfig(block_size=32, num_blocks=512, max_batch_tokens=2048,
                                  max_requests_per_batch=args.num_prompts, use_cuda_graph=False)
    for name, prompts in workloads.items():
        def once():
            with torch.inference_mode():
                model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                     warmup=False, progress_bar=False)
        results[("hf-generate_batch", name)] = len(prompts) * args.output_len / best_of(once, args.repeats)
        bar.update(1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.paired_models is not None:
        from benchmarks import paired_throughput

        return paired_throughput.main(args)
    torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is not None:
        from benchmarks.real_model import resolve_checkpoint

        model_dir = resolve_checkpoint(model_dir)
    else:
        from weft.testing.tiny_model import make_tiny_checkpoint

        model_dir = args.cache_dir / f"{args.preset}-llama"
        if not (model_dir / "config.json").exists():
            make_tiny_checkpoint(model_dir, preset=args.preset, arch="llama")
    from services.executor.model.config import ModelConfig

    workloads = make_workloads(ModelConfig.from_dir(model_dir).vocab_size, args)
    results: dict[tuple[str, str], float] = {}
    steps = 3 + (0 if args.skip_hf else 3 + (0 if args.skip_hf_cb else 2)) + 1
    with tqdm(total=steps, desc="offline throughput", unit="run") as bar:
        bandwidth = measure_read_bandwidth(args.threads)
        bar.update(1)
        traffic = run_weft(model_dir, workloads, args, results, bar)
        if not args.skip_hf:
            run_hf_static(model_dir, workloads, args, results, bar)
            if not args.skip_hf_cb:
                run_hf_cb(model_dir, workloads, args, results, bar)
    report(results, bandwidth, traffic, model_dir, args)
    return 0


def report(results, bandwidth: float, traffic: dict, model_dir: Path, args) -> None:
    engines = ["weft", "hf-generate", "hf-generate_batch"]
    columns = ["uniform", "mixed", "batch-1"]
    rows = []
    for e in engines:
        if any((e, c) in results for c in columns):
            rows.append([e] + [f"{results[(e, c)]:.1f}" if (e, c) in results else "—" for c in columns])
    ratios = []
    for base in ("hf-generate", "hf-generate_batch"):
        for c in columns:
            if (base, c) in results:
                ratios.append([f"weft / {base}", c, f"{results[('weft', c)] / results[(base, c)]:.2f}×"])
    bytes_per_token = traffic["weight_bytes"] + traffic["kv_bytes"]
    achieved = results[("weft", "batch-1")] * bytes_per_token
    lines = [
        "# Offline throughput",
        "",
        f"Model: `{model_dir.name}` ({traffic['weight_bytes'] / 1e6:.0f} MB of weights read per token), "
        f"fp32, {args.threads} threads, {args.num_prompts} concurrent, "
        f"{args.input_len} in / {args.output_len} out; best of {args.repeats}. "
        f"Command: `python benchmarks/offline_throughput.py`.",
        "",
        "## Output tokens per second",
        "",
        write_markdown(["engine", "uniform 16×128/64", "mixed + shared prefixes", "batch-1 decode"], rows),
        "",
        "## Ratios (same run)",
        "",
        write_markdown(["comparison", "workload", "ratio"], ratios),
        "",
        "## Batch-1 decode vs memory bandwidth",
        "",
        f"- measured read bandwidth ({args.threads} threads, torch sum over 1 GiB): {bandwidth / 1e9:.1f} GB/s",
        f"- bytes read per decoded token (weights + average KV): {bytes_per_token / 1e6:.1f} MB",
        f"- Weft batch-1: {results[('weft', 'batch-1')]:.1f} tok/s → {achieved / 1e9:.1f} GB/s = "
        f"**{100 * achieved / bandwidth:.0f} %** of measured bandwidth",
        "",
    ]
    for batch, rows in traffic.get("profiles", {}).items():
        lines += [
            f"## Where a decode step's time goes ({batch} concurrent)",
            "",
            write_markdown(["operator", "ms / step", "calls / step"], [[n, f"{ms:.2f}", c] for n, ms, c in rows]),
            "",
        ]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "offline_throughput.md").write_text("\n".join(lines))
    write_bar_chart(
        args.out_dir / "offline_throughput.png",
        title="Offline output tokens/s (higher is better)",
        groups=columns,
        series={e: [results.get((e, c), float("nan")) for c in columns] for e in engines if (e, "uniform") in results},
    )
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())

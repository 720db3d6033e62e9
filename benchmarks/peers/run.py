"""Weft vs llama.cpp vs transformers on the same weights, same threads, interleaved rounds.

Models (--model): smollm2 (SmolLM2-135M-Instruct: Weft's checkpoint imported from the shipped
GGUF; llama.cpp's f32 GGUF requantized from that same file) and bench (the 55 M random-weight
preset; llama.cpp's GGUF converted from its safetensors), float32 everywhere (weights.py).
Workloads, greedy, EOS ignored, random prompt ids:
  batch-1         one request, --input-len prompt tokens, --output-len new tokens
  N concurrent    --num-prompts such requests at once
Each is reported twice: output tokens over prefill + decode, and decode only (the steps after
every request's first token; llama-batched-bench's S_TG). llama.cpp is timed by
``llama-batched-bench``'s own clock; Weft by stepping its engine (engines.py); transformers
``generate`` at batch 1 only, decode split off with a streamer. Model load is excluded
everywhere. After one untimed warm-up of each engine, each round runs the engines back to back,
the order reversed every other round (paired_throughput.py says why); the report gives median
(min-max) and each ratio over the rounds' own ratios, and marks issue 16's targets met / not
met (table.py). Batch-1 decode is also given as bytes/s (weights + average KV read per token)
over the DRAM read bandwidth measured at the start of each round (benchmarks/bandwidth.py). A greedy
agreement check comes first: --agree-tokens greedy tokens of a chat prompt from
``llama-server`` and from Weft. Writes benchmarks/results/peers.md and peers.png.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Weft runs in this process with the torch runtime settings `weft up` gives executors
# (services/executor/process_env.py), so the figures are the served engine's.
from services.executor.process_env import apply_executor_env  # noqa: E402

apply_executor_env()

from benchmarks.peers import llama_cpp  # noqa: E402
from benchmarks.peers.build_llamacpp import installed_builds, say  # noqa: E402
from benchmarks.peers.table import (Rates, bandwidth_fractions, model_table, plot, spread,  # noqa: E402
                                    target_rows)
from benchmarks.peers.weights import MODELS, PeerModel, peer_model  # noqa: E402

# Long enough an answer that neither engine stops early; EOS is not ignored here because
# llama-server's ignore_eos bans the end tokens (a different distribution), Weft's only keeps going.
AGREE_PROMPT = "Explain in a few sentences why the sky is blue."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=(*MODELS, "both"), default="both", help="which model(s) (default: both)")
    p.add_argument("--threads", type=int, default=2, help="threads for every engine (default: 2)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, at least 3 (default: 3)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request, at least 2 (default: 64)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests in the concurrent workload (default: 16)")
    p.add_argument("--agree-tokens", type=int, default=32, help="greedy tokens compared (default: 32)")
    p.add_argument("--skip-agreement", action="store_true", help="skip the greedy agreement check")
    p.add_argument("--skip-transformers", action="store_true", help="leave transformers out (its columns read —)")
    p.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $WEFT_CACHE_DIR or ~/.cache/weft)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="where results are written")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds: at least 3 (a median and a range need them)")
    if args.output_len < 2:
        p.error("--output-len: at least 2 (decode-only needs a token after the first)")
    return args


def measure(pm: PeerModel, run_weft, run_hf, prompts: list[list[int]], args, bar) -> tuple[Rates, list[float]]:
    """(per-round rates of every engine on both workloads and both phases, the DRAM read
    bandwidth measured at the start of each round in bytes/s)."""
    from benchmarks.bandwidth import measure_read_bandwidth

    rates: Rates = {}
    bandwidths: list[float] = []

    def add(engine: str, workload: str, total: float, decode: float) -> None:
        rates.setdefault((engine, workload, "total"), []).append(total)
        rates.setdefault((engine, workload, "decode"), []).append(decode)

    workloads = {"batch-1": prompts[:1], "concurrent": prompts}

    def weft_round(record: bool = True):
        for w, ps in workloads.items():
            t = run_weft(ps)
            if record:
                add("weft", w, t.output_tok_per_s, t.decode_tok_per_s)

    def llama_round(record: bool = True):
        rows = llama_cpp.batched_bench(pm.gguf, input_len=args.input_len, output_len=args.output_len,
                                       num_prompts=args.num_prompts, threads=args.threads, cache=args.cache_dir)
        if record:
            for w, n in (("batch-1", 1), ("concurrent", args.num_prompts)):
                add("llama.cpp", w, rows[n].output_tok_per_s, rows[n].decode_tok_per_s)

    def hf_round(record: bool = True):
        t = run_hf(prompts[:1])
        if record:
            add("transformers", "batch-1", t.output_tok_per_s, t.decode_tok_per_s)

    engines = [weft_round, llama_round] + ([hf_round] if run_hf else [])
    for fn in engines:  # warm-up, untimed
        fn(record=False)
    bar.update(1)
    for r in range(args.rounds):
        bandwidths.append(measure_read_bandwidth(args.threads))
        for fn in engines if r % 2 == 0 else reversed(engines):
            fn()
        b1 = {e: rates[(e, "batch-1", "decode")][-1] for e in ("weft", "llama.cpp", "transformers")
              if (e, "batch-1", "decode") in rates}
        bar.set_postfix_str(f"{pm.name} batch-1 decode " + ", ".join(f"{e} {v:.0f}" for e, v in b1.items()))
        bar.update(1)
    return rates, bandwidths


def agreement(llm, pm: PeerModel, args) -> tuple[list[int], list[int], str]:
    """(Weft's greedy tokens, llama-server's, Weft's text) for the chat prompt, end tokens dropped."""
    from transformers import AutoTokenizer

    from weft import SamplingParams

    tok = AutoTokenizer.from_pretrained(pm.model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": AGREE_PROMPT}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    ours = llm.generate([prompt], SamplingParams(max_tokens=args.agree_tokens, temperature=0.0),
                        use_tqdm=False)[0].token_ids
    theirs = llama_cpp.server_greedy(pm.gguf, prompt, args.agree_tokens, threads=args.threads, cache=args.cache_dir)
    gen = json.loads((pm.model_dir / "generation_config.json").read_text())
    eos = {tok.eos_token_id, *([gen.get("eos_token_id")] if isinstance(gen.get("eos_token_id"), int)
                               else gen.get("eos_token_id") or [])}
    ours = [t for t in ours if t not in eos]  # llama-server leaves the end token out of "tokens"
    return ours, list(theirs), tok.decode(ours)


def bytes_per_token(llm, args) -> float:
    """Weights + the KV of the average context, read per batch-1 decoded token (float32)."""
    model = llm.engine.model
    kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype.itemsize
    return model.param_bytes() + kv_per_token * (args.input_len + args.output_len / 2)


def model_section(pm: PeerModel, rates: Rates, bandwidths: list[float], agree, traffic: float, args) -> list[str]:
    from benchmarks.report import write_markdown

    headers, rows = model_table(rates, num_prompts=args.num_prompts, input_len=args.input_len,
                                output_len=args.output_len)
    fractions = {e: bandwidth_fractions(rates.get((e, "batch-1", "decode"), []), traffic, bandwidths)
                 for e in ("weft", "llama.cpp", "transformers")}
    lines = [f"## {pm.name} (`{pm.model_dir.name}`, llama.cpp: `{pm.gguf.name}`)", "",
             write_markdown(headers, rows), "",
             f"Batch-1 decode as bytes/s ({traffic / 1e6:.1f} MB read per token: weights + average KV) over the "
             f"DRAM read bandwidth measured at the start of each round, {spread([b / 1e9 for b in bandwidths])} "
             "GB/s: " + ", ".join(f"{e} {spread([100 * f for f in fractions[e]], '{:.0f} %')}" for e in fractions)
             + ".", ""]
    if any(f > 1 for fs in fractions.values() for f in fs):
        lines += ["A figure at or above 100 %: that engine streams weights at least as fast as benchmarks/bandwidth.py's "
                  "`torch.sum` reads, so the measured bandwidth is a floor of the machine's peak and every "
                  "percentage here may overstate.", ""]
    lines += [
             write_markdown(["issue 16 target", "measured", "verdict"],
                            target_rows(pm.name, rates, fractions["weft"], args.num_prompts)), ""]
    if agree is not None:
        ours, theirs, text = agree
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        verdict = f"identical ({same} tokens)" if ours == theirs else f"first {same} equal"
        lines += [f"Greedy agreement (chat prompt {AGREE_PROMPT!r}, up to {args.agree_tokens} tokens, llama-server "
                  f"`/completion` at temperature 0 vs Weft): **{verdict}**. Weft's text: {text!r}; its first ids: "
                  f"{ours[:8]}.", ""]
        if ours != theirs:
            lines += [f"weft: {ours}", "", f"llama.cpp: {theirs}", ""]
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from benchmarks.paired_throughput import uniform_prompts
    from benchmarks.peers.engines import hf_runner, weft_runner
    from services.executor.model.config import ModelConfig

    names = list(MODELS) if args.model == "both" else [args.model]
    models = [peer_model(n, args.cache_dir) for n in names]  # GGUFs made before anything is timed
    torch.set_num_threads(args.threads)
    per_model: dict[str, Rates] = {}
    sections: list[str] = []
    with tqdm(total=len(models) * (args.rounds + 1), desc="peers", unit="round") as bar:
        for pm in models:
            llm, run_weft = weft_runner(pm.model_dir, threads=args.threads, output_len=args.output_len)
            run_hf = None if args.skip_transformers else hf_runner(pm.model_dir, output_len=args.output_len)
            agree = None if args.skip_agreement else agreement(llm, pm, args)
            prompts = uniform_prompts(ModelConfig.from_dir(pm.model_dir).vocab_size, args.num_prompts, args.input_len)
            per_model[pm.name], bandwidths = measure(pm, run_weft, run_hf, prompts, args, bar)
            sections += model_section(pm, per_model[pm.name], bandwidths, agree, bytes_per_token(llm, args), args)
            del llm, run_weft, run_hf
            gc.collect()
    llama = installed_builds(args.cache_dir)[-1].name.removeprefix("llama.cpp-")
    lines = [
        "# Weft vs llama.cpp vs transformers, same weights",
        "",
        f"`python benchmarks/peers/run.py --model {args.model} --rounds {args.rounds}` — float32 weights identical "
        f"in every engine (weights.py), {args.threads} threads each, llama.cpp {llama} from llama-cpp-python (CPU, "
        f"Release, GGML_NATIVE, `llama-batched-bench`), transformers `generate` at batch 1. {args.input_len} prompt "
        f"tokens / {args.output_len} new tokens per request, greedy, EOS ignored, model load excluded. Each figure: "
        f"median (min–max) of {args.rounds} rounds after one untimed warm-up of each engine, the engines back to "
        "back in each round, order reversed every other round; each ratio over the rounds' own ratios. \"decode "
        "only\": tokens of the steps after every request's first token over those steps' time (llama.cpp's "
        "S_TG). `llama-batched-bench` feeds random ids and samples nothing; Weft and transformers sample "
        f"greedily. DRAM read bandwidth: benchmarks/bandwidth.py ({args.threads} threads), once per round.",
        "",
        *sections,
        "![peers](peers.png)",
    ]
    text = "\n".join(lines) + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "peers.md").write_text(text)
    plot(args.out_dir / "peers.png", per_model, args.num_prompts)
    say(f"wrote {args.out_dir / 'peers.md'} and peers.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

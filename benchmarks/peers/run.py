"""Weft vs llama.cpp on the same weights, same threads, interleaved rounds.

Weft runs in process (``weft.LLM``) on the SmolLM2-135M-Instruct checkpoint that
``weft.models.sources`` imports from the shipped GGUF; llama.cpp (built by build_llamacpp.py)
runs the f32 GGUF that weights.py writes from the same file, so both compute with the same
float32 weights. Workloads, greedy, EOS ignored, random prompt ids:
  batch-1         one request, --input-len prompt tokens, --output-len new tokens
  N concurrent    --num-prompts such requests at once
llama.cpp is timed by ``llama-batched-bench`` (its own clock around prefill + decode, the
model load excluded, as Weft's ``generate`` is timed without its load); both figures are
output tokens over prefill + decode time. After one untimed warm-up of each engine, each
round runs both engines back to back, the order flipping every round (paired_throughput.py
says why); the report gives median (min-max). A greedy agreement check first: the first
--agree-tokens greedy tokens of a chat prompt from ``llama-server`` and from Weft.
Writes benchmarks/results/peers.md and peers.png.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.paired_throughput import Series, spread, uniform_prompts  # noqa: E402
from benchmarks.peers.build_llamacpp import find_binary, installed_builds, say  # noqa: E402
from benchmarks.peers.weights import MODEL, f32_gguf  # noqa: E402

# Long enough an answer that neither engine stops early; EOS is not ignored here because
# llama-server's ignore_eos bans the end tokens (a different distribution), Weft's only keeps going.
AGREE_PROMPT = "Explain in a few sentences why the sky is blue."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="threads for both engines (default: 2)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, at least 3 (default: 3)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request (default: 64)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests in the concurrent workload (default: 16)")
    p.add_argument("--agree-tokens", type=int, default=32, help="greedy tokens compared (default: 32)")
    p.add_argument("--skip-agreement", action="store_true", help="skip the greedy agreement check")
    p.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $WEFT_CACHE_DIR or ~/.cache/weft)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="where results are written")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds: at least 3 (a median and a range need them)")
    return args


def llama_bench(gguf: Path, args) -> dict[int, float]:
    """One llama-batched-bench process: {requests: seconds of prefill + decode} for 1 and N."""
    ctx = args.num_prompts * (args.input_len + args.output_len) + 256
    cmd = [str(find_binary("llama-batched-bench", args.cache_dir)), "-m", str(gguf), "-c", str(ctx),
           "-b", "2048", "-ub", "512", "-npp", str(args.input_len), "-ntg", str(args.output_len),
           "-npl", f"1,{args.num_prompts}", "-t", str(args.threads), "-tb", str(args.threads),
           "--output-format", "jsonl"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (done.stdout + done.stderr).splitlines() if line.startswith("{")]
    found = {row["pl"]: row["t"] for row in rows}
    if set(found) != {1, args.num_prompts}:
        raise SystemExit(f"llama-batched-bench printed no result for every batch size: {rows}")
    return found


def weft_runner(model_dir: Path, args):
    from weft import LLM, SamplingParams

    llm = LLM(model_dir, num_threads=args.threads, max_num_batched_tokens=2048, max_prefill_chunk=512)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def run(prompts) -> float:
        llm.engine.pool.reset_prefix_cache()  # every run computes its prompts, as llama.cpp does
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    return llm, run


def measure(llm_run, gguf: Path, vocab: int, args) -> dict:
    """{(engine, requests): Series} over ``args.rounds`` alternating rounds after a warm-up."""
    prompts = uniform_prompts(vocab, args.num_prompts, args.input_len)
    sizes = (1, args.num_prompts)
    series = {(e, n): Series(n * args.output_len) for e in ("weft", "llama.cpp") for n in sizes}

    def weft_round():
        for n in sizes:
            series[("weft", n)].seconds.append(llm_run(prompts[:n]))

    def llama_round():
        for n, secs in llama_bench(gguf, args).items():
            series[("llama.cpp", n)].seconds.append(secs)

    say("warm-up (untimed)")
    for n in sizes:
        llm_run(prompts[:n])
    llama_bench(gguf, args)
    for r in range(args.rounds):
        order = (weft_round, llama_round) if r % 2 == 0 else (llama_round, weft_round)
        for fn in order:
            fn()
        say(f"round {r + 1}/{args.rounds}: weft {series[('weft', 1)].rates()[-1]:.1f} tok/s, "
            f"llama.cpp {series[('llama.cpp', 1)].rates()[-1]:.1f} tok/s at batch 1")
    return series


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_greedy(gguf: Path, prompt: list[int], n: int, args) -> list[int]:
    """The first ``n`` greedy tokens llama-server generates after the token ids ``prompt``."""
    port = free_port()
    cmd = [str(find_binary("llama-server", args.cache_dir)), "-m", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "-t", str(args.threads), "-c", "2048", "-np", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # polls the server's own readiness endpoint: the model loads in the meantime
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"llama-server did not come up (exit {proc.poll()}): {' '.join(cmd)}")
                time.sleep(0.5)
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True}
        req = urllib.request.Request(f"{base}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return list(json.load(r)["tokens"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def agreement(llm, model_dir: Path, gguf: Path, args) -> tuple[list[int], list[int], str]:
    from transformers import AutoTokenizer

    from weft import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": AGREE_PROMPT}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    sp = SamplingParams(max_tokens=args.agree_tokens, temperature=0.0)
    ours = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
    theirs = llama_server_greedy(gguf, prompt, args.agree_tokens, args)
    eos = {tok.eos_token_id}
    ours = [t for t in ours if t not in eos]  # llama-server leaves the end token out of "tokens"
    return ours, list(theirs), tok.decode(ours)


def report(series: dict, agree, facts: dict, args) -> str:
    from benchmarks.report import write_markdown

    rows = []
    for n in (1, args.num_prompts):
        w, ll = series[("weft", n)].rates(), series[("llama.cpp", n)].rates()
        rows.append(["batch-1" if n == 1 else f"{n} × ({args.input_len} in / {args.output_len} out)",
                     spread(w), spread(ll), spread([a / b for a, b in zip(w, ll)], "{:.2f}×")])
    lines = [
        "# Weft vs llama.cpp, same weights",
        "",
        f"`python benchmarks/peers/run.py` — {MODEL}, float32 in both engines (llama.cpp: the f32 GGUF "
        f"`llama-quantize --allow-requantize … F32` writes from the shipped Q4_1 file; Weft: the checkpoint "
        f"import-gguf dequantizes from it), {args.threads} threads each, llama.cpp {facts['llama']} "
        f"(CPU, Release, GGML_NATIVE, `llama-batched-bench`). {args.input_len} prompt tokens / "
        f"{args.output_len} new tokens per request, greedy, EOS ignored. Output tokens per second over "
        f"prefill + decode (model load excluded): median (min–max) of {args.rounds} rounds after one untimed "
        "warm-up of each, the engines back to back in each round, order flipped every round; the ratio's "
        "median and range are over the rounds' own ratios. `llama-batched-bench` feeds random token ids "
        "and samples nothing; Weft samples greedily each step (an argmax over the vocabulary, a small "
        "share of a step).",
        "",
        write_markdown(["workload", "weft tok/s", "llama.cpp tok/s", "weft / llama.cpp"], rows),
        "",
    ]
    if agree is not None:
        ours, theirs, text = agree
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        verdict = f"identical ({same} tokens)" if ours == theirs else f"first {same} equal"
        lines += [f"Greedy agreement (chat prompt {AGREE_PROMPT!r}, up to {args.agree_tokens} tokens, llama-server "
                  f"`/completion` at temperature 0 vs Weft): **{verdict}**. Weft's text: {text!r}.", ""]
        if ours != theirs:
            lines += [f"weft: {ours}", "", f"llama.cpp: {theirs}", ""]
    lines.append("![peers](peers.png)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.report import write_bar_chart
    from benchmarks.real_model import resolve_checkpoint
    from services.executor.model.config import ModelConfig

    torch.set_num_threads(args.threads)
    gguf = f32_gguf(args.cache_dir)
    model_dir = resolve_checkpoint(MODEL)
    llm, run = weft_runner(model_dir, args)
    agree = None if args.skip_agreement else agreement(llm, model_dir, gguf, args)
    series = measure(run, gguf, ModelConfig.from_dir(model_dir).vocab_size, args)
    facts = {"llama": installed_builds(args.cache_dir)[-1].name.removeprefix("llama.cpp-") + " (llama-cpp-python)"}
    text = report(series, agree, facts, args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "peers.md").write_text(text)
    sizes = (1, args.num_prompts)
    write_bar_chart(args.out_dir / "peers.png", "Output tokens/s, same weights, median of rounds (higher is better)",
                    ["batch-1", f"{args.num_prompts} concurrent"],
                    {e: [statistics.median(series[(e, n)].rates()) for n in sizes]
                     for e in ("weft", "llama.cpp")})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

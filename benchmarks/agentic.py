"""Agentic benchmark: agent programs and interactive chats against the mesh, one run,
side by side under several serving policies (`weft bench agentic`).

Workload (seeded, time-scaled so a run takes about a minute per configuration):

  agent programs   Poisson arrivals; hop counts long-tailed (log-normal, capped); each
                   hop = model call -> tool call (log-normal pause) -> the tool result is
                   appended, so the context grows every hop; programs share a few system
                   prompts and tool schemas; the caller sends its guess of the pause
                   (``expected_tool_ms``, the true pause x log-normal noise)
  interactive      Poisson single-turn chats sharing a system prompt

The mesh runs as processes on loopback (the launcher: NATS, cachestore, scheduler, one
executor, router) with a KV pool far smaller than the programs' working set, and every
request goes through the router's public gRPC API with token-id prompts.

Configurations (the same workload replayed against each):

  weft                 --policy weft: per-program least-attained-service priority, cost-based
                       keep / demote / drop at each tool call (demote = the scheduler asks the
                       executor to move the session to the cachestore's host tier and promotes
                       it back on resume), executor priority preemption
  weft-local           the same with keep / drop only (no host tier)
  weft+auto-tier       weft plus the executor's own tiering (demote every session on finish,
                       promote before prefill; issue 6's defaults)
  vllm-like            --policy fcfs, KV left to LRU (prefix caching on, no pins, no tier)
  no-prefix-cache      --policy fcfs with prefix caching off

When ../shared/traces/mooncake_synthetic_trace.jsonl exists, a subsample of it is
replayed too (hash ids -> deterministic token blocks of --trace-block-tokens tokens,
time-scaled), one-shot requests, against the same configurations.

Reports program completion time (JCT) p50/p99, TTFT p50/p99 per class, prefill tokens
recomputed, prefix hit rate (executor) and cachestore hits per tier. Writes
benchmarks/results/agentic.md and agentic_*.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from services.executor.process_env import apply_executor_env  # noqa: E402

apply_executor_env()  # the executor processes' torch runtime settings, before torch loads

from benchmarks.agentic_workload import TRACE, Chat, Program, make_workload, trace_workload  # noqa: E402
from benchmarks.agentic_peer_report import section_text, splice_section  # noqa: E402
from benchmarks.report import write_bar_chart, write_markdown  # noqa: E402

# The executor's own tiering (issue 6 defaults): every session's blocks written to the
# cachestore when a request finishes, and promoted before a prefill when cheaper.
AUTO_TIER = {"WEFT_EXECUTOR_DEMOTE_ON_FINISH": "sessions", "WEFT_EXECUTOR_PROMOTE_BEFORE_PREFILL": "true"}
NO_AUTO_TIER = {"WEFT_EXECUTOR_DEMOTE_ON_FINISH": "never", "WEFT_EXECUTOR_PROMOTE_BEFORE_PREFILL": "false"}
WEFT = {"WEFT_SCHEDULER_POLICY": "weft", "WEFT_EXECUTOR_PREEMPTION_POLICY": "priority"}
FCFS = {"WEFT_SCHEDULER_POLICY": "fcfs", "WEFT_EXECUTOR_PREEMPTION_POLICY": "fcfs", "WEFT_SCHEDULER_DEMOTE": "false"}
CONFIGS: dict[str, dict[str, str]] = {
    "weft": {**WEFT, **NO_AUTO_TIER},
    "weft-local": {**WEFT, **NO_AUTO_TIER, "WEFT_SCHEDULER_DEMOTE": "false"},
    "weft+auto-tier": {**WEFT, **AUTO_TIER},
    "vllm-like": {**FCFS, **NO_AUTO_TIER},
    "no-prefix-cache": {**FCFS, **NO_AUTO_TIER, "WEFT_EXECUTOR_ENABLE_PREFIX_CACHING": "false"},
}
BASELINE = "vllm-like"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="weft bench agentic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="generated model (default: tiny)")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models", help="generated checkpoints")
    p.add_argument("--state-dir", type=Path, default=ROOT / ".weft" / "bench-agentic", help="launcher state dir")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated configurations to run")
    p.add_argument("--duration-s", type=float, default=40.0, help="arrival window of the workload (default: 40)")
    p.add_argument("--num-programs", type=int, default=40, help="agent programs (default: 40)")
    p.add_argument("--num-chats", type=int, default=80, help="interactive chats (default: 80)")
    p.add_argument("--max-hops", type=int, default=30, help="cap of the long-tailed hop count (default: 30)")
    p.add_argument("--tool-median-s", type=float, default=1.0, help="median tool pause, seconds (default: 1.0)")
    p.add_argument("--num-kv-blocks", type=int, default=160, help="executor KV pool, blocks of 16 (default: 160)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="executor batch slots (default: 8)")
    p.add_argument("--max-in-flight", type=int, default=8, help="scheduler in-flight slots (default: 8)")
    p.add_argument("--trace-requests", type=int, default=160, help="mooncake requests replayed (0: skip)")
    p.add_argument("--trace-block-tokens", type=int, default=16, help="tokens per trace hash block")
    p.add_argument("--trace-duration-s", type=float, default=30.0, help="time span the trace is scaled to")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="agentic.md and PNGs")
    p.add_argument("--peer", choices=["llama-server"], default=None,
                   help="compare with a peer engine instead (issue 17's workload; `--peer llama-server --help`)")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    return args


# -- driving the mesh -------------------------------------------------------------------
@dataclass
class Sample:
    kind: str  # "agentic" | "interactive" | "trace"
    ttft_s: float
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    jct_s: list[float] = field(default_factory=list)
    tier_hits: dict[str, int] = field(default_factory=dict)
    num_errors: int = 0
    wall_s: float = 0.0


class Client:
    MAX_TOKENS = 12

    def __init__(self, address: str) -> None:
        import grpc

        from weft.v1 import router_pb2_grpc

        self.channel = grpc.aio.insecure_channel(address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    async def call(self, rid: str, prompt: list[int], kind: str, session=None) -> tuple[Sample, list[int]]:
        from weft.v1 import common_pb2, router_pb2

        req = router_pb2.GenerateRequest(
            request_id=rid, token_ids=router_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=self.MAX_TOKENS, temperature=0.0, ignore_eos=True),
            session=session or common_pb2.SessionInfo(request_class=common_pb2.REQUEST_CLASS_INTERACTIVE))
        start, first, out, last = time.perf_counter(), None, [], None
        async for chunk in self.stub.Generate(req, timeout=300):
            if chunk.token_ids_delta and first is None:
                first = time.perf_counter()
            out.extend(chunk.token_ids_delta)
            last = chunk
        return Sample(kind, (first or time.perf_counter()) - start, last.usage.num_prompt_tokens,
                      last.usage.num_cached_tokens), out


async def run_program(client: Client, p: Program, t0: float, result: RunResult) -> None:
    from weft.v1 import common_pb2

    await asyncio.sleep(max(0.0, t0 + p.start_s - time.perf_counter()))
    start = time.perf_counter()
    context = list(p.prefix_token_ids)
    try:
        for h, hop in enumerate(p.hops):
            context.extend(hop.new_token_ids)
            session = common_pb2.SessionInfo(session_id=p.program_id, program_id=p.program_id, hop_index=h,
                                             expected_tool_ms=hop.expected_tool_ms,
                                             request_class=common_pb2.REQUEST_CLASS_AGENTIC)
            sample, out = await client.call(f"{p.program_id}-h{h}", context, "agentic", session)
            result.samples.append(sample)
            context.extend(out)
            if hop.pause_s:
                await asyncio.sleep(hop.pause_s)  # the tool runs
        result.jct_s.append(time.perf_counter() - start)
    except Exception as exc:  # counted, reported
        result.num_errors += 1
        print(f"  {p.program_id} failed: {exc!r}"[:200], flush=True)


async def run_chat(client: Client, c: Chat, t0: float, kind: str, result: RunResult) -> None:
    await asyncio.sleep(max(0.0, t0 + c.start_s - time.perf_counter()))
    try:
        sample, _ = await client.call(c.chat_id, list(c.prompt_token_ids), kind)
        result.samples.append(sample)
    except Exception as exc:
        result.num_errors += 1
        print(f"  {c.chat_id} failed: {exc!r}"[:200], flush=True)


async def tier_hits(address: str) -> dict[str, int]:
    import grpc

    from weft.v1 import cachestore_pb2, cachestore_pb2_grpc, events_pb2

    async with grpc.aio.insecure_channel(address) as ch:
        stats = await cachestore_pb2_grpc.CacheStoreStub(ch).Stats(cachestore_pb2.CacheStatsRequest(), timeout=5)
    return {events_pb2.Tier.Name(t.tier).removeprefix("TIER_").lower(): t.num_hits for t in stats.tiers}


async def run_config(args, name: str, model_dir: Path, workloads: dict) -> dict[str, RunResult]:
    from weft.launcher.launcher import Launcher, UpOptions

    env = {"WEFT_EXECUTOR_NUM_KV_BLOCKS": str(args.num_kv_blocks), "WEFT_EXECUTOR_BLOCK_SIZE": "16",
           "WEFT_EXECUTOR_MAX_NUM_SEQS": str(args.max_num_seqs), "WEFT_EXECUTOR_MAX_NUM_BATCHED_TOKENS": "512",
           "WEFT_EXECUTOR_MAX_PREFILL_CHUNK": "256", "WEFT_EXECUTOR_NUM_THREADS": "1",
           "WEFT_SCHEDULER_MAX_IN_FLIGHT": str(args.max_in_flight),
           "WEFT_SCHEDULER_MAX_IN_FLIGHT_PER_TENANT": str(args.max_in_flight), **CONFIGS[name]}
    launcher = Launcher(UpOptions(model_dir=str(model_dir), num_executors=1, http_port=0, grpc_port=0,
                                  state_dir=args.state_dir, log_level="warning", extra_env=env))
    print(f"[{name}] starting the mesh ...", flush=True)
    state = await launcher.start()
    results: dict[str, RunResult] = {}
    try:
        client = Client(state.grpc_address)
        cachestore = f"127.0.0.1:{state.instance('cachestore').ports['cachestore_port']}"
        await client.call("warmup", list(range(10, 60)), "interactive")
        for wname, (programs, chats, chat_kind) in workloads.items():
            before = await tier_hits(cachestore)
            result = RunResult()
            t0 = time.perf_counter()
            tasks = [run_program(client, p, t0, result) for p in programs]
            tasks += [run_chat(client, c, t0, chat_kind, result) for c in chats]
            await asyncio.gather(*tasks)
            result.wall_s = time.perf_counter() - t0
            after = await tier_hits(cachestore)
            result.tier_hits = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            results[wname] = result
            print(f"[{name}] {wname}: {len(result.samples)} requests in {result.wall_s:.1f} s, "
                  f"{result.num_errors} errors", flush=True)
        await client.channel.close()
    finally:
        await launcher.stop()
    return results


# -- report -----------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(r: RunResult) -> dict[str, float]:
    by = lambda kind: [s.ttft_s for s in r.samples if s.kind == kind]  # noqa: E731
    prompt = sum(s.num_prompt_tokens for s in r.samples)
    cached = sum(s.num_cached_tokens for s in r.samples)
    return {
        "jct_p50": pct(r.jct_s, 50), "jct_p99": pct(r.jct_s, 99),
        "ttft_int_p50": pct(by("interactive"), 50) * 1000, "ttft_int_p99": pct(by("interactive"), 99) * 1000,
        "ttft_agent_p50": pct(by("agentic"), 50) * 1000, "ttft_agent_p99": pct(by("agentic"), 99) * 1000,
        "ttft_trace_p50": pct(by("trace"), 50) * 1000, "ttft_trace_p99": pct(by("trace"), 99) * 1000,
        "recomputed": prompt - cached, "hit_rate": cached / prompt if prompt else 0.0,
        "errors": r.num_errors, "wall_s": r.wall_s,
    }


def report(args, results: dict[str, dict[str, RunResult]], meta: dict) -> str:
    f1 = lambda x: "-" if x != x else f"{x:.1f}"  # noqa: E731
    f0 = lambda x: "-" if x != x else f"{x:.0f}"  # noqa: E731
    tier = lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r.tier_hits.items()) if v) or "0"  # noqa: E731
    out = ["# Agentic benchmark", "",
           f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; machine: {meta['machine']}", "",
           f"Workload: {args.num_programs} agent programs (hops: 1 + lognormal(1.0, 0.9), cap {args.max_hops}; "
           f"tool pauses lognormal, median {args.tool_median_s} s; 3 shared system prompts x 2 tool schemas) and "
           f"{args.num_chats} interactive chats, Poisson arrivals over {args.duration_s:.0f} s; {Client.MAX_TOKENS} "
           f"output tokens per call. Mesh: launcher processes on loopback, `{args.preset}` model, one executor "
           f"with {args.num_kv_blocks} KV blocks of 16 tokens (the programs' contexts need several times that), "
           f"{args.max_num_seqs} batch slots, scheduler in-flight {args.max_in_flight}.", ""]
    rows = []
    base = summarize(results[BASELINE]["agentic"]) if BASELINE in results else None
    for name, per in results.items():
        s = summarize(per["agentic"])
        rows.append([name, f1(s["jct_p50"]), f1(s["jct_p99"]), f0(s["ttft_int_p50"]), f0(s["ttft_int_p99"]),
                     f0(s["ttft_agent_p50"]), f0(s["ttft_agent_p99"]), f"{s['recomputed']:,}",
                     f"{s['hit_rate']:.0%}", tier(per["agentic"]), str(s["errors"])])
    out += ["## Agent programs + interactive chats", "",
            write_markdown(["config", "JCT p50 s", "JCT p99 s", "interactive TTFT p50 ms", "interactive TTFT p99 ms",
                            "agent hop TTFT p50 ms", "agent hop TTFT p99 ms", "prefill tokens recomputed",
                            "prefix hit rate (executor)", "cachestore hits per tier", "errors"], rows), ""]
    if base is not None:
        out += ["Against the vLLM-like baseline (higher is better for Weft):", ""]
        for name, per in results.items():
            if name == BASELINE:
                continue
            s = summarize(per["agentic"])
            out.append(f"- {name}: JCT p99 {base['jct_p99'] / s['jct_p99']:.2f}x (target >= 1.5x), "
                       f"interactive TTFT p99 {base['ttft_int_p99'] / s['ttft_int_p99']:.2f}x (target >= 2x), "
                       f"JCT p50 {base['jct_p50'] / s['jct_p50']:.2f}x")
        out.append("")
    if any("trace" in per for per in results.values()):
        rows = []
        for name, per in results.items():
            if "trace" not in per:
                continue
            s = summarize(per["trace"])
            rows.append([name, f0(s["ttft_trace_p50"]), f0(s["ttft_trace_p99"]), f"{s['recomputed']:,}",
                         f"{s['hit_rate']:.0%}", tier(per["trace"]), str(s["errors"])])
        out += ["## Mooncake trace replay", "",
                f"`{TRACE.name}`: {args.trace_requests} requests subsampled evenly, each hash id a deterministic "
                f"block of {args.trace_block_tokens} tokens (prompts capped to the model's context), arrivals "
                f"scaled to {args.trace_duration_s:.0f} s, one-shot requests.", "",
                write_markdown(["config", "TTFT p50 ms", "TTFT p99 ms", "prefill tokens recomputed",
                                "prefix hit rate (executor)", "cachestore hits per tier", "errors"], rows), ""]
    return "\n".join(out)


def charts(args, results: dict[str, dict[str, RunResult]]) -> list[str]:
    names = list(results)
    s = {n: summarize(results[n]["agentic"]) for n in names}
    files = []
    path = args.out_dir / "agentic_jct.png"
    write_bar_chart(path, "Agent program completion time", ["JCT p50", "JCT p99"],
                    {n: [s[n]["jct_p50"], s[n]["jct_p99"]] for n in names}, ylabel="seconds")
    files.append(path.name)
    path = args.out_dir / "agentic_ttft.png"
    write_bar_chart(path, "Time to first token by class", ["interactive p50", "interactive p99", "agent hop p50",
                                                            "agent hop p99"],
                    {n: [s[n]["ttft_int_p50"], s[n]["ttft_int_p99"], s[n]["ttft_agent_p50"],
                         s[n]["ttft_agent_p99"]] for n in names}, ylabel="ms")
    files.append(path.name)
    return files


async def bench(args) -> dict[str, dict[str, RunResult]]:
    from weft.testing.tiny_model import make_tiny_checkpoint

    model_dir = Path(make_tiny_checkpoint(args.cache_dir / args.preset, preset=args.preset))
    config = json.loads((model_dir / "config.json").read_text())
    vocab, max_context = config["vocab_size"], config["max_position_embeddings"] - Client.MAX_TOKENS - 8
    programs, chats = make_workload(args, vocab, max_context)
    workloads = {"agentic": (programs, chats, "interactive")}
    if args.trace_requests and TRACE.exists():
        workloads["trace"] = ([], trace_workload(args, vocab, max_context), "trace")
    print(f"{len(programs)} programs ({sum(len(p.hops) for p in programs)} hops, max "
          f"{max(len(p.hops) for p in programs)}), {len(chats)} chats", flush=True)
    return {name: await run_config(args, name, model_dir, workloads) for name in args.configs}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--peer" or a.startswith("--peer=") for a in argv):  # issue 17's comparison: its own options
        from benchmarks.agentic_peer import main as peer_main

        return peer_main(argv)
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(bench(args))
    meta = {"command": "weft bench agentic " + " ".join(argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} CPUs (shared), no GPU"}
    text = report(args, results, meta)
    files = charts(args, results)
    text += "\n" + "\n".join(f"![{f}]({f})" for f in files) + "\n"
    md = args.out_dir / "agentic.md"  # the peer comparison's section (agentic_peer.py) is kept
    peer = section_text(md.read_text()) if md.exists() else None
    md.write_text(splice_section(text, peer) if peer else text)
    (args.out_dir / "agentic.json").write_text(json.dumps(
        {n: {w: summarize(r) for w, r in per.items()} for n, per in results.items()}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

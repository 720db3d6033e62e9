"""Mesh overhead: what the service mesh adds to time-to-first-token (TTFT) and
inter-token latency (ITL) over running the engine in-process.

Paths, same checkpoint, same prompts, one request at a time, all in one run:

  in-process      AsyncEngine (the executor's own driver) in this process: the floor
  executor gRPC   client -> executor (internal API): the cost of the last hop alone
  scheduler gRPC  client -> scheduler -> executor: adds the control-plane hop
  mesh gRPC       client -> router (public gRPC) -> scheduler -> executor, token-id prompts
  mesh HTTP       client -> router (OpenAI /v1/completions, SSE) -> scheduler -> executor
  gRPC floor      client -> relay -> relay -> leaf: the mesh's shape with nothing in it
                  (benchmarks/grpc_floor.py: three processes, raw bytes, the leaf streams
                  --max-tokens small messages at once)

The two internal paths are the breakdown: they show where the mesh's time goes, hop
by hop (--no-breakdown skips them). The floor says how much of the mesh's added time
any three loopback grpc.aio hops cost on this machine; the rest is Weft's own work (the
services' request handling, protobuf messages, the executor's side of the engine hand-off)
(--no-floor skips it).

The mesh is started with the launcher (`weft up`'s code: real NATS, one process per
service, loopback only). Requests are interleaved path by path so drift (thermal,
background) hits every path alike; the order rotates one place per prompt, so the path
that follows the in-process one (whose engine's threads are still winding down in this
process) changes every request. Prefix caching is off on both engines so repeated
prompts cost the same everywhere; EOS is ignored so every request yields exactly
--max-tokens tokens. ITL is per token: a chunk of k tokens after a gap g counts k gaps
of g/k (so coalesced chunks cannot flatter a path).

--rounds R repeats the whole interleaved sweep R times on the same mesh (after one
warm-up): each p50 cell is the median of the R rounds' p50s with their range
(min–max); each "+ vs in-process" cell is the median of the R per-round differences.
p99 columns pool every round's samples.

Both engines run with the executor processes' torch runtime settings (services/executor/process_env.py).
Writes benchmarks/results/mesh_overhead.md and mesh_overhead.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The in-process engine runs with the executor processes' OpenMP setting (weft/launcher/mesh_spec.py),
# so the comparison differs only in the mesh. Must be set before torch loads.
from services.executor.process_env import apply_executor_env  # noqa: E402

apply_executor_env()  # the executor processes' torch runtime settings, before torch loads

from tqdm.auto import tqdm  # noqa: E402

from benchmarks.grpc_floor import FloorChain, FloorClient  # noqa: E402
from benchmarks.report import write_markdown  # noqa: E402

PATHS = ("in-process", "executor gRPC", "scheduler gRPC", "mesh gRPC", "mesh HTTP")
FLOOR = "gRPC floor"
BREAKDOWN = ("executor gRPC", "scheduler gRPC")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory; default: generate the --preset checkpoint under --cache-dir")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "bench"],
                   help="tiny-model preset generated when --model is not given (default: tiny)")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models",
                   help="where generated checkpoints are kept between runs")
    p.add_argument("--prompt-lens", default="16,128,512",
                   help="comma-separated prompt lengths in tokens; each gets --num-requests requests per path")
    p.add_argument("--num-requests", type=int, default=50, help="timed requests per prompt length and path (default: 50)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default: 32)")
    p.add_argument("--warmup", type=int, default=3, help="untimed requests per path first (default: 3)")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed sweeps over every prompt length and path; p50s are the median of the rounds' "
                        "p50s with their range (default: 3)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take (default: 120)")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds the mesh gets to start (default: 180)")
    p.add_argument("--state-dir", type=Path, default=ROOT / ".weft" / "bench-mesh",
                   help="launcher state dir of the benchmark's own mesh (logs land in <dir>/logs)")
    p.add_argument("--no-breakdown", action="store_true",
                   help="skip the per-hop breakdown paths (executor and scheduler called directly)")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="idle pause after each request, so none starts while the last one's tail runs (default: 0; "
                        "every path gets slower with it: each request then wakes idle processes)")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the transport floor path (three empty gRPC hops, benchmarks/grpc_floor.py)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="where results are written")
    args = p.parse_args(argv)
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",") if x]
    if args.num_requests < 1 or args.max_tokens < 2 or args.rounds < 1 or not args.prompt_lens:
        p.error("need --num-requests >= 1, --max-tokens >= 2, --rounds >= 1 and at least one prompt length")
    return args


@dataclass
class Timings:
    """Per-path samples in seconds."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def add(self, start: float, arrivals: list[tuple[float, int]]) -> None:
        """``arrivals``: (time, number of tokens) of every chunk that carried tokens."""
        self.ttft.append(arrivals[0][0] - start)
        prev = arrivals[0][0]
        for t, n in arrivals[1:]:
            self.itl.extend([(t - prev) / n] * n)
            prev = t


# -- the three paths -------------------------------------------------------------------
class InProcess:
    def __init__(self, model_dir: Path) -> None:
        from services.executor.engine.async_engine import AsyncEngine
        from services.executor.engine.engine import LLMEngine
        from services.executor.engine.config import EngineConfig

        self.engine = AsyncEngine(LLMEngine(model_dir, EngineConfig(enable_prefix_caching=False)))
        self.n = 0

    async def run(self, prompt: list[int], max_tokens: int) -> tuple[float, list[tuple[float, int]], int]:
        from services.executor.engine.sampling_params import SamplingParams

        self.n += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start, arrivals, total = time.perf_counter(), [], 0
        async for out in self.engine.generate(f"bench-{self.n}", prompt, params):
            if out.new_token_ids:
                arrivals.append((time.perf_counter(), len(out.new_token_ids)))
                total += len(out.new_token_ids)
        return start, arrivals, total


class MeshGrpc:
    def __init__(self, address: str) -> None:
        import grpc

        from weft.v1 import router_pb2_grpc

        self.channel = grpc.aio.insecure_channel(address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    async def run(self, prompt: list[int], max_tokens: int, timeout_s: float):
        from weft.v1 import common_pb2, router_pb2

        req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        start, arrivals, total = time.perf_counter(), [], 0
        async for chunk in self.stub.Generate(req, timeout=timeout_s):
            if chunk.token_ids_delta:
                arrivals.append((time.perf_counter(), len(chunk.token_ids_delta)))
                total += len(chunk.token_ids_delta)
        return start, arrivals, total


class Internal:
    """Direct calls to the executor's or the scheduler's internal Generate."""

    def __init__(self, address: str, kind: str) -> None:
        import grpc

        from weft.v1 import executor_pb2_grpc, scheduler_pb2_grpc

        self.channel = grpc.aio.insecure_channel(address)
        self.kind = kind
        self.stub = (executor_pb2_grpc.ExecutorStub if kind == "executor" else scheduler_pb2_grpc.SchedulerStub)(self.channel)
        self.n = 0

    async def run(self, prompt: list[int], max_tokens: int, timeout_s: float):
        from weft.v1 import common_pb2, executor_pb2, scheduler_pb2

        self.n += 1
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if self.kind == "executor":
            req = executor_pb2.ExecuteRequest(request_id=f"bench-e{self.n}", prompt_token_ids=prompt, sampling=sampling,
                                              tenant_salt="default")
        else:
            req = scheduler_pb2.ScheduleRequest(request_id=f"bench-s{self.n}", prompt_token_ids=prompt,
                                                sampling=sampling, tenant="default")
        start, arrivals, total = time.perf_counter(), [], 0
        async for chunk in self.stub.Generate(req, timeout=timeout_s):
            if chunk.token_ids_delta:
                arrivals.append((time.perf_counter(), len(chunk.token_ids_delta)))
                total += len(chunk.token_ids_delta)
        return start, arrivals, total


class MeshHttp:
    def __init__(self, url: str, model: str) -> None:
        import aiohttp

        self.url = f"{url}/v1/completions"
        self.model = model
        self.session = aiohttp.ClientSession()

    async def run(self, prompt: list[int], max_tokens: int, timeout_s: float):
        import aiohttp

        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        start, arrivals, total = time.perf_counter(), [], 0
        async with self.session.post(self.url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                n = sum(len(c.get("token_ids") or ()) for c in json.loads(line[6:])["choices"])
                if n:
                    arrivals.append((now, n))
                    total += n
        return start, arrivals, total


# -- run ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# results[round][prompt tokens][path]
Results = list[dict[int, dict[str, Timings]]]


async def bench(args, model_dir: Path) -> Results:
    from weft.launcher.launcher import Launcher, UpOptions

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = {n: [[rng.randrange(10, vocab) for _ in range(n)] for _ in range(args.num_requests)]
               for n in args.prompt_lens}
    warm = [rng.randrange(10, vocab) for _ in range(32)]

    launcher = Launcher(UpOptions(model_dir=str(model_dir), num_executors=1, http_port=0, grpc_port=0,
                                  state_dir=args.state_dir, log_level="warning", startup_timeout_s=args.startup_timeout,
                                  extra_env={"WEFT_EXECUTOR_ENABLE_PREFIX_CACHING": "false"}))
    print("starting the mesh ...", flush=True)
    state = await launcher.start()
    floor = None
    try:
        local = await asyncio.to_thread(InProcess, model_dir)
        grpc_path = MeshGrpc(state.grpc_address)
        http_path = MeshHttp(state.http_url, model_dir.name)
        executor = Internal(f"127.0.0.1:{state.instance('executor-0').ports['executor_port']}", "executor")
        scheduler = Internal(f"127.0.0.1:{state.instance('scheduler').ports['scheduler_port']}", "scheduler")
        runners = {
            "in-process": lambda p: local.run(p, args.max_tokens),
            "executor gRPC": lambda p: executor.run(p, args.max_tokens, args.request_timeout),
            "scheduler gRPC": lambda p: scheduler.run(p, args.max_tokens, args.request_timeout),
            "mesh gRPC": lambda p: grpc_path.run(p, args.max_tokens, args.request_timeout),
            "mesh HTTP": lambda p: http_path.run(p, args.max_tokens, args.request_timeout),
        }
        if args.no_breakdown:
            for name in BREAKDOWN:
                runners.pop(name)
        if not args.no_floor:
            floor = await asyncio.to_thread(FloorChain, 3)
            floor_client = FloorClient(floor.address)
            runners[FLOOR] = lambda p: floor_client.run(args.max_tokens, args.request_timeout)
        paths = list(runners)
        for _ in range(args.warmup):
            for run in runners.values():
                await run(warm)
        results = [{n: {name: Timings() for name in paths} for n in args.prompt_lens} for _ in range(args.rounds)]
        total = args.rounds * len(args.prompt_lens) * args.num_requests * len(paths)
        with tqdm(total=total, desc="requests", unit="req") as bar:
            for rnd in results:
                for n in args.prompt_lens:
                    for i, prompt in enumerate(prompts[n]):
                        # Interleaved, and rotated one place per prompt: drift and the tail of the
                        # request before (the in-process engine's OpenMP threads winding down,
                        # the mesh's trailers) hit every path alike, not always the same one.
                        for name in paths[i % len(paths):] + paths[:i % len(paths)]:
                            start, arrivals, count = await asyncio.wait_for(runners[name](prompt),
                                                                            args.request_timeout)
                            if count != args.max_tokens:
                                raise RuntimeError(f"{name} returned {count} tokens, expected {args.max_tokens}")
                            rnd[n][name].add(start, arrivals)
                            bar.update(1)
                            if args.gap_ms:
                                await asyncio.sleep(args.gap_ms / 1000)
        await http_path.session.close()
        for channel in (grpc_path.channel, executor.channel, scheduler.channel):
            await channel.close()
        if floor is not None:
            await floor_client.close()
        local.engine.shutdown()
        return results
    finally:
        if floor is not None:
            floor.stop()
        await launcher.stop()


def p50(results: Results, n: int, name: str, metric: str, minus: str | None = None) -> list[float]:
    """One p50 (ms) per round of ``metric`` on path ``name``, less path ``minus``'s p50 when given."""
    out = []
    for rnd in results:
        value = percentile(getattr(rnd[n][name], metric), 50)
        if minus is not None:
            value -= percentile(getattr(rnd[n][minus], metric), 50)
        out.append(value * 1000)
    return out


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def cell(values: list[float], signed: bool = False) -> str:
    """Median of the rounds with their range: ``3.10 (2.90–3.40)``; one round: the value."""
    f = "{:+.2f}" if signed else "{:.2f}"
    if len(values) == 1:
        return f.format(values[0])
    return f"{f.format(median(values))} ({f.format(min(values))}–{f.format(max(values))})"


def pooled_p99(results: Results, n: int, name: str, metric: str) -> str:
    return f"{percentile([v for rnd in results for v in getattr(rnd[n][name], metric)], 99) * 1000:.2f}"


def report(args, model_dir: Path, results: Results) -> str:
    headers = ["prompt tokens", "path", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
               "+TTFT p50 ms vs in-process", "+ITL p50 ms vs in-process"]
    rows = []
    first = results[0]
    for n, paths in first.items():
        for name in paths:
            base = name in ("in-process", FLOOR)  # the floor runs no engine: its TTFT is all added time
            rows.append([n, name, cell(p50(results, n, name, "ttft")), pooled_p99(results, n, name, "ttft"),
                         cell(p50(results, n, name, "itl")), pooled_p99(results, n, name, "itl"),
                         "—" if base else cell(p50(results, n, name, "ttft", "in-process"), signed=True),
                         "—" if base else cell(p50(results, n, name, "itl", "in-process"), signed=True)])
    table = write_markdown(headers, rows)
    if all(name in paths for name in PATHS for paths in first.values()):
        table += "\n\n### Where the mesh's time goes (p50 differences, ms)\n\n" + breakdown(results)
    if all(FLOOR in paths for paths in first.values()):
        table += "\n\n### Against the transport floor (p50 TTFT, ms)\n\n" + against_floor(results)
    return table


def against_floor(results: Results) -> str:
    """What the mesh adds to TTFT, split into the floor (three empty gRPC hops: the gRPC
    floor path's own TTFT) and the rest, Weft's own work (medians of the rounds' values)."""
    headers = ["prompt tokens", "path", "added TTFT", "floor: 3 empty hops", "Weft's own work (added − floor)"]
    rows = []
    for n in results[0]:
        floor = p50(results, n, FLOOR, "ttft")
        for name in ("mesh gRPC", "mesh HTTP"):
            if name not in results[0][n]:
                continue
            added = p50(results, n, name, "ttft", "in-process")
            own = [a - f for a, f in zip(added, floor)]
            rows.append([n, name, cell(added, signed=True), cell(floor), cell(own, signed=True)])
    return write_markdown(headers, rows)


def breakdown(results: Results) -> str:
    """Per-hop share of the mesh's p50 TTFT / ITL: each path minus the one inside it
    (median of the rounds' differences)."""
    hops = [("executor gRPC hop (vs in-process AsyncEngine)", "executor gRPC", "in-process"),
            ("scheduler hop (placement + relay)", "scheduler gRPC", "executor gRPC"),
            ("router hop, gRPC API (auth, validation, detokenize, relay)", "mesh gRPC", "scheduler gRPC"),
            ("HTTP/SSE instead of gRPC at the router", "mesh HTTP", "mesh gRPC")]
    headers = ["hop"] + [f"{n} tok: TTFT / ITL" for n in results[0]]
    rows = []
    for label, outer, inner in hops:
        cells = [f"{median(p50(results, n, outer, 'ttft', inner)):+.2f} / "
                 f"{median(p50(results, n, outer, 'itl', inner)):+.2f}" for n in results[0]]
        rows.append([label, *cells])
    return write_markdown(headers, rows)


def plot(path: Path, results: Results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    lens = list(results[0])
    names = list(results[0][lens[0]])
    width = 0.8 / len(names)
    for ax, metric, title in ((axes[0], "ttft", "TTFT p50 (ms)"), (axes[1], "itl", "inter-token latency p50 (ms)")):
        for i, name in enumerate(names):
            values = [median(p50(results, n, name, metric)) for n in lens]
            bars = ax.bar([g + i * width for g in range(len(lens))], values, width, label=name)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(lens))], [f"{n} prompt tokens" for n in lens])
        ax.set_title(title + (f", median of {len(results)} rounds" if len(results) > 1 else ""))
        ax.margins(y=0.3)  # headroom for the legend
        ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.suptitle("Weft mesh overhead vs in-process engine (batch 1, loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from weft.testing.tiny_model import make_tiny_checkpoint

        model_dir = args.cache_dir / args.preset
        if not (model_dir / "config.json").is_file():
            make_tiny_checkpoint(model_dir, preset=args.preset)
    else:
        model_dir = args.model
    model_dir = model_dir.resolve()
    from services.mesh.logging import configure_logging

    configure_logging("bench", "warning")
    load_before = os.getloadavg()[0]
    results = asyncio.run(bench(args, model_dir))
    load_after = os.getloadavg()[0]
    table = report(args, model_dir, results)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(args.out_dir / "mesh_overhead.png", results)
    header = (f"# Mesh overhead\n\nModel: `{model_dir.name}` (preset {args.preset if args.model is None else 'n/a'}); "
              f"{args.rounds} rounds of {args.num_requests} requests per prompt length and path, "
              f"{args.max_tokens} tokens each, batch 1, "
              f"greedy, prefix caching off; one executor; loopback; {os.cpu_count()} CPUs, 1-minute load "
              f"average {load_before:.1f} before and {load_after:.1f} after the run (other work on the machine "
              f"shows up as stalls in the p99 columns).\n\n")
    (args.out_dir / "mesh_overhead.md").write_text(header + table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

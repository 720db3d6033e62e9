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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The in-process engine runs with the executor processes' OpenMP setting (weft/launcher/mesh_spec.py),
# so the comparison differs only in the mesh. Must be set before torch loads.
from services.executor.process_env import apply_executor_env  # noqa: E402

apply_executor_env()  # the executor processes' torch runtime settings, before torch loads

from tqdm.auto import tqdm  # noqa: E402

from benchmarks.grpc_floor import FloorChain, FloorClient  # noqa: E402
from benchmarks.mesh_overhead_report import FLOOR, Results, Timings, plot, report  # noqa: E402

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

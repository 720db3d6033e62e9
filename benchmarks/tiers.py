"""KV tiers: what the cachestore's sleeping (host RAM) and archived (disk) tiers buy.

Part 1, resumed-session TTFT (real servers on loopback, in this process): an executor
(gRPC, --preset model, a KV pool too small to keep every session) and a cachestore
(gRPC, host RAM over a disk directory, fsync on). Each session runs its first hop
(--context-tokens of prompt); demote-on-finish writes its blocks to the cachestore, and
the pool forgets them as later sessions arrive. Then each session's next hop (its
context + --new-tokens) is timed three ways, interleaved per session:

  recompute   promotion off: the executor prefills the whole context again
  disk tier   the session's blocks only on disk: the executor loads them from there
  host tier   the session's blocks in host RAM: the executor loads them from there

TTFT is client-side (Generate call to first token); the cached-token count each reply
reports proves where the prefix came from.

Part 2, block hit rate on a replay of the Mooncake synthetic trace (a simulation over
the real BlockPool and the real tier classes, no model): each hash id becomes a
deterministic block of --sim-block-size token ids, hashed with the engine's hash chain,
so the trace's prefix reuse is real prefix reuse. Three caches:

  GPU pool only      BlockPool of --gpu-blocks, LRU of freed blocks
  full hierarchy     the same pool + host tier (--host-blocks) + disk tier (--disk-blocks);
                     finished requests' blocks are demoted (as --demote-on-finish=all does),
                     misses beyond the GPU hits are served by the lower tiers; the
                     pause-aware demotion policy sweeps on trace time
  ideal              unbounded cache: every block seen before is a hit (~64 %)

Writes benchmarks/results/tiers.md, tiers.png (TTFT) and tiers_hit_rate.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from services.executor.process_env import apply_executor_env  # noqa: E402

apply_executor_env()  # the executor processes' torch runtime settings, before torch loads

from tqdm.auto import tqdm  # noqa: E402

from benchmarks.report import write_bar_chart, write_markdown  # noqa: E402

MODES = ("recompute", "disk tier", "host tier")
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory; default: generate the --preset checkpoint under --cache-dir")
    p.add_argument("--preset", default="small", choices=["tiny", "small", "bench"],
                   help="tiny-model preset generated when --model is not given (default: small)")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".weft" / "models",
                   help="where generated checkpoints are kept between runs")
    p.add_argument("--sessions", type=int, default=6, help="sessions in part 1 (default: 6)")
    p.add_argument("--context-tokens", type=int, default=1024, help="first-hop prompt length per session (default: 1024)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens the resumed hop appends (default: 32)")
    p.add_argument("--pool-sessions", type=float, default=1.5,
                   help="executor KV pool size in sessions' worth of blocks (default: 1.5: most must be evicted)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block in part 1 (default: 16)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the executor engine (default: 2)")
    p.add_argument("--trace", type=Path, default=TRACE, help="Mooncake-format trace for part 2 (skipped if absent)")
    p.add_argument("--max-requests", type=int, default=4000, help="trace requests replayed in part 2 (default: 4000)")
    p.add_argument("--sim-block-size", type=int, default=16, help="tokens per block in the replay (default: 16)")
    p.add_argument("--gpu-blocks", type=int, default=2000,
                   help="GPU pool blocks in the replay (default: 2000, ~1M tokens at the trace's 512-token blocks)")
    p.add_argument("--host-blocks", type=int, default=8000, help="host-RAM tier capacity in blocks (default: 8000)")
    p.add_argument("--disk-blocks", type=int, default=24000, help="disk tier capacity in blocks (default: 24000)")
    p.add_argument("--skip-ttft", action="store_true", help="skip part 1")
    p.add_argument("--skip-trace", action="store_true", help="skip part 2")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="where results are written")
    return p.parse_args(argv)


# -- part 1: resumed-session TTFT ------------------------------------------------------
async def ttft_run(args, model_dir: Path, disk_dir: Path) -> dict:
    import grpc

    from services.cachestore.disk_demotion import AgeDemotion
    from services.cachestore.disk_tier import DiskTier
    from services.cachestore.errors import ERROR_RULES as STORE_RULES
    from services.cachestore.host_tier import HostTier
    from services.cachestore.server import CacheStoreServicer
    from services.cachestore.tiers import TieredStore, TierPolicyName, make_tier_policy
    from services.executor.engine.async_engine import AsyncEngine
    from services.executor.engine.engine import LLMEngine
    from services.executor.engine.config import EngineConfig
    from services.executor.server import ERROR_RULES, ExecutorServicer
    from services.executor.tiers.tier_ops import build_tier_ops
    from services.mesh.grpc_server import GrpcServer, channel_options
    from weft.v1 import cachestore_pb2_grpc, common_pb2, executor_pb2, executor_pb2_grpc

    bs = args.block_size
    blocks_per_session = -(-(args.context_tokens + args.new_tokens + 16) // bs)
    num_kv_blocks = max(blocks_per_session + 2, int(blocks_per_session * args.pool_sessions))
    # Every sweep archives everything (max idle 0): how the disk mode puts a session on disk only.
    archive_all = AgeDemotion(max_idle_s=-1.0)
    store = TieredStore(HostTier(1 << 34), DiskTier(disk_dir, 1 << 34, fsync=True),
                        make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT), archive_all)
    store_server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, rules=STORE_RULES, grace_s=0.1,
                              max_message_bytes=64 << 20)
    cachestore_pb2_grpc.add_CacheStoreServicer_to_server(CacheStoreServicer(store, 64 << 20, 1 << 20),
                                                         store_server.server)
    store_port = await store_server.start()
    engine = LLMEngine(model_dir, EngineConfig(num_kv_blocks=num_kv_blocks, block_size=bs, num_threads=args.threads,
                                               max_num_batched_tokens=4096, max_prefill_chunk=4096))
    async_engine = AsyncEngine(engine)
    tiers = build_tier_ops(async_engine, f"127.0.0.1:{store_port}", engine.model_id, bs, "sessions")
    servicer = ExecutorServicer(async_engine, "executor-bench", engine.model_id, bs, tiers=tiers)
    exec_server = GrpcServer("weft.v1.Executor", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1,
                             max_message_bytes=64 << 20)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, exec_server.server)
    exec_port = await exec_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{exec_port}", options=channel_options(64 << 20))
    stub = executor_pb2_grpc.ExecutorStub(channel)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)

    async def generate(rid, prompt, max_tokens, session=""):
        req = executor_pb2.ExecuteRequest(request_id=rid, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        if session:
            req.session.session_id = session
        start = time.perf_counter()
        ttft, tokens, cached = None, [], 0
        async for chunk in stub.Generate(req, timeout=600):
            if ttft is None and chunk.token_ids_delta:
                ttft = time.perf_counter() - start
            tokens.extend(chunk.token_ids_delta)
            cached = chunk.usage.num_cached_tokens
        return ttft, tokens, cached

    results = {m: [] for m in MODES}
    cached_tokens = {m: [] for m in MODES}
    try:
        contexts = []
        await generate("warmup", [rng.randrange(vocab) for _ in range(64)], 2)
        for i in tqdm(range(args.sessions), desc="first hops", unit="session"):
            prompt = [rng.randrange(vocab) for _ in range(args.context_tokens)]
            _, out, _ = await generate(f"s{i}-hop0", prompt, 16, session=f"s{i}")
            contexts.append(prompt + out + [rng.randrange(vocab) for _ in range(args.new_tokens)])
        await tiers.drain()
        local = await async_engine.call(lambda e: len(e.pool.cached_hashes()))
        with tqdm(total=args.sessions * len(MODES), desc="resumed hops", unit="req") as bar:
            for i, ctx in enumerate(contexts):
                for mode in MODES:
                    await async_engine.call(lambda e: e.pool.evict_cached(e.pool.cached_hashes()))
                    if mode == "disk tier":
                        await asyncio.to_thread(store.sweep)  # RAM → disk: only the disk copy remains
                    tiers.promote_before_prefill = mode != "recompute"
                    tiers.force_promotion = True  # time the load path whatever the cost model says
                    ttft, _, cached = await generate(f"s{i}-hop1-{mode}", ctx, 1)
                    results[mode].append(ttft)
                    cached_tokens[mode].append(cached)
                    bar.update()
        # What the cost model decides with the rates it measured: transfer from the
        # promotions above, prefill from every request's submission to first token.
        probe = contexts[0]
        block_bytes = await tiers.promoter.block_bytes()
        cost = tiers.promoter.cost
        n_blocks = (len(probe) - 1) // bs
        decision = {
            "transfer_MB_per_s": cost.transfer_bytes_per_s / 1e6,
            "prefill_tokens_per_s": cost.prefill_tokens_per_s,
            "block_bytes": block_bytes,
            "load_ms": cost.load_s(n_blocks, block_bytes) * 1000,
            "recompute_ms": cost.recompute_s(n_blocks, bs) * 1000,
            "choice": "load" if cost.should_load(n_blocks, block_bytes, bs) else "recompute",
        }
        return {"ttft_s": results, "cached_tokens": cached_tokens, "num_kv_blocks": num_kv_blocks,
                "blocks_per_session": blocks_per_session, "local_blocks_after_first_hops": local,
                "store_blocks": len(store.host) + len(store.disk), "decision": decision}
    finally:
        await channel.close()
        await tiers.promoter.client.close()
        await exec_server.server.stop(0)
        await store_server.server.stop(0)
        async_engine.shutdown()


# -- part 2: trace replay ----------------------------------------------------------------
def trace_run(args, disk_dir: Path) -> dict | None:
    from services.cachestore.blocks import Block, BlockMeta, checksum
    from services.cachestore.disk_demotion import PauseAwareDemotion
    from services.cachestore.disk_tier import DiskTier
    from services.cachestore.host_tier import HostTier
    from services.cachestore.tiers import Tier, TieredStore, TierPolicyName, make_tier_policy
    from services.shared.block_hash import hash_block
    from services.executor.kv.block_pool import BlockPool, BlockRemoved

    if not args.trace.is_file():
        print(f"trace {args.trace} not found: skipping the replay", file=sys.stderr)
        return None
    rows = []
    with args.trace.open() as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= args.max_requests:
                break
    payload = bytes(64)  # the simulation moves tiny payloads: hit rates do not depend on bytes
    size = len(payload)
    chain_cache: dict[tuple[int, ...], int] = {}

    def hashes_of(ids: list[int]) -> list[int]:
        out, parent = [], None
        for i in range(len(ids)):
            key = tuple(ids[: i + 1]) if i < 4 else None  # memoise the common heads only
            h = chain_cache.get(key) if key else None
            if h is None:
                tokens = random.Random(ids[i]).choices(range(32000), k=args.sim_block_size)
                h = hash_block(parent, tokens, b"sim\x00")
                if key:
                    chain_cache[key] = h
            out.append(h)
            parent = h
        return out

    def block(h: int) -> Block:
        return Block(BlockMeta(h, "uint8", (size,), size, checksum(payload)), payload)

    disk_bytes_per_block = DiskTier(disk_dir / "probe", 1 << 20, fsync=False).file_size(block(1))
    seen: set[int] = set()
    stats = {"gpu": {"hits": 0}, "tiers": {"hits": 0, "gpu": 0, "sleeping": 0, "archived": 0}, "ideal": {"hits": 0}}
    total = 0
    pools = {name: BlockPool(args.gpu_blocks, args.sim_block_size) for name in ("gpu", "tiers")}
    store = TieredStore(HostTier(args.host_blocks * size), DiskTier(disk_dir / "disk", args.disk_blocks *
                                                                     disk_bytes_per_block, fsync=False),
                        make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT),
                        PauseAwareDemotion(max_idle_s=120.0), clock=lambda: now_s)
    now_s = 0.0
    for n, row in enumerate(tqdm(rows, desc="trace replay", unit="req")):
        now_s = row["timestamp"] / 1000.0
        hashes = hashes_of(row["hash_ids"])[: args.gpu_blocks - 1]
        total += len(hashes)
        stats["ideal"]["hits"] += sum(1 for h in hashes if h in seen)
        seen.update(hashes)
        for name, pool in pools.items():
            hits = pool.get_cached_blocks(hashes)
            k = len(hits)
            extra = 0
            if name == "tiers":
                stats["tiers"]["gpu"] += k
                for h in hashes[k:]:  # promotion: the run right after the GPU hits
                    tier = store.tier_of(h)
                    if tier is None or store.get(h) is None:
                        break
                    stats["tiers"][tier.value] += 1
                    extra += 1
            stats[name]["hits"] += k + extra
            pool.touch(hits)
            fresh = pool.allocate(len(hashes) - k)
            if fresh is None:
                pool.free(hits)
                continue
            pool.cache_full_blocks(fresh, hashes[k:], hashes[k - 1] if k else None)
            pool.free(hits + fresh)
            pool.take_events()
            if name == "tiers":  # demote on finish: what the store lacks
                for h in hashes:
                    if store.tier_of(h) is None:
                        store.put(block(h))
                if n % 50 == 0:
                    store.sweep()
                store.take_changes()
    rate = {k: v["hits"] / total for k, v in stats.items()}
    return {"num_requests": len(rows), "num_blocks": total, "hit_rate": rate,
            "tier_split": {t: stats["tiers"][t] / total for t in ("gpu", "sleeping", "archived")},
            "disk_blocks_at_end": len(store.disk), "host_blocks_at_end": len(store.host),
            "demoted_to_disk": store.counters.num_demoted_to_disk, "dropped": store.counters.num_dropped}


# -- report ------------------------------------------------------------------------------
def report(args, ttft: dict | None, trace: dict | None, seconds: float) -> str:
    out = ["# KV tiers: resumed-session TTFT and trace hit rates", "",
           f"`python benchmarks/tiers.py {' '.join(sys.argv[1:])}`".replace("  ", " "), "",
           f"Machine: {os.cpu_count()} CPU cores (shared), loopback only; run took {seconds:.0f} s.", ""]
    if ttft:
        out += ["## Resumed session: time to first token", "",
                f"{args.preset} preset, {args.sessions} sessions of {args.context_tokens} prompt tokens "
                f"(+16 generated, +{args.new_tokens} new on resume), block size {args.block_size}, executor pool "
                f"{ttft['num_kv_blocks']} blocks ({ttft['blocks_per_session']} per session; "
                f"{ttft['local_blocks_after_first_hops']} cached blocks left on the executor after the first hops). "
                "Each resumed hop's local copy is dropped first, so the prefix comes from the named tier "
                "or is recomputed.", ""]
        rows = []
        for m in MODES:
            xs = ttft["ttft_s"][m]
            rows.append([m, f"{statistics.median(xs) * 1000:.1f}", f"{min(xs) * 1000:.1f}", f"{max(xs) * 1000:.1f}",
                         f"{statistics.median(ttft['cached_tokens'][m]):.0f}"])
        out += [write_markdown(["prefix from", "TTFT p50 (ms)", "min", "max", "cached tokens (p50)"], rows), "",
                "The disk tier's files were written moments earlier, so its reads mostly hit the OS page "
                "cache: the gap to the host tier is file open/read plus checksum verification, not device "
                "latency. Both load paths still pay ~2 gRPC messages per block and an import on the engine "
                "thread; recompute pays the whole prefill.", ""]
        d = ttft["decision"]
        out += [f"Cost model with measured rates: transfer {d['transfer_MB_per_s']:.0f} MB/s, prefill "
                f"{d['prefill_tokens_per_s']:.0f} tok/s, {d['block_bytes']} B/block → load "
                f"{d['load_ms']:.1f} ms vs recompute {d['recompute_ms']:.1f} ms for one session: "
                f"**{d['choice']}**.", ""]
    if trace:
        r = trace["hit_rate"]
        out += ["## Block hit rate on the Mooncake synthetic trace", "",
                f"{trace['num_requests']} requests, {trace['num_blocks']} blocks (hash ids → {args.sim_block_size}-token "
                f"blocks); GPU pool {args.gpu_blocks} blocks, host tier {args.host_blocks}, disk tier "
                f"{args.disk_blocks}.", ""]
        split = trace["tier_split"]
        rows = [["GPU pool only (LRU)", f"{r['gpu'] * 100:.1f} %", ""],
                ["full hierarchy", f"{r['tiers'] * 100:.1f} %",
                 f"GPU {split['gpu'] * 100:.1f} % + host {split['sleeping'] * 100:.1f} % + disk "
                 f"{split['archived'] * 100:.1f} %"],
                ["ideal (unbounded)", f"{r['ideal'] * 100:.1f} %", ""]]
        out += [write_markdown(["cache", "block hit rate", "served by"], rows), "",
                f"At the end: {trace['host_blocks_at_end']} blocks in RAM, {trace['disk_blocks_at_end']} on disk; "
                f"{trace['demoted_to_disk']} demotions RAM → disk, {trace['dropped']} blocks dropped.", ""]
    return "\n".join(out)


def main(argv=None) -> None:
    args = parse_args(argv)
    from services.mesh.logging import configure_logging

    configure_logging("bench", "warning")
    start = time.perf_counter()
    ttft = trace = None
    with tempfile.TemporaryDirectory(prefix="weft-tiers-") as tmp:
        if not args.skip_ttft:
            if args.model is None:
                from weft.testing.tiny_model import make_tiny_checkpoint

                model_dir = args.cache_dir / args.preset
                if not (model_dir / "config.json").is_file():
                    make_tiny_checkpoint(model_dir, preset=args.preset)
            else:
                model_dir = args.model
            ttft = asyncio.run(ttft_run(args, model_dir.resolve(), Path(tmp) / "ttft"))
        if not args.skip_trace:
            trace = trace_run(args, Path(tmp) / "trace")
    text = report(args, ttft, trace, time.perf_counter() - start)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "tiers.md").write_text(text + "\n")
    if ttft:
        write_bar_chart(args.out_dir / "tiers.png", "Resumed-session TTFT by where the prefix comes from",
                        [f"{args.context_tokens}-token context"],
                        {m: [statistics.median(ttft["ttft_s"][m]) * 1000] for m in MODES}, ylabel="TTFT p50 (ms)")
    if trace:
        r = trace["hit_rate"]
        write_bar_chart(args.out_dir / "tiers_hit_rate.png", "Block hit rate, Mooncake synthetic trace",
                        ["hit rate"], {"GPU pool only": [r["gpu"] * 100], "full hierarchy": [r["tiers"] * 100],
                                       "ideal": [r["ideal"] * 100]}, ylabel="% of blocks")
    print(text)


if __name__ == "__main__":
    main()

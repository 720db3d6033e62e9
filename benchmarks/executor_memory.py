"""Where an executor's memory goes under steady load: RSS and Python heap per request.

Runs the executor's own gRPC servicer (``ExecutorServicer`` over ``AsyncEngine`` over
``LLMEngine``) in this process, with the tiny model, one torch thread and the executor's
oneDNN cache caps, and no network: ``--concurrency`` client loops call ``Generate``
with a fake gRPC context, each request a distinct random prompt of 10-20 tokens and
``--max-tokens`` output tokens (EOS ignored); kv events are encoded to protobuf and
dropped, as the executor would publish them. Every ``--sample-every`` requests it
records RSS (psutil), the prefix cache's resident hashes and, with ``--tracemalloc``,
the Python heap and its largest growth by file:line since the first sample.

Separates the candidate causes of a slow RSS creep:
  bounded     the prefix cache filling up to the pool: compare --num-kv-blocks small
              (full within seconds) with the default pool (1 GiB of KV)
  allocator   glibc arenas: --malloc-trim calls malloc_trim(0) at each sample and also
              records RSS after it; run under MALLOC_ARENA_MAX=2 to compare
  leak        Python objects: --tracemalloc top growth by file:line

Stops after --duration-s (at most 600) or --requests, whichever comes first; prints a
table (markdown) and the slope of RSS per 1,000 requests over each half of the samples.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import os
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.executor.process_env import apply_executor_env  # noqa: E402

apply_executor_env()  # the executor processes' torch runtime settings, before torch loads
from services.mesh.onednn_caches import bound_onednn_caches  # noqa: E402

bound_onednn_caches()  # as services/executor/__main__.py, before torch loads

import psutil  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.report import write_markdown  # noqa: E402

MIB = 1024 * 1024


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=120.0, help="wall-clock bound (default: 120, max 600)")
    p.add_argument("--requests", type=int, default=0, help="stop after this many requests (default: 0, no bound)")
    p.add_argument("--concurrency", type=int, default=8, help="client loops at once (default: 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default: 32)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: the executor's 1 GiB of KV)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--sample-every", type=int, default=500, help="requests between samples (default: 500)")
    p.add_argument("--tracemalloc", action="store_true", help="trace Python allocations (slower) and diff them")
    p.add_argument("--baseline-at", type=int, default=0,
                   help="requests done before the tracemalloc baseline snapshot (default: 0, the first sample)")
    p.add_argument("--top", type=int, default=12, help="file:line growth rows shown with --tracemalloc")
    p.add_argument("--malloc-trim", action="store_true", help="malloc_trim(0) at each sample; RSS after it too")
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: a generated tiny model)")
    p.add_argument("--seed", type=int, default=0, help="prompt generator seed")
    args = p.parse_args(argv)
    if not 0 < args.duration_s <= 600 or args.concurrency < 1 or args.sample_every < 1:
        p.error("0 < --duration-s <= 600, --concurrency >= 1, --sample-every >= 1")
    return args


class FakeContext:
    """The bits of ``grpc.aio.ServicerContext`` that ``Generate`` touches."""

    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = metadata

    async def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


def malloc_trim() -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def slope_per_k(points: list[tuple[int, float]]) -> float:
    """Least-squares MiB per 1,000 requests."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / den if den else float("nan")


async def run(args: argparse.Namespace, model_dir: Path) -> tuple[list[dict], list[str], int]:
    from services.executor.engine.async_engine import AsyncEngine
    from services.executor.engine.engine import LLMEngine
    from services.executor.engine.config import EngineConfig
    from services.executor.events import KvChange
    from services.executor.event_codec import encode_event
    from services.executor.server import ExecutorServicer
    from services.executor.engine.step_trace import StepTrace
    from weft.v1 import common_pb2, executor_pb2

    config = EngineConfig(num_threads=1, num_kv_blocks=args.num_kv_blocks,
                          enable_prefix_caching=not args.no_prefix_caching)
    engine = LLMEngine(model_dir, config, step_trace=StepTrace("mem"))
    num_events = [0]

    def on_kv_events(events) -> None:  # what the executor publishes, minus the bus
        for e in events:
            encode_event(KvChange(e, engine.model_id, config.block_size)).SerializeToString()
        num_events[0] += len(events)

    async_engine = AsyncEngine(engine, on_kv_events=on_kv_events)
    servicer = ExecutorServicer(async_engine, "mem", engine.model_id, config.block_size, step_trace=engine.step_trace)
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    proc = psutil.Process()
    samples: list[dict] = []
    done = [0]
    deadline = time.monotonic() + args.duration_s
    bar = tqdm(total=args.requests or None, desc="requests", unit="req", mininterval=5.0)
    baseline = None
    start = time.monotonic()

    def sample() -> None:
        nonlocal baseline
        gc.collect()
        row = {"requests": done[0], "elapsed_s": time.monotonic() - start, "rss_mib": proc.memory_info().rss / MIB,
               "cached_hashes": len(engine.pool._cached), "free_blocks": engine.pool.num_free_blocks,
               "step_records": len(engine.step_trace), "kv_events": num_events[0]}
        if args.tracemalloc:
            row["heap_mib"] = tracemalloc.get_traced_memory()[0] / MIB
            if baseline is None and done[0] >= args.baseline_at:
                baseline = tracemalloc.take_snapshot()
        if args.malloc_trim:
            malloc_trim()
            row["rss_trimmed_mib"] = proc.memory_info().rss / MIB
        samples.append(row)
        bar.set_postfix(rss=f"{row['rss_mib']:.1f}", hashes=row["cached_hashes"])

    async def client(loop_id: int) -> None:
        n = 0
        while time.monotonic() < deadline and (not args.requests or done[0] < args.requests):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(10, 20))]
            req = executor_pb2.ExecuteRequest(
                request_id=f"r{loop_id}-{n}", prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True))
            async for _ in servicer.Generate(req, FakeContext()):
                pass
            n += 1
            done[0] += 1
            bar.update(1)
            if done[0] % args.sample_every == 0:
                sample()

    if args.tracemalloc:
        tracemalloc.start(1)
    sample()
    try:
        await asyncio.gather(*(client(i) for i in range(args.concurrency)))
    finally:
        bar.close()
        async_engine.shutdown()
    sample()
    top: list[str] = []
    if args.tracemalloc and baseline is not None:
        stats = tracemalloc.take_snapshot().compare_to(baseline, "lineno")
        for s in stats[: args.top]:
            frame = s.traceback[0]
            top.append(f"{s.size_diff / 1024:+10.1f} KiB {s.count_diff:+8d} objs  "
                       f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}")
    return samples, top, engine.num_blocks


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from weft.testing.tiny_model import make_tiny_checkpoint

            model_dir = make_tiny_checkpoint(Path(tmp) / "tiny", preset="tiny")
        samples, top, num_blocks = asyncio.run(run(args, model_dir))
    cols = ["requests", "elapsed_s", "rss_mib", "rss_trimmed_mib", "heap_mib", "cached_hashes", "free_blocks",
            "step_records", "kv_events"]
    cols = [c for c in cols if c in samples[0]]
    rows = [[f"{s[c]:.1f}" if isinstance(s[c], float) else s[c] for c in cols] for s in samples]
    print(f"\nMALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', 'unset')} num_kv_blocks={num_blocks} "
          f"concurrency={args.concurrency} prefix_caching={not args.no_prefix_caching}")
    print(write_markdown(cols, rows))
    half = len(samples) // 2
    for key in [c for c in ("rss_mib", "rss_trimmed_mib", "heap_mib") if c in samples[0]]:
        pts = [(s["requests"], s[key]) for s in samples[1:]]  # the first sample precedes the warm-up
        print(f"{key}: MiB per 1k requests, 1st half {slope_per_k(pts[:half]):+.2f}, "
              f"2nd half {slope_per_k(pts[half - 1:]):+.2f}")
    if top:
        print(f"\nlargest heap growth since request {args.baseline_at} (file:line):")
        print("\n".join(top))


if __name__ == "__main__":
    main()

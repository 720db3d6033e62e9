"""Disconnect storm: clients that hang up 1-80 ms after sending, against a loopback mesh.

Issue 12's critical fault: 400 streaming /v1/completions whose clients abandoned the
connection right after sending killed the engine thread of every executor (a command
result set on a future the disconnect had already cancelled). This replays that storm
against `weft up`'s code on 127.0.0.1 and reports what is left afterwards:

- per executor: its pid before and after (a changed pid = it died and was restarted),
  grpc health, requests running / waiting and free KV blocks against the idle baseline,
  and how long after the storm the executor was back to that baseline;
- a follow-up of normal streaming requests: how many completed, and on which executors.

Loopback only; bounded in count (--requests) and time (--deadline-s); stops by itself.
Writes benchmarks/results/disconnect_storm.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.loopback_mesh import loopback_mesh, served_model, stream_completion, tenant_keys  # noqa: E402
from benchmarks.report import write_markdown  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="abandoned streaming requests sent (default: 400)")
    p.add_argument("--concurrency", type=int, default=40, help="abandoned requests in flight at once (default: 40)")
    p.add_argument("--min-prompt-ids", type=int, default=20, help="shortest prompt, in token ids (default: 20)")
    p.add_argument("--max-prompt-ids", type=int, default=300, help="longest prompt, in token ids (default: 300)")
    p.add_argument("--max-tokens", type=int, default=100, help="max_tokens of each request (default: 100)")
    p.add_argument("--min-abandon-ms", type=float, default=1.0, help="earliest hang-up after sending (default: 1)")
    p.add_argument("--max-abandon-ms", type=float, default=80.0, help="latest hang-up after sending (default: 80)")
    p.add_argument("--follow-up", type=int, default=8, help="normal streams sent after the storm (default: 8)")
    p.add_argument("--executors", type=int, default=2, help="executor processes of the mesh (default: 2)")
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the generated tiny model)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and hang-up delays (default: 0)")
    p.add_argument("--deadline-s", type=float, default=300.0,
                   help="longest wait for the executors to return to baseline after the storm (default: 300)")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "disconnect_storm.json",
                   help="where the JSON summary is written")
    p.add_argument("--state-dir", type=Path, default=None, help="mesh state and logs (default: a temporary directory)")
    return p.parse_args(argv)


async def abandoned_request(host: str, port: int, api_key: str, body: bytes, abandon_s: float) -> None:
    """Send one streaming POST, wait ``abandon_s``, then drop the connection (RST, no FIN)."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    writer.write(head + body)
    await writer.drain()
    await asyncio.sleep(abandon_s)
    writer.transport.abort()


async def executor_snapshot(state_dir: Path) -> dict[str, dict]:
    """Per executor: pid, health and the engine's counters (GetStats over the mesh channel)."""
    from services.mesh.mesh_auth import mesh_channel
    from weft.health import probe_grpc
    from weft.launcher.mesh_state import read_state
    from weft.v1 import executor_pb2, executor_pb2_grpc

    out = {}
    for inst in read_state(state_dir).by_service("executor"):
        address = f"127.0.0.1:{inst.health_port}"
        row = {"pid": inst.pid, "healthy": await probe_grpc(address)}
        try:
            async with mesh_channel(address) as channel:
                stats = await executor_pb2_grpc.ExecutorStub(channel).GetStats(executor_pb2.GetStatsRequest(),
                                                                              timeout=5)
            row.update(num_running=stats.num_running, num_waiting=stats.num_waiting,
                       num_free_blocks=stats.num_free_blocks, num_blocks=stats.num_blocks)
        except Exception as exc:  # noqa: BLE001  (a dead executor is a result)
            row["error"] = type(exc).__name__
        out[inst.name] = row
    return out


def at_baseline(row: dict, base: dict) -> bool:
    return (row.get("healthy") and "error" not in row and row["num_running"] == 0 and row["num_waiting"] == 0
            and row["num_free_blocks"] == base["num_free_blocks"])


async def run(args: argparse.Namespace, state, state_dir: Path, keys: list[str]) -> dict:
    rng = random.Random(args.seed)
    host, port = "127.0.0.1", int(state.http_url.rsplit(":", 1)[1])
    async with aiohttp.ClientSession() as session:
        model = await served_model(session, state.http_url, keys[0])
    baseline = await executor_snapshot(state_dir)
    sem = asyncio.Semaphore(args.concurrency)
    failures: Counter = Counter()
    bar = tqdm(total=args.requests, desc="abandoned requests", unit="req")

    async def one(i: int) -> None:
        ids = [rng.randrange(3, 200) for _ in range(rng.randint(args.min_prompt_ids, args.max_prompt_ids))]
        body = json.dumps({"model": model, "prompt": ids, "max_tokens": args.max_tokens, "stream": True,
                           "ignore_eos": True}).encode()
        abandon_s = rng.uniform(args.min_abandon_ms, args.max_abandon_ms) / 1000
        async with sem:
            try:
                await abandoned_request(host, port, keys[i % len(keys)], body, abandon_s)
            except OSError as exc:
                failures[type(exc).__name__] += 1
            bar.update()

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    bar.close()
    storm_s = time.monotonic() - t0
    t_end = time.monotonic()
    after = await executor_snapshot(state_dir)
    while not all(at_baseline(after[n], baseline[n]) for n in baseline if n in after):
        if time.monotonic() - t_end > args.deadline_s:
            break
        await asyncio.sleep(0.25)
        after = await executor_snapshot(state_dir)
    drained_s = time.monotonic() - t_end
    async with aiohttp.ClientSession() as session:
        follow = await asyncio.gather(*(
            stream_completion(session, state.http_url, keys[i % len(keys)], model, f"follow-up request {i} " * 8,
                              16, 120.0) for i in range(args.follow_up)))
    return {
        "requests": args.requests, "concurrency": args.concurrency, "connect_failures": dict(failures),
        "storm_s": round(storm_s, 2), "back_to_baseline_s": round(drained_s, 2),
        "executors": {n: {"before": baseline[n], "after": after.get(n)} for n in baseline},
        "restarted": sorted(n for n in baseline if after.get(n, {}).get("pid") != baseline[n]["pid"]),
        "follow_up_ok": sum(r.ok for r in follow), "follow_up": args.follow_up,
        "follow_up_errors": dict(Counter(r.error for r in follow if not r.ok)),
    }


async def main(argv=None) -> int:
    args = parse_args(argv)
    keys = tenant_keys(4)
    with tempfile.TemporaryDirectory(prefix="weft-storm-") as tmp:
        state_dir = args.state_dir or Path(tmp)
        async with loopback_mesh(state_dir, args.model, args.executors, keys,
                                 {"WEFT_EXECUTOR_NUM_THREADS": "1"}) as state:
            summary = await run(args, state, state_dir, list(keys))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2) + "\n")
    rows = []
    for name, e in summary["executors"].items():
        after = e["after"] or {"error": "gone"}
        stats = (f"GetStats failed: {after['error']}" if "error" in after else
                 f"{after['num_running']}/{after['num_waiting']}, free {after['num_free_blocks']}"
                 f"/{e['before']['num_free_blocks']}")
        rows.append([name, str(e["before"]["pid"]), str(after.get("pid")), str(after.get("healthy")), stats])
    print(write_markdown(["executor", "pid before", "pid after", "healthy after", "running/waiting, free blocks after/before"], rows))
    print(f"\nstorm {summary['requests']} requests in {summary['storm_s']} s; back to baseline "
          f"{summary['back_to_baseline_s']} s after; follow-up {summary['follow_up_ok']}/{summary['follow_up']} ok")
    ok = summary["follow_up_ok"] == summary["follow_up"] and not summary["restarted"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

"""Soak: steady streaming load on a loopback mesh for --duration-s, sampling every
service's resident memory (RSS), open file descriptors and asyncio task count, and
reporting the slope of each (least squares after a warm-up) — flat lines mean no leak.

Starts NATS + router + scheduler + cachestore + --executors executors on 127.0.0.1 with
the tiny model. --concurrency clients loop over streaming /v1/completions calls (spread
over --tenants API keys) until the duration is up, then stop by themselves. RSS and fds
come from /proc via psutil; task counts from each Python service's weft_asyncio_tasks
gauge (Prometheus endpoint). NATS is sampled for RSS and fds only.

Writes benchmarks/results/reliability_soak.json and reliability_soak.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import psutil  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.load import prompt_for  # noqa: E402
from benchmarks.loopback_mesh import loopback_mesh, served_model, stream_completion, tenant_keys  # noqa: E402
from benchmarks.report import write_markdown  # noqa: E402

METRICS_PORT_KEYS = {"scheduler": "scheduler_metrics_port", "executor": "executor_metrics_port",
                     "cachestore": "cachestore_metrics_port", "router": "router_metrics_port"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=600.0, help="how long the load runs (default: 600)")
    p.add_argument("--concurrency", type=int, default=32, help="client loops streaming at once (default: 32)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request, EOS ignored (default: 32)")
    p.add_argument("--tenants", type=int, default=4, help="API keys / tenants the clients use (default: 4)")
    p.add_argument("--executors", type=int, default=2, help="executor processes (default: 2)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between resource samples (default: 5)")
    p.add_argument("--warmup-frac", type=float, default=0.2,
                   help="leading fraction of samples left out of the slope fit (default: 0.2)")
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the generated tiny model)")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="deadline of one request (default: 120)")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "reliability_soak.json",
                   help="JSON result; the PNG goes beside it with the same stem")
    p.add_argument("--state-dir", type=Path, default=None, help="mesh state and logs (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.duration_s <= 0 or args.concurrency < 1 or args.sample_s <= 0 or not 0 <= args.warmup_frac < 1:
        p.error("--duration-s, --sample-s > 0, --concurrency >= 1, 0 <= --warmup-frac < 1")
    return args


async def tasks_gauge(session: aiohttp.ClientSession, url: str) -> float | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith("weft_asyncio_tasks "):
                    return float(line.split()[1])
    except (aiohttp.ClientError, TimeoutError):
        return None
    return None


async def sample(session: aiohttp.ClientSession, state) -> dict[str, dict[str, float | None]]:
    out = {}
    for inst in state.instances:
        try:
            proc = psutil.Process(inst.pid)
            rss_mib, fds = proc.memory_info().rss / 2**20, float(proc.num_fds())
        except psutil.Error:
            rss_mib, fds = None, None
        if inst.service in METRICS_PORT_KEYS:
            url = f"http://127.0.0.1:{inst.ports[METRICS_PORT_KEYS[inst.service]]}/metrics"
        else:
            url = None
        tasks = await tasks_gauge(session, url) if url else None
        out[inst.name] = {"rss_mib": rss_mib, "fds": fds, "tasks": tasks}
    return out


def slope_per_hour(ts: list[float], ys: list[float | None]) -> float | None:
    pts = [(t, y) for t, y in zip(ts, ys) if y is not None and y >= 0]
    if len(pts) < 3:
        return None
    n = len(pts)
    mt, my = sum(t for t, _ in pts) / n, sum(y for _, y in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return 0.0 if var == 0 else sum((t - mt) * (y - my) for t, y in pts) / var * 3600.0


async def drive(args, state, keys: list[str], stop_at: float, counts: dict) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = await served_model(session, state.http_url, keys[0])

        async def loop(worker: int) -> None:
            i = 0
            while time.monotonic() < stop_at:
                r = await stream_completion(session, state.http_url, keys[worker % len(keys)], model,
                                            prompt_for(worker * 100_000 + i, 12), args.max_tokens,
                                            args.request_timeout_s)
                counts["ok" if r.ok else "errors"] += 1
                counts["tokens"] += r.num_tokens
                i += 1

        await asyncio.gather(*(loop(w) for w in range(args.concurrency)))


async def soak(args, state, keys: list[str]) -> dict:
    counts = {"ok": 0, "errors": 0, "tokens": 0}
    t0 = time.monotonic()
    stop_at = t0 + args.duration_s
    driver = asyncio.create_task(drive(args, state, keys, stop_at, counts))
    times, samples = [], []
    bar = tqdm(total=int(args.duration_s), desc="soak", unit="s")
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop_at and not driver.done():
            times.append(time.monotonic() - t0)
            samples.append(await sample(session, state))
            bar.n = int(min(args.duration_s, time.monotonic() - t0))
            bar.set_postfix(ok=counts["ok"], errors=counts["errors"])
            bar.refresh()
            await asyncio.sleep(args.sample_s)
        await driver  # clients finish their last request (bounded by --request-timeout-s)
        times.append(time.monotonic() - t0)
        samples.append(await sample(session, state))
    bar.close()
    skip = int(len(times) * args.warmup_frac)
    services = {}
    for name in samples[0]:
        series = {k: [s.get(name, {}).get(k) for s in samples] for k in ("rss_mib", "fds", "tasks")}
        # The last sample is taken after the clients stopped: reported, not fitted.
        services[name] = {
            **{f"{k}_first": series[k][skip] for k in series},
            **{f"{k}_last": series[k][-2] for k in series},
            **{f"{k}_after_load": series[k][-1] for k in series},
            **{f"{k}_slope_per_h": _round(slope_per_hour(times[skip:-1], series[k][skip:-1])) for k in series},
            "series": series,
        }
    wall_s = times[-1]
    return {"duration_s": args.duration_s, "wall_s": round(wall_s, 1), "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "requests_ok": counts["ok"], "requests_failed": counts["errors"],
            "tokens_per_s": round(counts["tokens"] / wall_s, 1), "sample_s": args.sample_s,
            "warmup_samples_skipped": skip, "times_s": [round(t, 1) for t in times], "services": services}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label in zip(axes, ("rss_mib", "fds", "tasks"), ("RSS (MiB)", "open fds", "asyncio tasks")):
        for name, svc in result["services"].items():
            ys = svc["series"][key]
            if any(y is not None for y in ys):
                ax.plot(result["times_s"], [float("nan") if y is None else y for y in ys], label=name)
        ax.set_xlabel("seconds")
        ax.set_title(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"soak: {result['concurrency']} streams for {result['wall_s']:.0f} s, "
                 f"{result['requests_ok']} ok / {result['requests_failed']} failed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict) -> str:
    rows = []
    for name, s in result["services"].items():
        rows.append([name, *(f"{s[f'{k}_first']:.1f} → {s[f'{k}_last']:.1f} ({s[f'{k}_slope_per_h']:+.1f}/h)"
                             if s[f"{k}_slope_per_h"] is not None else "n/a" for k in ("rss_mib", "fds", "tasks"))])
    return write_markdown(["service", "RSS MiB first → last (slope)", "fds", "asyncio tasks"], rows)


async def main(argv=None) -> int:
    args = parse_args(argv)
    keys = tenant_keys(args.tenants)
    with tempfile.TemporaryDirectory(prefix="weft-soak-") as tmp:
        async with loopback_mesh(args.state_dir or Path(tmp), args.model, args.executors, keys,
                                 {"WEFT_EXECUTOR_NUM_THREADS": "1"}) as state:
            result = await soak(args, state, list(keys))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result) + "\n")
    plot(result, args.output.with_suffix(".png"))
    print(f"{result['requests_ok']} ok, {result['requests_failed']} failed, {result['tokens_per_s']} tok/s")
    print(table(result))
    return 0 if result["requests_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

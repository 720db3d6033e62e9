"""How long a service that (re)connects to NATS runs on its start-up values before it runs
the live-settings document: from a follower's connect to its apply, with the router's
default republish period.

One real nats-server on a free loopback port, one router (``RouterLiveSettings``, its
settings file overriding the scheduler's policy) and, one after another, ``--followers``
schedulers' ``SettingsFollower``s, each on a fresh bus started at a random point of the
router's republish period (as a restart is). Prints each sample and the median, p90 and
maximum. Since commit fb818db a follower asks for the document when it connects
(``weft.settingswant``); to compare with the periodic republish alone, run this file from
a worktree of the commit before, alternating (benchmarks/results/settings_catch_up.md).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--followers", type=int, default=20,
                   help="followers started one after another, one sample each (default: %(default)s)")
    p.add_argument("--republish-s", type=float, default=2.0,
                   help="the router's republish period, WEFT_SETTINGS_REPUBLISH_S (default: %(default)s, "
                        "the mesh's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the followers' random start offsets")
    p.add_argument("--json", action="store_true", help="print one JSON line of the samples at the end")
    args = p.parse_args(argv)
    if args.followers < 1 or not 0 < args.republish_s <= 60:
        p.error("need --followers >= 1 and 0 < --republish-s <= 60")
    return args


async def measure(args: argparse.Namespace) -> list[float]:
    from services.mesh.live_settings import SettingsFollower
    from services.mesh.mesh_auth import MeshSecurity
    from services.mesh.nats_bus import EventBus
    from services.mesh.nats_server import NatsServer
    from services.router.auth import KeyStore
    from services.router.live_settings import LiveOptions, RouterLiveSettings

    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="weft-catch-up-"))
    (folder / "settings.json").write_text(json.dumps({"scheduler": {"policy": "fcfs"}}))
    (folder / "keys.json").write_text("{}")
    security = MeshSecurity(secret="")
    samples: list[float] = []
    with NatsServer(log_path=folder / "nats.log") as server:
        live = RouterLiveSettings(KeyStore.from_file(folder / "keys.json"), str(folder / "keys.json"),
                                  LiveOptions(settings_file=str(folder / "settings.json"), nats_url=server.url,
                                              republish_s=args.republish_s), writer="bench", security=security)
        await live.start()
        try:
            deadline = time.monotonic() + 10 * args.republish_s + 30
            while live.listening:  # the router's own listen window at start (1.5 periods)
                if time.monotonic() > deadline:
                    raise RuntimeError("the router never claimed its document")
                await asyncio.sleep(0.01)
            for i in tqdm(range(args.followers), desc="followers", unit="follower", file=sys.stderr):
                await asyncio.sleep(rng.uniform(0, args.republish_s))  # a random phase of the period
                applied = asyncio.Event()
                follower = SettingsFollower("scheduler", "scheduler", lambda _section: applied.set(),
                                            security=security)
                bus = EventBus(server.url, f"scheduler-{i}")
                t0 = time.monotonic()
                await follower.subscribe(bus)
                await bus.start()
                try:
                    await asyncio.wait_for(applied.wait(), 10 * args.republish_s + 30)
                    samples.append(time.monotonic() - t0)
                finally:
                    await bus.close()
        finally:
            await live.stop()
    return samples


def main(argv=None) -> int:
    args = parse_args(argv)
    from services.mesh.logging import configure_logging

    configure_logging("bench", level="warning")  # the services' info lines would bury the progress bar
    samples = asyncio.run(measure(args))
    ms = sorted(s * 1000 for s in samples)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    print(f"catch-up ms over {len(ms)} followers: median {statistics.median(ms):.1f}, p90 {p90:.1f}, "
          f"max {ms[-1]:.1f} (republish every {args.republish_s:g} s)")
    if args.json:
        print(json.dumps({"samples_ms": [round(v, 2) for v in ms], "median_ms": statistics.median(ms),
                          "p90_ms": p90, "max_ms": ms[-1], "republish_s": args.republish_s}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

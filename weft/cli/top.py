"""``weft top``: a live terminal view of a running mesh.

Reads the mesh's state file (``<state dir>/mesh.json``) for its instances and ports,
scrapes every service's ``/metrics`` and the router's ``/v1/weft/verdict``, and
redraws once a second with plain ANSI (no curses: it works in any terminal, over ssh
and in ``tmux capture-pane``). ``--once`` prints one frame and exits (for scripts and
tests). Only the standard library and prometheus_client's text parser are used.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from services.shared.vocabulary import RUNG_LABELS
from weft.cli.state_dir import DEFAULT_STATE_DIR

Samples = list[tuple[str, dict[str, str], float]]  # (sample name, labels, value)


@dataclass
class ServiceView:
    name: str
    service: str
    pid: int
    up: bool
    samples: Samples = field(default_factory=list)
    restarts: int = 0  # by the launcher's supervisor (weft ps RESTARTS)
    last_exit: int | None = None
    status: str = "running"  # the supervisor's view: running, restarting, crash-loop, config-error, stopped


@dataclass
class Snapshot:
    taken_at: float
    services: list[ServiceView]
    verdict: dict | None


def _get(url: str, timeout_s: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (loopback URLs from the state file)
        return resp.read()


def parse_metrics(text: str) -> Samples:
    out: Samples = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.append((s.name, dict(s.labels), float(s.value)))
    return out


def _metrics_url(inst) -> str | None:
    port = inst.ports.get(f"{inst.service}_metrics_port")
    return f"http://127.0.0.1:{port}/metrics" if port else None


def take_snapshot(state, timeout_s: float = 1.0) -> Snapshot:
    """Scrape every instance of ``state`` (a ``MeshState``); unreachable ones show as down."""
    views = []
    for inst in state.instances:
        view = ServiceView(inst.name, inst.service, inst.pid, up=False, restarts=getattr(inst, "restarts", 0),
                           last_exit=getattr(inst, "last_exit", None), status=getattr(inst, "status", "running"))
        url = _metrics_url(inst)
        if url is None:  # nats: its health endpoint says up or down
            try:
                _get(f"http://127.0.0.1:{inst.health_port}{inst.health_path or '/healthz'}", timeout_s)
                view.up = True
            except OSError:
                pass
        else:
            try:
                view.samples = parse_metrics(_get(url, timeout_s).decode())
                view.up = True
            except (OSError, ValueError):
                pass
        views.append(view)
    verdict = None
    try:
        verdict = json.loads(_get(f"{state.http_url}/v1/weft/verdict", timeout_s))
    except (OSError, ValueError):
        pass
    return Snapshot(time.time(), views, verdict)


# -- numbers from samples -------------------------------------------------------------
def _value(samples: Samples, name: str, **labels) -> float | None:
    total, found = 0.0, False
    for n, lab, v in samples:
        if n == name and all(lab.get(k) == want for k, want in labels.items()):
            total, found = total + v, True
    return total if found else None


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus-style quantile from cumulative (upper bound, count) buckets."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            span = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / span if span else 1.0)
        prev_le, prev_count = le, count
    return prev_le


def latency_by_class(samples: Samples, metric: str) -> dict[str, tuple[int, float | None, float | None]]:
    """request class -> (count, p50 s, p99 s), tenants summed."""
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for n, lab, v in samples:
        if n == f"{metric}_bucket":
            buckets[lab.get("request_class", "")][float(lab["le"])] += v
    out = {}
    for cls, b in sorted(buckets.items()):
        pairs = sorted(b.items())
        count = int(pairs[-1][1]) if pairs else 0
        out[cls] = (count, histogram_quantile(0.5, pairs), histogram_quantile(0.99, pairs))
    return out


# -- rendering --------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms" if seconds < 10 else f"{seconds:.1f}s"


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"




def _ladder(samples) -> str:
    """Each request class's degradation rung, from the scheduler's weft_degradation_rung
    (the gauge's value is the rung's number, an index into RUNG_LABELS)."""
    rungs = {lab.get("request_class", "?"): int(v) for n, lab, v in samples if n == "weft_degradation_rung"}
    if not rungs:
        return "(no class observed yet)"
    return "   ".join(f"{cls} {RUNG_LABELS[r] if 0 <= r < len(RUNG_LABELS) else r}"
                      for cls, r in sorted(rungs.items()))


FOLLOWERS = ("router", "scheduler", "executor")  # services that run the live-settings document


def settings_versions_text(versions: dict[str, float | None]) -> str:
    """``version 5: router v5, scheduler v5, executor-0 v4 LAGGING`` (docs/live_config.md):
    which live-settings version each service runs; one behind the newest is flagged."""
    known = [v for v in versions.values() if v is not None]
    if not known:
        return "live settings: no service reports a version"
    newest = max(known)
    parts = [f"{name} ?" if v is None else f"{name} v{v:.0f}" + ("" if v == newest else " LAGGING")
             for name, v in versions.items()]
    return f"live settings version {newest:.0f}: " + ", ".join(parts)


def scrape_settings_versions(state, timeout_s: float = 1.0) -> dict[str, float | None]:
    """instance name -> the live-settings version it reports (None: unreachable)."""
    out: dict[str, float | None] = {}
    for inst in state.instances:
        url = _metrics_url(inst)
        if url is None or inst.service not in FOLLOWERS:
            continue
        try:
            out[inst.name] = _value(parse_metrics(_get(url, timeout_s).decode()), "weft_settings_version")
        except (OSError, ValueError):
            out[inst.name] = None
    return out


def _state(s: ServiceView) -> str:
    """up / DOWN from the scrape, unless the supervisor knows better (crash-loop: no
    longer restarted; restarting; stopped by weft chaos)."""
    if s.status in ("crash-loop", "config-error", "restarting", "stopped") and not s.up:
        return s.status.upper() if s.status in ("crash-loop", "config-error") else s.status
    return "up" if s.up else "DOWN"


def render(snap: Snapshot, width: int = 100) -> str:
    lines: list[str] = []
    router = next((s for s in snap.services if s.service == "router"), None)
    sched = next((s for s in snap.services if s.service == "scheduler"), None)
    executors = [s for s in snap.services if s.service == "executor"]
    cache = next((s for s in snap.services if s.service == "cachestore"), None)
    stamp = time.strftime("%H:%M:%S", time.localtime(snap.taken_at))
    up = sum(s.up for s in snap.services)
    lines.append(f"weft top  {stamp}  {up}/{len(snap.services)} services up  {len(executors)} executor(s)")
    lines.append("")
    lines.append(f"{'SERVICE':<12}{'NAME':<14}{'PID':>8}  {'STATE':<6}LOAD")
    for s in snap.services:
        load = ""
        if s.service == "router":
            load = f"streaming {_n(_value(s.samples, 'weft_router_in_flight_requests'))}"
        elif s.service == "scheduler":
            load = (f"queued {_n(_value(s.samples, 'weft_queue_depth', service='scheduler'))}  "
                    f"rejected {_n(_value(s.samples, 'weft_admission_rejections_total') or 0.0)}  "
                    f"executors {_n(_value(s.samples, 'weft_scheduler_executors'))}")
        elif s.service == "executor":
            load = (f"streams {_n(_value(s.samples, 'weft_executor_streams_running'))}  "
                    f"waiting {_n(_value(s.samples, 'weft_executor_queue_depth'))}  "
                    f"preempted {_n(_value(s.samples, 'weft_kv_preemptions_total') or 0.0)}")
        if s.restarts or s.last_exit is not None:  # a restarted service looks healthy; say it was not
            load += f"  restarts {s.restarts} exit {s.last_exit}"
        lines.append(f"{s.service:<12}{s.name:<14}{s.pid:>8}  {_state(s):<6}{load}")
    lines.append("")
    lines.append(f"{'KV':<12}{'EXECUTOR':<14}{'PARTITION':<14}{'USED':>7}{'RESERVED':>10}{'BORROWED':>10}  POOL")
    for s in executors:
        parts = sorted({lab["partition"] for n, lab, _ in s.samples if n == "weft_kv_blocks"})
        total = _value(s.samples, "weft_kv_pool_blocks", state="total")
        free = _value(s.samples, "weft_kv_pool_blocks", state="free")
        pool = f"{_n(total - free if total is not None and free is not None else None)}/{_n(total)} blocks"
        for p in parts or ["-"]:
            used = _value(s.samples, "weft_kv_blocks", partition=p, state="used")
            reserved = _value(s.samples, "weft_kv_blocks", partition=p, state="reserved")
            borrowed = _value(s.samples, "weft_kv_blocks", partition=p, state="borrowed")
            lines.append(f"{'':<12}{s.name:<14}{p:<14}{_n(used):>7}{_n(reserved):>10}{_n(borrowed):>10}  {pool}")
    lines.append("")
    lines.append("LADDER      " + _ladder(sched.samples if sched else []))
    lines.append("SETTINGS    " + settings_versions_text(
        {s.name: (_value(s.samples, "weft_settings_version") if s.up else None) for s in snap.services
         if s.service in FOLLOWERS}))
    lines.append("")
    tiers = []
    hit = sum(_value(s.samples, "weft_kv_lookup_tokens_total", tier="active", result="hit") or 0 for s in executors)
    miss = sum(_value(s.samples, "weft_kv_lookup_tokens_total", tier="active", result="miss") or 0 for s in executors)
    tiers.append(f"active {100 * hit / (hit + miss):.0f}% of {hit + miss:.0f} tokens" if hit + miss else "active -")
    for tier in ("sleeping", "archived"):
        h = _value(cache.samples, "weft_cachestore_tier_lookups_total", tier=tier, result="hit") if cache else None
        m = _value(cache.samples, "weft_cachestore_tier_lookups_total", tier=tier, result="miss") if cache else None
        looked = (h or 0) + (m or 0)
        tiers.append(f"{tier} {100 * (h or 0) / looked:.0f}% of {looked:.0f} blocks" if looked else f"{tier} -")
    lines.append("TIERS       hit rate: " + "   ".join(tiers))
    if cache is not None:
        dem = _value(cache.samples, "weft_kv_demotions_total")
        pro = _value(cache.samples, "weft_kv_promotions_total")
        lines.append(f"            demotions {_n(dem)}   promotions {_n(pro)}")
    lines.append("")
    lines.append(f"{'LATENCY':<12}{'CLASS':<16}{'N':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'E2E p50':>10}{'E2E p99':>10}")
    samples = router.samples if router else []
    ttft, e2e = latency_by_class(samples, "weft_ttft_seconds"), latency_by_class(samples, "weft_e2e_seconds")
    for cls in sorted(set(ttft) | set(e2e)) or ["-"]:
        n, t50, t99 = ttft.get(cls, (0, None, None))
        n2, e50, e99 = e2e.get(cls, (0, None, None))
        lines.append(f"{'':<12}{cls:<16}{max(n, n2):>6}{_ms(t50):>10}{_ms(t99):>10}{_ms(e50):>10}{_ms(e99):>10}")
    lines.append("")
    v = snap.verdict
    if not v or not v.get("cause"):
        lines.append("VERDICT     (no finished requests in the window)")
    else:
        lines.append(f"VERDICT     {v['cause'].upper()}: {v['explanation']}")
        lines.append(f"            p50 {v['p50_ms']:.0f}ms  p99 {v['p99_ms']:.0f}ms  over {v['num_requests']} requests"
                     f" (tail: {v['num_tail']})")
        tail = sorted(v["tail_ms"].items(), key=lambda kv: -kv[1])
        lines.append("            tail: " + "  ".join(f"{k} {ms:.0f}ms" for k, ms in tail if ms >= 0.5))
    return "\n".join(line[:width] for line in lines) + "\n"


# -- command ---------------------------------------------------------------------------------
def register_top(subparsers) -> None:
    top = subparsers.add_parser("top", help="live view of a running mesh",
                                description="Live view of the mesh started by `weft up`: services, load, KV "
                                            "per partition, tier hit rates, latency by class, the p99 verdict.")
    top.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="the mesh's state dir; default: %(default)s")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between redraws; default: %(default)s")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(handler=_top)


def _top(args: argparse.Namespace) -> int:
    from weft.launcher.mesh_state import read_state

    state = read_state(args.state_dir)
    if state is None:
        print(f"no mesh is running from {args.state_dir} (start one with `weft up`)", file=sys.stderr)
        return 1
    width = os.get_terminal_size().columns if sys.stdout.isatty() else 120
    if args.once:
        sys.stdout.write(render(take_snapshot(state), width))
        return 0
    try:
        while True:
            frame = render(take_snapshot(state), width)
            sys.stdout.write("\x1b[H\x1b[2J" + frame)  # home + clear: a full redraw each interval
            sys.stdout.flush()
            time.sleep(args.interval)
            state = read_state(args.state_dir) or state  # follows `weft scale`
    except KeyboardInterrupt:
        return 0

"""Load: N concurrent streaming sessions against a loopback mesh, all open at once.

Starts NATS + router + scheduler + cachestore + --executors executors on 127.0.0.1 with
the tiny model (or drives --http-url, which must be loopback), opens --sessions
streaming /v1/completions calls at the same instant spread over --tenants API keys
(each tenant stays within the scheduler's per-tenant limits), waits for all of them
(each bounded by --request-timeout-s, the whole run by --deadline-s), and reports
throughput, TTFT percentiles and the error count by kind.

Success criterion of issue 7: 1,000 sessions, zero errors.
Writes benchmarks/results/reliability_load.json (and prints a Markdown table).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.loopback_mesh import (  # noqa: E402
    loopback_mesh, percentile, require_loopback, served_model, stream_completion, tenant_keys,
)
from benchmarks.report import write_markdown  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=1000, help="concurrent streaming sessions (default: 1000)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per session, EOS ignored (default: 16)")
    p.add_argument("--prompt-words", type=int, default=12, help="words in each (distinct) prompt (default: 12)")
    p.add_argument("--tenants", type=int, default=8, help="API keys / tenants the sessions are spread over (default: 8)")
    p.add_argument("--executors", type=int, default=2, help="executor processes of the mesh started (default: 2)")
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the generated tiny model)")
    p.add_argument("--http-url", default=None,
                   help="drive this existing mesh instead of starting one (loopback only); its keys file must "
                        "map sk-load-0..N-1 to tenants")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="deadline of one session (default: 600)")
    p.add_argument("--deadline-s", type=float, default=900.0,
                   help="the whole run stops after this many seconds, unfinished sessions counted as errors "
                        "(default: 900)")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "reliability_load.json",
                   help="where the JSON result goes")
    p.add_argument("--state-dir", type=Path, default=None, help="mesh state and logs (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.sessions < 1 or args.max_tokens < 1 or args.tenants < 1:
        p.error("--sessions, --max-tokens and --tenants must be >= 1")
    if args.http_url:
        require_loopback(args.http_url)
    return args


def prompt_for(i: int, words: int) -> str:
    vocab = ("agent", "tool", "call", "plan", "step", "result", "query", "fetch", "parse", "reply", "check", "retry")
    return " ".join(vocab[(i * 7 + j * 3 + i // 12) % len(vocab)] for j in range(words)) + f" #{i}"


async def run_sessions(args: argparse.Namespace, http_url: str, keys: list[str]) -> dict:
    results = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = await served_model(session, http_url, keys[0])
        bar = tqdm(total=args.sessions, desc="sessions", unit="sess")

        async def one(i: int):
            r = await stream_completion(session, http_url, keys[i % len(keys)], model, prompt_for(i, args.prompt_words),
                                        args.max_tokens, args.request_timeout_s)
            bar.update(1)
            return r

        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(i)) for i in range(args.sessions)]
        done, pending = await asyncio.wait(tasks, timeout=args.deadline_s)
        for t in pending:
            t.cancel()
        wall_s = time.monotonic() - t0
        bar.close()
        results = [t.result() for t in done]
    errors = Counter(r.error for r in results if not r.ok)
    if pending:
        errors["run deadline"] += len(pending)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    num_tokens = sum(r.num_tokens for r in results)
    return {
        "sessions": args.sessions, "completed": len(ok), "errors": sum(errors.values()), "errors_by_kind": dict(errors),
        "max_tokens": args.max_tokens, "tenants": args.tenants, "executors": args.executors,
        "wall_s": round(wall_s, 2), "tokens": num_tokens, "tokens_per_s": round(num_tokens / wall_s, 1),
        "sessions_per_s": round(len(ok) / wall_s, 2),
        "ttft_p50_s": round(percentile(ttfts, 50), 3), "ttft_p99_s": round(percentile(ttfts, 99), 3),
        "session_p99_s": round(percentile([r.total_s for r in ok], 99), 3),
    }


async def main(argv=None) -> int:
    args = parse_args(argv)
    keys = tenant_keys(args.tenants)
    if args.http_url:
        summary = await run_sessions(args, args.http_url, list(keys))
    else:
        with tempfile.TemporaryDirectory(prefix="weft-load-") as tmp:
            state_dir = args.state_dir or Path(tmp)
            async with loopback_mesh(state_dir, args.model, args.executors, keys,
                                     {"WEFT_EXECUTOR_NUM_THREADS": "1"}) as state:
                summary = await run_sessions(args, state.http_url, list(keys))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2) + "\n")
    print(write_markdown(list(summary), [[str(v) for v in summary.values()]]))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

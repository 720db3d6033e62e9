"""The transport floor of the mesh: what a chain of gRPC hops costs with no work in it.

The mesh path is client -> router -> scheduler -> executor: three grpc.aio server-
streaming hops, one process each. This module builds the same shape with nothing in it,

    client -> relay -> relay -> leaf          (--hops 3: three processes)

where the leaf streams ``n`` small messages at once and each relay forwards the request
upstream and its messages back (raw bytes: no protobuf, no interceptors, no auth). Its
time to first message is what loopback gRPC in Python costs on this machine, below which
no service mesh of this shape can go; ``benchmarks/mesh_overhead.py`` runs it beside the
mesh as the "gRPC floor" path.

Each link of the chain is either a ``call`` (one gRPC call per request, as the mesh's
hops are today) or a ``mux`` link: one long-lived bidirectional stream between the two
processes that carries every request as a tagged frame and every message back the same
way, so a request costs a message on an open stream instead of an HTTP/2 stream, its
headers and its trailers. ``--links`` names them from the client inwards; given more
than once, the chains run side by side in alternating rounds (ratios within one run).

    python -m benchmarks.grpc_floor --hops 3 --requests 300      # the floor alone
    python -m benchmarks.grpc_floor --links call,call,call --links call,mux,mux \\
        --rounds 5 --out-dir benchmarks/results                  # per-call against mux links
    python -m benchmarks.grpc_floor serve [--upstream HOST:PORT [--upstream-link mux]]
                                                                 # one hop (used by FloorChain)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from benchmarks.grpc_mux import LINKS, MuxUpstream, _request, _same, mux_handler

ROOT = Path(__file__).resolve().parents[1]
METHOD = "/weft.bench.Floor/Generate"
MESSAGE = b"t" * 40  # about one token chunk of the mesh's streams


async def serve(upstream: str | None, ready, upstream_link: str = "call") -> None:
    """One hop on a free loopback port: a relay to ``upstream`` over a ``call`` or ``mux``
    link, or the leaf when None. Every hop serves both link kinds to the hop before it.
    ``ready(port)`` is called once it listens; serves until cancelled."""
    if upstream_link not in LINKS:
        raise ValueError(f"upstream_link must be one of {LINKS}, not {upstream_link!r}")
    server = grpc.aio.server()
    mux_upstream = None
    if upstream is None:
        async def source(n: int):
            for _ in range(n):
                yield MESSAGE
    elif upstream_link == "mux":
        mux_upstream = MuxUpstream(upstream)
        source = mux_upstream.stream
    else:
        channel = grpc.aio.insecure_channel(upstream)
        call_upstream = channel.unary_stream(METHOD, request_serializer=_same, response_deserializer=_same)

        async def source(n: int):
            async for message in call_upstream(_request(n)):
                yield message

    async def generate(request: bytes, context):
        async for message in source(int.from_bytes(request[:4], "big")):
            yield message

    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(generate, request_deserializer=_same,
                                                         response_serializer=_same),
        "Mux": grpc.stream_stream_rpc_method_handler(mux_handler(source), request_deserializer=_same,
                                                     response_serializer=_same),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("weft.bench.Floor", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ready(port)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(None)
        if mux_upstream is not None:
            await mux_upstream.close()


class FloorChain:
    """``hops`` server processes chained on loopback; ``address`` is the first one's. A hop
    that does not say its port within ``start_timeout_s`` fails the chain (all hops end).
    ``links``: one kind per link from the client inwards (``links[0]`` is the client's,
    ``links[i]`` the one into hop i); default every link a ``call``."""

    def __init__(self, hops: int = 3, start_timeout_s: float = 60.0, links: tuple[str, ...] | None = None) -> None:
        if hops < 1:
            raise ValueError("hops must be >= 1")
        links = tuple(links) if links is not None else ("call",) * hops
        if len(links) != hops or any(link not in LINKS for link in links):
            raise ValueError(f"links must name {hops} of {LINKS}, got {links}")
        self.links = links
        self.procs: list[subprocess.Popen] = []
        upstream = None
        try:
            for hop in reversed(range(hops)):  # leaf first, then each relay in front of the last
                argv = [sys.executable, "-m", "benchmarks.grpc_floor", "serve"]
                if upstream is not None:
                    argv += ["--upstream", upstream, "--upstream-link", links[hop + 1]]
                proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, "PYTHONPATH": str(ROOT)})
                self.procs.append(proc)
                ready, _, _ = select.select([proc.stdout], [], [], start_timeout_s)
                if not ready:
                    raise RuntimeError(f"floor hop did not start within {start_timeout_s} s")
                line = proc.stdout.readline()
                if not line.startswith("PORT "):
                    raise RuntimeError(f"floor hop did not start (said {line!r}, exit {proc.poll()})")
                upstream = f"127.0.0.1:{int(line.split()[1])}"
        except BaseException:
            self.stop()
            raise
        self.address = upstream

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs.clear()


class FloorClient:
    """Calls a chain as the benchmarks call the mesh: (start, [(arrival, n)], total), over
    a ``call`` link (a gRPC call per request) or a ``mux`` one (a frame on one stream)."""

    def __init__(self, address: str, link: str = "call") -> None:
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, not {link!r}")
        self.link = link
        self.channel = grpc.aio.insecure_channel(address)
        self.call = self.channel.unary_stream(METHOD, request_serializer=_same, response_deserializer=_same)
        self.mux = MuxUpstream(address) if link == "mux" else None

    async def run(self, num_messages: int, timeout_s: float) -> tuple[float, list[tuple[float, int]], int]:
        start, arrivals = time.perf_counter(), []
        if self.mux is None:
            async for _ in self.call(_request(num_messages), timeout=timeout_s):
                arrivals.append((time.perf_counter(), 1))
        else:
            async def read():
                async for _ in self.mux.stream(num_messages):
                    arrivals.append((time.perf_counter(), 1))
            await asyncio.wait_for(read(), timeout_s)
        return start, arrivals, len(arrivals)

    async def close(self) -> None:
        if self.mux is not None:
            await self.mux.close()
        await self.channel.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="run one hop; prints 'PORT <n>' once it listens")
    s.add_argument("--upstream", default=None, help="HOST:PORT of the next hop; none: this hop is the leaf")
    s.add_argument("--upstream-link", default="call", choices=LINKS,
                   help="how this hop reaches --upstream: a gRPC call per request, or frames on one "
                        "long-lived stream (default: call)")
    p.add_argument("--hops", type=int, default=3, help="server processes in the chain when no --links is "
                                                        "given, every link a call (default: 3, as the mesh)")
    p.add_argument("--links", action="append", default=None, metavar="KIND,KIND,...",
                   help="one chain: a link kind (call or mux) per hop, from the client inwards, e.g. "
                        "call,mux,mux; repeat to compare chains in alternating rounds (default: call x --hops)")
    p.add_argument("--rounds", type=int, default=1, help="rounds; each runs every chain once, in alternating "
                                                         "order (default: 1)")
    p.add_argument("--requests", type=int, default=300, help="timed requests per chain and round (default: 300)")
    p.add_argument("--messages", type=int, default=32, help="messages streamed per request (default: 32)")
    p.add_argument("--warmup", type=int, default=30, help="untimed requests per chain first (default: 30)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="write grpc_floor.md and grpc_floor.png here (default: print the table only)")
    args = p.parse_args(argv)
    if args.command is None:
        if args.hops < 1 or args.requests < 1 or args.messages < 1 or args.rounds < 1 or args.warmup < 0:
            p.error("need --hops, --requests, --messages and --rounds >= 1 and --warmup >= 0")
        chains = []
        for text in args.links or [",".join(["call"] * args.hops)]:
            chain = tuple(part.strip() for part in text.split(","))
            if not all(part in LINKS for part in chain):
                p.error(f"--links {text!r}: each link must be one of {', '.join(LINKS)}")
            if chain in chains:
                p.error(f"--links {text!r} given twice")
            chains.append(chain)
        args.chains = chains
    return args


async def measure(args) -> dict[tuple[str, ...], list[list[float]]]:
    """Time to first message (ms) per chain, one list per round; chains alternate order
    each round, every chain warmed up first."""
    from tqdm.auto import tqdm

    chains, clients = [], {}
    try:
        for links in args.chains:
            chain = await asyncio.to_thread(FloorChain, len(links), 60.0, links)
            chains.append(chain)
            clients[links] = FloorClient(chain.address, links[0])
        out: dict[tuple[str, ...], list[list[float]]] = {links: [] for links in args.chains}
        total = len(args.chains) * (args.warmup + args.rounds * args.requests)
        with tqdm(total=total, desc="grpc floor", unit="req") as bar:
            for links, client in clients.items():
                for _ in range(args.warmup):
                    await client.run(args.messages, 30.0)
                    bar.update()
            for rnd in range(args.rounds):
                order = list(clients.items())
                for links, client in order if rnd % 2 == 0 else order[::-1]:
                    ttft = []
                    for _ in range(args.requests):
                        start, arrivals, _ = await client.run(args.messages, 30.0)
                        ttft.append((arrivals[0][0] - start) * 1000)
                        bar.update()
                    out[links].append(ttft)
        return out
    finally:
        for client in clients.values():
            await client.close()
        for chain in chains:
            chain.stop()


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def report(args, results: dict[tuple[str, ...], list[list[float]]]) -> str:
    """The markdown table: per chain, p50 (median of the rounds' p50s, with their range),
    pooled p99, and each chain's p50 against the first chain's in the same round."""
    from benchmarks.report import write_markdown

    base = args.chains[0]
    rows = []
    for links, rounds in results.items():
        p50s = [statistics.median(r) for r in rounds]
        ratios = [statistics.median(b) / statistics.median(r) for b, r in zip(results[base], rounds)]
        pooled = [v for r in rounds for v in r]
        rows.append([" → ".join(links), f"{statistics.median(p50s):.2f} ({min(p50s):.2f}–{max(p50s):.2f})",
                     f"{_p(pooled, 99):.2f}",
                     "—" if links == base else f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"])
    head = (f"{args.rounds} round(s) of {args.requests} requests per chain, {args.messages} messages each, "
            f"chains in alternating order, {args.warmup} warm-up requests each; loopback, one process per hop, "
            f"{os.cpu_count()} CPUs. A `call` link is one gRPC call per request; a `mux` link carries every "
            "request as a frame on one long-lived bidirectional stream.")
    table = write_markdown(["links, client inwards", "time to first message p50 ms", "p99 ms",
                            f"speed-up vs {' → '.join(base)} (same round)"], rows)
    return f"# gRPC transport floor\n\n{head}\n\n{table}\n"


def plot(path: Path, results: dict[tuple[str, ...], list[list[float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [" → ".join(links) for links in results]
    for i, rounds in enumerate(results.values()):
        p50s = [statistics.median(r) for r in rounds]
        ax.scatter([i] * len(p50s), p50s, color="grey", s=12, zorder=3)
        ax.bar(i, statistics.median(p50s), 0.6)
        ax.annotate(f"{statistics.median(p50s):.2f}", (i, statistics.median(p50s)), ha="center", va="bottom")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("time to first message p50 (ms)")
    ax.set_title("gRPC transport floor: one call per request vs multiplexed links")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "serve":
        def ready(port: int) -> None:
            print(f"PORT {port}", flush=True)
        try:
            asyncio.run(serve(args.upstream, ready, args.upstream_link))
        except KeyboardInterrupt:
            pass
        return 0
    results = asyncio.run(measure(args))
    text = report(args, results)
    print(text)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "grpc_floor.md").write_text(text)
        plot(args.out_dir / "grpc_floor.png", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

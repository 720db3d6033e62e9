"""The transport floor of the mesh: what a chain of gRPC hops costs with no work in it.

The mesh path is client -> router -> scheduler -> executor: three grpc.aio server-
streaming hops, one process each. This module builds the same shape with nothing in it,

    client -> relay -> relay -> leaf          (--hops 3: three processes)

where the leaf streams ``n`` small messages at once and each relay forwards the request
upstream and its messages back (raw bytes: no protobuf, no interceptors, no auth). Its
time to first message is what loopback gRPC in Python costs on this machine, below which
no service mesh of this shape can go; ``benchmarks/mesh_overhead.py`` runs it beside the
mesh as the "gRPC floor" path.

    python -m benchmarks.grpc_floor --hops 3 --requests 300      # the floor alone
    python -m benchmarks.grpc_floor serve [--upstream HOST:PORT]  # one hop (used by FloorChain)
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

ROOT = Path(__file__).resolve().parents[1]
METHOD = "/weft.bench.Floor/Generate"
MESSAGE = b"t" * 40  # about one token chunk of the mesh's streams
_same = lambda b: b  # noqa: E731  (bytes in, bytes out)


def _request(num_messages: int) -> bytes:
    return num_messages.to_bytes(4, "big")


async def serve(upstream: str | None, ready) -> None:
    """One hop on a free loopback port: a relay to ``upstream``, or the leaf when None.
    ``ready(port)`` is called once it listens; serves until cancelled."""
    server = grpc.aio.server()
    if upstream is None:
        async def generate(request: bytes, context):
            for _ in range(int.from_bytes(request[:4], "big")):
                yield MESSAGE
    else:
        channel = grpc.aio.insecure_channel(upstream)
        call_upstream = channel.unary_stream(METHOD, request_serializer=_same, response_deserializer=_same)

        async def generate(request: bytes, context):
            async for message in call_upstream(request):
                yield message
    handler = grpc.unary_stream_rpc_method_handler(generate, request_deserializer=_same, response_serializer=_same)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("weft.bench.Floor", {"Generate": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ready(port)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(None)


class FloorChain:
    """``hops`` server processes chained on loopback; ``address`` is the first one's. A hop
    that does not say its port within ``start_timeout_s`` fails the chain (all hops end)."""

    def __init__(self, hops: int = 3, start_timeout_s: float = 60.0) -> None:
        if hops < 1:
            raise ValueError("hops must be >= 1")
        self.procs: list[subprocess.Popen] = []
        upstream = None
        try:
            for _ in range(hops):  # leaf first, then each relay in front of the last
                argv = [sys.executable, "-m", "benchmarks.grpc_floor", "serve"]
                if upstream is not None:
                    argv += ["--upstream", upstream]
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
    """Calls a chain as the benchmarks call the mesh: (start, [(arrival, n)], total)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.call = self.channel.unary_stream(METHOD, request_serializer=_same, response_deserializer=_same)

    async def run(self, num_messages: int, timeout_s: float) -> tuple[float, list[tuple[float, int]], int]:
        start, arrivals = time.perf_counter(), []
        async for _ in self.call(_request(num_messages), timeout=timeout_s):
            arrivals.append((time.perf_counter(), 1))
        return start, arrivals, len(arrivals)

    async def close(self) -> None:
        await self.channel.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="run one hop; prints 'PORT <n>' once it listens")
    s.add_argument("--upstream", default=None, help="HOST:PORT of the next hop; none: this hop is the leaf")
    p.add_argument("--hops", type=int, default=3, help="server processes in the chain (default: 3, as the mesh)")
    p.add_argument("--requests", type=int, default=300, help="timed requests (default: 300)")
    p.add_argument("--messages", type=int, default=32, help="messages streamed per request (default: 32)")
    p.add_argument("--warmup", type=int, default=30, help="untimed requests first (default: 30)")
    args = p.parse_args(argv)
    if args.command is None and (args.hops < 1 or args.requests < 1 or args.messages < 1):
        p.error("need --hops, --requests and --messages >= 1")
    return args


async def measure(args) -> list[float]:
    chain = FloorChain(args.hops)
    client = FloorClient(chain.address)
    try:
        ttft = []
        for i in range(args.warmup + args.requests):
            start, arrivals, _ = await client.run(args.messages, 30.0)
            if i >= args.warmup:
                ttft.append((arrivals[0][0] - start) * 1000)
        return ttft
    finally:
        await client.close()
        chain.stop()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "serve":
        def ready(port: int) -> None:
            print(f"PORT {port}", flush=True)
        try:
            asyncio.run(serve(args.upstream, ready))
        except KeyboardInterrupt:
            pass
        return 0
    ttft = asyncio.run(measure(args))
    ordered = sorted(ttft)
    print(f"{args.hops} hops, {args.requests} requests: time to first message p50 {statistics.median(ttft):.2f} ms, "
          f"p99 {ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

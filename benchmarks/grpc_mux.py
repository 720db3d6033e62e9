"""Multiplexed links for the transport floor (benchmarks/grpc_floor.py): one long-lived
bidirectional gRPC stream between two processes that carries every request as a tagged
frame and every message back tagged, so a request costs a message on an open stream
instead of an HTTP/2 stream with its headers, trailers and per-call objects."""
from __future__ import annotations

import asyncio
import itertools

import grpc

MUX_METHOD = "/weft.bench.Floor/Mux"
LINKS = ("call", "mux")
_same = lambda b: b  # noqa: E731  (bytes in, bytes out)
# Mux frames. Request: id (4 bytes) + number of messages (4; 0 = cancel that id).
# Response: id (4) + kind (1: MORE with a message after it, or END).
MORE, END = b"\x00", b"\x01"
_MUX_WINDOW = 64  # frames a hop's mux handler buffers before its producers wait


def _request(num_messages: int) -> bytes:
    return num_messages.to_bytes(4, "big")


class MuxUpstream:
    """Requests over one long-lived bidirectional stream to ``address``: each ``stream(n)``
    is a tagged frame on it and its messages come back tagged. The stream opens on first
    use; when it ends (the peer died, the channel closed) every open request fails and
    the next one opens a new stream."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self._open = self.channel.stream_stream(MUX_METHOD, request_serializer=_same, response_deserializer=_same)
        self._ids = itertools.count(1)
        self._routes: dict[bytes, asyncio.Queue] = {}
        self._outbox: asyncio.Queue | None = None
        self._pump: asyncio.Task | None = None

    def _connect(self) -> asyncio.Queue:
        if self._pump is None or self._pump.done():
            outbox = self._outbox = asyncio.Queue()

            async def frames():
                while True:
                    yield await outbox.get()

            self._pump = asyncio.get_running_loop().create_task(self._read(self._open(frames())))
        return self._outbox

    async def _read(self, call) -> None:
        try:
            async for frame in call:
                queue = self._routes.get(frame[:4])
                if queue is not None:  # else: a cancelled request's late messages
                    queue.put_nowait(frame)
        except grpc.aio.AioRpcError:
            pass  # the peer is gone or refused the stream: every open request fails below
        finally:
            routes, self._routes = self._routes, {}
            for queue in routes.values():
                queue.put_nowait(None)

    async def stream(self, num_messages: int):
        """Yields the ``num_messages`` messages of one request. RuntimeError when the mux
        stream ends first; leaving early cancels the request upstream."""
        outbox = self._connect()
        rid = (next(self._ids) % (1 << 32)).to_bytes(4, "big")
        queue = self._routes[rid] = asyncio.Queue()
        outbox.put_nowait(rid + _request(num_messages))
        done = False
        try:
            while True:
                frame = await queue.get()
                if frame is None:
                    raise RuntimeError("mux stream to the next hop ended")
                if frame[4:5] == END:
                    done = True
                    return
                yield frame[5:]
        finally:
            if self._routes.pop(rid, None) is not None and not done:
                outbox.put_nowait(rid + _request(0))

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        await self.channel.close()


def mux_handler(source):
    """A Mux servicer over ``source(n)`` (an async iterator of n messages): one task per
    tagged request, frames back through one bounded queue, a 0-count frame cancels."""
    async def mux(requests, context):
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue(_MUX_WINDOW)
        tasks: dict[bytes, asyncio.Task] = {}
        ending: list[asyncio.Task] = []  # puts the end-of-stream marker, once

        def check_idle(_=None) -> None:
            """The peer closed its side and every request has ended: end the stream."""
            if reader.done() and not tasks and not ending:
                ending.append(loop.create_task(out.put(None)))

        async def serve_one(rid: bytes, n: int) -> None:
            try:
                async for message in source(n):
                    await out.put(rid + MORE + message)
                await out.put(rid + END)
            finally:
                if tasks.get(rid) is asyncio.current_task():
                    del tasks[rid]
                check_idle()

        async def read() -> None:
            async for frame in requests:
                rid, n = frame[:4], int.from_bytes(frame[4:8], "big")
                if n == 0:
                    task = tasks.pop(rid, None)
                    if task is not None:
                        task.cancel()
                else:
                    tasks[rid] = loop.create_task(serve_one(rid, n))

        reader = loop.create_task(read())
        reader.add_done_callback(check_idle)
        try:
            while (frame := await out.get()) is not None:
                yield frame
        finally:
            for task in (reader, *ending, *tasks.values()):
                task.cancel()
    return mux

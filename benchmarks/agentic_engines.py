"""The engines ``weft bench agentic --peer`` drives (benchmarks/agentic_peer.py), each with
the same four calls: ``start``, ``generate`` (one streamed request: TTFT and its tokens),
``end_session`` and ``stop``.

  LlamaServer   ``llama-server -np N`` on the f32 GGUF; /completion with token-id prompts
  WeftMesh      a default ``weft up`` mesh (the launcher's processes), the router's gRPC API;
                the agent fields travel in ``Hints`` (None: a request that says nothing)
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hints:
    """What a hop or a chat tells Weft (None: nothing)."""

    request_class: str  # "agentic" | "interactive"
    session_id: str = ""
    hop_index: int = 0
    expected_tool_ms: int = 0


class LlamaServer:
    """``llama-server -np N`` as one engine; /completion, token-id prompts, streamed."""

    def __init__(self, gguf: Path, *, slots: int, ctx_per_slot: int, threads: int, http_threads: int) -> None:
        from benchmarks.peers.build_llamacpp import find_binary
        from benchmarks.peers.llama_cpp import free_port

        self.port = free_port()
        self.cmd = [str(find_binary("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                    str(self.port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                    "-c", str(slots * ctx_per_slot), "--threads-http", str(http_threads)]
        self.proc = None
        self.session = None

    async def start(self) -> None:
        import aiohttp

        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # a connection per request: reused keep-alive connections the server had closed failed
        # requests mid-run ("Server disconnected", "Can not write request body")
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                             connector=aiohttp.TCPConnector(force_close=True, limit=0))
        deadline = time.monotonic() + 180
        while True:  # its own readiness endpoint answers 200 once the model is loaded
            try:
                async with self.session.get(f"http://127.0.0.1:{self.port}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"llama-server did not come up (exit {self.proc.poll()}): {' '.join(self.cmd)}")
            await asyncio.sleep(0.5)

    async def generate(self, rid: str, prompt: list[int], max_tokens: int, hints: Hints | None, on_first=None):
        body = {"prompt": prompt, "n_predict": max_tokens, "stream": True, "temperature": 0.0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": True, "return_tokens": True}
        start, first, out = time.perf_counter(), None, []
        async with self.session.post(f"http://127.0.0.1:{self.port}/completion", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"llama-server {r.status}: {(await r.text())[:200]}")
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                tokens = json.loads(line[6:]).get("tokens") or []
                if tokens and first is None:
                    first = time.perf_counter()
                    if on_first is not None:
                        on_first(first - start)
                out.extend(tokens)
        return (first or time.perf_counter()) - start, out

    async def end_session(self, session_id: str) -> None:
        """No session API: its slots' prompt cache is plain LRU."""

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


class WeftMesh:
    """A default ``weft up`` mesh (the launcher's processes), driven through the router's gRPC API."""

    def __init__(self, name: str, model_dir: Path, state_dir: Path, settings: dict[str, str]) -> None:
        from weft.launcher.launcher import Launcher, UpOptions

        self.launcher = Launcher(UpOptions(model_dir=str(model_dir), num_executors=1, http_port=0, grpc_port=0,
                                           state_dir=state_dir / name, log_level="warning", settings=settings))
        self.stub = self.channel = self.state = None

    async def start(self) -> None:
        # A fresh state dir: the cachestore's disk tier outlives the mesh, and an earlier run
        # of the same seeds would leave this run's very prompts there to load, not compute.
        shutil.rmtree(self.launcher.options.state_dir, ignore_errors=True)
        self.state = await self.launcher.start()

    async def connect(self) -> None:
        """Opens the client channel, once every engine has started: processes forked while
        this process has gRPC channels open can abort at their start (epoll_wait on a bad fd)."""
        import grpc

        from weft.v1 import router_pb2_grpc

        self.channel = grpc.aio.insecure_channel(self.state.grpc_address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    async def generate(self, rid: str, prompt: list[int], max_tokens: int, hints: Hints | None, on_first=None):
        from weft.v1 import common_pb2, router_pb2

        req = router_pb2.GenerateRequest(
            request_id=rid, token_ids=router_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        if hints is not None:
            cls = {"agentic": common_pb2.REQUEST_CLASS_AGENTIC, "interactive": common_pb2.REQUEST_CLASS_INTERACTIVE}
            req.session.CopyFrom(common_pb2.SessionInfo(
                session_id=hints.session_id, program_id=hints.session_id, hop_index=hints.hop_index,
                expected_tool_ms=hints.expected_tool_ms, request_class=cls[hints.request_class]))
        start, first, out = time.perf_counter(), None, []
        async for chunk in self.stub.Generate(req, timeout=600):
            if chunk.token_ids_delta and first is None:
                first = time.perf_counter()
                if on_first is not None:
                    on_first(first - start)
            out.extend(chunk.token_ids_delta)
        return (first or time.perf_counter()) - start, out

    async def end_session(self, session_id: str) -> None:
        """What an agent framework does when its program is done: the session's pins go and
        its blocks are first in line for eviction."""
        from weft.v1 import router_pb2

        await self.stub.EndSession(router_pb2.EndSessionRequest(session_id=session_id), timeout=30)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        await self.launcher.stop()

"""Drives an ``LLMEngine`` from a worker thread for asyncio callers.

NOTE: the engine is single-threaded and a CPU step takes tens of milliseconds, so the
step loop lives in its own thread and never blocks the caller's event loop. Commands
(add, abort) cross into that thread through a queue and are applied between steps;
outputs cross back with ``call_soon_threadsafe``. A caller that stops iterating
(disconnect, cancellation) aborts its request, freeing its blocks within one step.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import structlog

from services.executor.block_pool import DEFAULT_PARTITION, KVEvent
from services.executor.engine import LLMEngine, StepOutput
from services.executor.sampling_params import SamplingParams
from services.executor.sequence import NO_SESSION, SessionOptions

log = structlog.get_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no further requests are served."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    partition: str
    tenant_salt: str
    priority: float
    sink: Callable[[StepOutput | BaseException], None]
    session: SessionOptions = NO_SESSION
    accepted: Future = field(default_factory=Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], object]
    done: Future = field(default_factory=Future)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_kv_events: Callable[[list[KVEvent]], None] | None = None) -> None:
        self.engine = engine
        self._on_kv_events = on_kv_events
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[StepOutput | BaseException], None]] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weft-engine", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        partition: str = DEFAULT_PARTITION,
        tenant_salt: str = "",
        priority: float = 0.0,
        session: SessionOptions = NO_SESSION,
    ) -> AsyncIterator[StepOutput]:
        """Stream the request's step outputs until it finishes. Raises
        ``InvalidRequestError`` before the first output if the engine refuses it."""
        if not self._thread.is_alive():
            raise EngineDeadError("engine thread is not running")
        loop = asyncio.get_running_loop()
        outq: asyncio.Queue = asyncio.Queue()

        def sink(item: StepOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outq.put_nowait, item)

        cmd = _Add(request_id, list(prompt_token_ids), params, partition, tenant_salt, priority, sink, session)
        self._inbox.put(cmd)
        finished = False
        try:
            # Inside the try: a caller cancelled while the add is in flight still aborts.
            await asyncio.wrap_future(cmd.accepted)
            while True:
                item = await outq.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the engine thread between steps (stats, partitions, ...)."""
        if not self._thread.is_alive():
            raise EngineDeadError("engine thread is not running")
        cmd = _Call(fn)
        self._inbox.put(cmd)
        return await asyncio.wrap_future(cmd.done)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout_s)

    @property
    def num_active(self) -> int:
        return len(self._sinks)

    # -- engine thread ----------------------------------------------------------
    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.partition, cmd.tenant_salt, cmd.priority,
                    cmd.session,
                )
            except Exception as exc:  # refused: handed back to the caller, the engine lives on
                cmd.accepted.set_exception(exc)
                return
            self._sinks[cmd.request_id] = cmd.sink
            cmd.accepted.set_result(None)
        elif isinstance(cmd, _Abort):
            if self.engine.abort_request(cmd.request_id):
                log.info("request_aborted", request_id=cmd.request_id)
            self._sinks.pop(cmd.request_id, None)
        elif isinstance(cmd, _Call):
            try:
                cmd.done.set_result(cmd.fn(self.engine))
            except Exception as exc:  # handed back to the caller
                cmd.done.set_exception(exc)

    def _run(self) -> None:
        while not self._stopping.is_set():
            # Block only when idle; otherwise drain what arrived during the last step.
            try:
                cmd = self._inbox.get(block=not self.engine.has_unfinished_requests)
                while True:
                    if cmd is None:
                        break
                    self._apply(cmd)
                    cmd = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if self._stopping.is_set() or not self.engine.has_unfinished_requests:
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine_step_failed")
                self._fail_all(exc)
                continue
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    sink(out)
                    if out.finished:
                        del self._sinks[out.request_id]
            if self._on_kv_events is not None:
                events = self.engine.take_kv_events()
                if events:
                    self._on_kv_events(events)
        dead = EngineDeadError("engine stopped")
        self._fail_all(dead)
        # Answer whatever is still queued so no caller waits forever.
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.accepted.set_exception(dead)
            elif isinstance(cmd, _Call):
                cmd.done.set_exception(dead)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, sink in list(self._sinks.items()):
            self.engine.abort_request(rid)
            sink(exc)
        self._sinks.clear()

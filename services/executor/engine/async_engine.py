"""Drives an ``LLMEngine`` from a worker thread for asyncio callers.

NOTE: the engine is single-threaded and a CPU step takes tens of milliseconds, so the
step loop lives in its own thread and never blocks the caller's event loop. Commands
(add, abort, call) cross into that thread through a queue and are applied between steps;
outputs cross back with ``call_soon_threadsafe``. A caller that stops iterating
(disconnect, cancellation) aborts its request, freeing its blocks within one step.

The thread is the executor's only engine, so nothing a caller does may end it:
- A command's future is claimed (``set_running_or_notify_cancel``) before its work. A
  caller cancelled while its add was in flight has cancelled the future: the add is
  skipped. A claimed future can no longer be cancelled, so no answer ever lands on a
  finished future (that ``InvalidStateError`` once killed the thread under a storm of
  early client disconnects).
- A sink whose event loop has closed returns False; the engine aborts that request.
- Anything else raised in the loop is logged (``engine_loop_error``), the requests in
  flight fail with it, and the loop goes on.
Should the thread end or stall anyway, ``probe()`` shows it to the executor's watchdog
(engine_watchdog.py), which takes the process out of the mesh for a restart.

Between steps the thread may pause after a request's first token (``first_token_yield_s``,
first_token_yield.py's NOTE), for requests that ask (``generate(first_token_yield=True)``).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import structlog

from services.executor.kv.block_pool import KVEvent
from services.shared.vocabulary import DEFAULT_PARTITION
from services.executor.engine.engine import LLMEngine, StepOutput
from services.executor.engine.first_token_yield import FirstTokenYield
from services.executor.engine.watchdog import EngineProbe
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import NO_SESSION, SessionOptions

log = structlog.get_logger(__name__)

# Hands one output (or the error ending the stream) to its caller; False: the caller is gone.
Sink = Callable[[StepOutput | BaseException], bool]


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
    sink: Sink
    session: SessionOptions = NO_SESSION
    first_token_yield: bool = True
    accepted: Future = field(default_factory=Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], object]
    done: Future = field(default_factory=Future)


def _settle(fut: Future, result: object = None, exc: BaseException | None = None) -> None:
    """Answer a command's future unless its caller already gave up on it (cancelled).
    Never raises: a late answer is dropped, not fatal to the engine thread."""
    if fut.done():
        return
    try:
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)
    except InvalidStateError:  # cancelled between the check and the set
        pass


def _claim(fut: Future) -> bool:
    """Mark ``fut`` running so its caller can no longer cancel it; False when it already
    has (the caller is gone and the command's work is skipped) or it was answered."""
    try:
        return fut.set_running_or_notify_cancel()
    except RuntimeError:  # already running or finished
        return False


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_kv_events: Callable[[list[KVEvent]], None] | None = None,
                 first_token_yield_s: float = 0.0) -> None:
        self.first_token_yield = FirstTokenYield(first_token_yield_s)  # the engine thread's (raises ValueError)
        self.engine = engine
        self._on_kv_events = on_kv_events
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stopping = threading.Event()
        self._closed = threading.Event()  # set by the thread as it ends; later commands are answered by callers
        # Progress marks read by probe() from another thread: progress first, then idle.
        self._last_progress_s = time.monotonic()
        self._idle = True
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
        first_token_yield: bool = True,
    ) -> AsyncIterator[StepOutput]:
        """Stream the request's step outputs until it finishes. Raises
        ``InvalidRequestError`` before the first output if the engine refuses it.
        ``first_token_yield``: the engine may pause after this request's first token
        (first_token_yield.py; only when this driver has a ``first_token_yield_s``)."""
        if self._closed.is_set():
            raise EngineDeadError("engine thread is not running")
        loop = asyncio.get_running_loop()
        if params.grammar is not None:
            # Compile here, off the engine thread (a cache miss would pause every stream for
            # up to grammar_compile_timeout_s); the engine's add then hits the cache. A
            # refusal is raised before anything was added, as the engine's own would be.
            # A remembered grammar is answered here: only a compile takes (and may wait for)
            # a pool thread, so requests with cached grammars never queue behind new ones.
            grammars = self.engine.grammars
            if grammars.cached(params.grammar) is None:
                await loop.run_in_executor(None, grammars.get, params.grammar)
        outq: asyncio.Queue = asyncio.Queue()

        def sink(item: StepOutput | BaseException) -> bool:
            try:
                loop.call_soon_threadsafe(outq.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody will read this stream
                return False
            return True

        cmd = _Add(request_id, list(prompt_token_ids), params, partition, tenant_salt, priority, sink, session,
                   first_token_yield=first_token_yield)
        self._send(cmd)
        finished = False
        try:
            # Inside the try: a caller cancelled while the add is in flight still aborts.
            try:
                await asyncio.wrap_future(cmd.accepted)
            except Exception:
                finished = True  # refused (or the engine died): nothing was added
                raise
            while True:
                item = await outq.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine dropped the request when it sent the error
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
        if self._closed.is_set():
            raise EngineDeadError("engine thread is not running")
        cmd = _Call(fn)
        self._send(cmd)
        return await asyncio.wrap_future(cmd.done)

    def peek(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run a read-only ``fn(engine)`` here, now, without waiting for the step in progress.

        Only for lookups that tolerate a result one step stale and read the engine's state
        through single dict / attribute reads (each atomic under the GIL), never by
        iterating a container the engine thread mutates: e.g. "how many of these block
        hashes are cached" before a promotion, where a stale answer costs a wasted or a
        missed load, never a wrong result (the import itself runs through ``call``)."""
        return fn(self.engine)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout_s)

    @property
    def num_active(self) -> int:
        """Requests the engine thread streams to a caller (sinks held)."""
        return len(self._sinks)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def probe(self) -> EngineProbe:
        """The engine thread's liveness and progress, for the watchdog (any thread)."""
        return EngineProbe(thread_alive=self._thread.is_alive(), stopping=self._stopping.is_set(),
                           idle=self._idle, last_progress_s=self._last_progress_s)

    def _send(self, cmd: _Add | _Call) -> None:
        self._inbox.put(cmd)
        if self._closed.is_set():  # the thread may have drained its inbox already: answer here
            self._answer_queued(EngineDeadError("engine thread is not running"))

    # -- engine thread ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._iterate()
                except Exception as exc:  # a bug: fail what is in flight, keep the engine serving
                    log.exception("engine_loop_error", num_failed_requests=len(self._sinks))
                    self._fail_all(exc)
        except BaseException:  # SystemExit & co.: the thread ends; the watchdog takes it from here
            log.exception("engine_thread_ended", num_failed_requests=len(self._sinks))
        finally:
            self._closed.set()
            dead = EngineDeadError("engine stopped")
            self._fail_all(dead)
            self._answer_queued(dead)  # so no caller waits forever

    def _iterate(self) -> None:
        """Apply the commands that arrived (blocking only when idle), then one step."""
        idle = not self.engine.has_unfinished_requests
        self._idle = idle
        try:
            cmd = self._inbox.get(block=idle)
        except queue.Empty:
            cmd = None
            has_cmd = False
        else:
            has_cmd = True
        self._mark_progress()  # before idle turns False: the watchdog never reads a stale busy
        while has_cmd and cmd is not None:  # None: shutdown's wake-up
            self._apply_safely(cmd)
            self._mark_progress()
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                has_cmd = False
        if self._stopping.is_set() or not self.engine.has_unfinished_requests:
            return
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine_step_failed", num_failed_requests=len(self._sinks))
            self._fail_all(exc)
            return
        finally:
            self._mark_progress()
        for out in outputs:
            self._deliver(out.request_id, out, last=out.finished)
        if self._on_kv_events is not None:
            events = self.engine.take_kv_events()
            if events:
                try:
                    self._on_kv_events(events)
                except Exception:  # a publishing bug loses these events, never the engine
                    log.exception("engine_kv_events_failed", num_events=len(events))
        # A shutdown ends a pause at once (the wait is on the stopping event).
        self.first_token_yield.after_step(outputs, len(self.engine.requests), self._stopping.wait)

    @property
    def num_first_token_yields(self) -> int:
        return self.first_token_yield.num_pauses

    def _mark_progress(self) -> None:
        self._last_progress_s = time.monotonic()
        self._idle = False

    def _apply_safely(self, cmd) -> None:
        try:
            self._apply(cmd)
        except Exception as exc:
            log.exception("engine_command_failed", command=type(cmd).__name__)
            self._fail_command(cmd, exc)
        except BaseException:  # ends the thread: this command's caller must not wait forever
            self._fail_command(cmd, EngineDeadError("engine stopped"))
            raise

    def _fail_command(self, cmd, exc: BaseException) -> None:
        if isinstance(cmd, _Add):
            _settle(cmd.accepted, exc=exc)
            self._drop(cmd.request_id, exc)
        elif isinstance(cmd, _Abort):
            self._drop(cmd.request_id, exc)
        elif isinstance(cmd, _Call):
            _settle(cmd.done, exc=exc)

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Add):
            if not _claim(cmd.accepted):
                return  # the caller was cancelled before the add: its abort follows, a no-op
            try:
                self.engine.add_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.partition, cmd.tenant_salt, cmd.priority,
                    cmd.session,
                )
            except Exception as exc:  # refused: handed back to the caller, the engine lives on
                _settle(cmd.accepted, exc=exc)
                return
            self._sinks[cmd.request_id] = cmd.sink
            self.first_token_yield.admit(cmd.request_id, cmd.first_token_yield)
            _settle(cmd.accepted)
        elif isinstance(cmd, _Abort):
            self._sinks.pop(cmd.request_id, None)
            self.first_token_yield.forget(cmd.request_id)
            if self.engine.abort_request(cmd.request_id):
                log.info("request_aborted", request_id=cmd.request_id)
        elif isinstance(cmd, _Call):
            if not _claim(cmd.done):
                return
            try:
                result = cmd.fn(self.engine)
            except Exception as exc:  # handed back to the caller
                _settle(cmd.done, exc=exc)
            else:
                _settle(cmd.done, result)

    def _deliver(self, request_id: str, item: StepOutput | BaseException, last: bool) -> None:
        """Hand ``item`` to the request's caller; a caller that is gone loses its request."""
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        if last:
            del self._sinks[request_id]
        try:
            delivered = sink(item)
        except Exception:
            log.exception("engine_sink_failed", request_id=request_id)
            delivered = False
        if not delivered and not last:
            log.info("request_orphaned", request_id=request_id)
            self._drop(request_id, None)

    def _drop(self, request_id: str, exc: BaseException | None) -> None:
        """Forget and abort a request; tell its caller ``exc`` when given. Never raises."""
        sink = self._sinks.pop(request_id, None)
        self.first_token_yield.forget(request_id)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            log.exception("engine_abort_failed", request_id=request_id)
        if sink is not None and exc is not None:
            try:
                sink(exc)
            except Exception:
                log.exception("engine_sink_failed", request_id=request_id)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._sinks):
            self._drop(rid, exc)

    def _answer_queued(self, dead: EngineDeadError) -> None:
        """Fail every command still queued (any thread: each is taken from the queue once)."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                _settle(cmd.accepted, exc=dead)
            elif isinstance(cmd, _Call):
                _settle(cmd.done, exc=dead)

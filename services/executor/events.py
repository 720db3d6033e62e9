"""What the executor tells the mesh over NATS: kv events, load reports, heartbeats.

Domain dataclasses only: ``publish(kind, item)`` (wired in app.py to
``event_codec.encode_event`` + the bus) turns them into protobuf events.

kv events come from the engine thread (``AsyncEngine``'s ``on_kv_events`` callback);
they cross into the event loop with ``call_soon_threadsafe`` and are published in
order by one task, so the engine step never waits on the network. That task waits
``kv_publish_delay_s`` after a batch arrives and then publishes everything that came
meanwhile: the step that stored the blocks also produced tokens, and their streams
(pump, servicer, gRPC write) get the loop first, so encoding and sending kv events
never sits between a step and its first token on the wire. The scheduler's kv index
lags by that delay at most; it is eventually consistent anyway. Publishing never
raises: with NATS down events are dropped (and counted) and the engine keeps serving;
consumers see the sequence gap when it returns and resync. Each event is published at
most once, in order: one that fails to encode or send is logged and skipped, never
retried and never the end of the task. ``stop`` publishes what is still waiting in the
delay (bounded by ``KV_FLUSH_TIMEOUT_S``); a killed process loses it, and the scheduler
drops a restarted or silent executor's blocks anyway (epoch change, heartbeat expiry).

Heartbeats are signed with the mesh secret when one is set (heartbeat_signing.py), so a
scheduler believes no one else about where this executor is. The signature covers the
header the bus stamps (source, epoch, sequence), so it is applied by the bus right
before sending (``EventBus`` sealers; on by default), not here.
"""
from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from services.executor.kv.block_pool import KVEvent

log = structlog.get_logger(__name__)

Publish = Callable[[str, object], Awaitable[bool]]

# 0: the task still yields once, so the step's streams get the loop first. A 2 ms delay made
# the scheduler's index lag far longer on a loaded 2-core box (a chaos test saw it); kept settable.
KV_PUBLISH_DELAY_S = 0.0
KV_FLUSH_TIMEOUT_S = 1.0  # what stop() gives the events still waiting (NATS may be down)


class ExecutorState(enum.Enum):
    JOINING = "joining"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"  # engine dead or wedged: no new work; the process exits for a restart


@dataclass(frozen=True)
class Identity:
    """What the heartbeat announces about this executor."""

    name: str
    address: str
    model_id: str
    block_size: int
    max_num_seqs: int
    max_model_len: int = 0
    num_blocks: int = 0
    serves_rung: str = "none"  # degradation rung its pool serves (ExecutorConfig.resolved_serves_rung)
    kv_cache_dtype: str = "auto"  # KV storage; salts block hashes (block_hash.extra_keys_for)


@dataclass(frozen=True)
class Heartbeat:
    identity: Identity
    state: ExecutorState
    interval_s: float


@dataclass(frozen=True)
class LoadSnapshot:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int


@dataclass(frozen=True)
class KvChange:
    """One block pool event, with what a consumer needs to interpret its hashes."""

    event: KVEvent
    model_id: str
    block_size: int


class ExecutorEvents:
    """Publishes this executor's heartbeat, load and kv events."""

    def __init__(
        self,
        publish: Publish,
        identity: Identity,
        heartbeat_interval_s: float,
        load_interval_s: float,
        read_load: Callable[[], Awaitable[dict]] | None = None,
        kv_publish_delay_s: float = KV_PUBLISH_DELAY_S,
    ) -> None:
        if kv_publish_delay_s < 0:
            raise ValueError(f"kv_publish_delay_s must be >= 0, got {kv_publish_delay_s}")
        self.publish = publish
        self.identity = identity
        self.heartbeat_interval_s = heartbeat_interval_s
        self.load_interval_s = load_interval_s
        self.read_load = read_load
        self.kv_publish_delay_s = kv_publish_delay_s
        self.state = ExecutorState.JOINING
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kv_queue: asyncio.Queue[Sequence[KVEvent]] = asyncio.Queue()
        self._kv_in_hand: deque[KVEvent] = deque()  # taken from the queue, not yet published
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks = [
            asyncio.create_task(self._every(self.heartbeat_interval_s, self.publish_heartbeat), name="heartbeat"),
            asyncio.create_task(self._every(self.load_interval_s, self.publish_load), name="load-report"),
            asyncio.create_task(self._publish_kv_forever(), name="kv-events"),
        ]

    async def stop(self) -> None:
        """Stop publishing; kv events still waiting in the delay are published first."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._take_queued()
        if self._kv_in_hand:
            try:
                await asyncio.wait_for(self._publish_in_hand(), KV_FLUSH_TIMEOUT_S)
            except (TimeoutError, asyncio.TimeoutError):
                log.warning("kv_events_not_flushed", num_events=len(self._kv_in_hand))

    def set_load_reader(self, read_load: Callable[[], Awaitable[dict]]) -> None:
        """The engine is ready: load reports read it from now on (a joining executor,
        still loading its checkpoint, has no load to report)."""
        self.read_load = read_load

    def set_identity(self, identity: Identity) -> None:
        self.identity = identity

    async def set_state(self, state: ExecutorState) -> None:
        """Change the lifecycle state and announce it at once."""
        self.state = state
        log.info("executor_state", state=state.name)
        await self.publish_heartbeat()

    # -- kv events (called on the engine thread) ----------------------------------
    def on_kv_events(self, events: list[KVEvent]) -> None:
        """Engine-thread callback: hand the events to the loop; never blocks."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._kv_queue.put_nowait, events)

    async def _publish_kv_forever(self) -> None:
        while True:
            self._kv_in_hand.extend(await self._kv_queue.get())
            await asyncio.sleep(self.kv_publish_delay_s)  # the step's streams send their tokens first
            self._take_queued()
            await self._publish_in_hand()

    def _take_queued(self) -> None:
        while not self._kv_queue.empty():
            self._kv_in_hand.extend(self._kv_queue.get_nowait())

    async def _publish_in_hand(self) -> None:
        """Publish the events in hand in order, each at most once: an event leaves the
        hand before its send (a send cancelled half way is not repeated by ``stop``)."""
        ident = self.identity
        while self._kv_in_hand:
            event = self._kv_in_hand.popleft()
            try:
                await self.publish("kv", KvChange(event, ident.model_id, ident.block_size))
            except Exception:  # an encoding bug loses this event, never the ones after it
                log.exception("kv_event_publish_failed", kind=type(event).__name__)

    # -- heartbeat and load -------------------------------------------------------------
    async def publish_heartbeat(self) -> None:
        await self.publish("heartbeat", Heartbeat(self.identity, self.state, self.heartbeat_interval_s))

    async def publish_load(self) -> None:
        if self.read_load is None or self.state is not ExecutorState.SERVING:
            return
        stats = await self.read_load()
        await self.publish("load", LoadSnapshot(
            num_running=int(stats["num_running"]), num_waiting=int(stats["num_waiting"]),
            num_free_blocks=int(stats["num_free_blocks"]), num_blocks=int(stats["num_blocks"]),
        ))

    @staticmethod
    async def _every(interval_s: float, fn: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await fn()
            except Exception:
                log.exception("periodic_publish_failed")
            await asyncio.sleep(interval_s)

"""What the executor tells the mesh over NATS: kv events, load reports, heartbeats.

kv events come from the engine thread (``AsyncEngine``'s ``on_kv_events`` callback);
they cross into the event loop with ``call_soon_threadsafe`` and are published in
order by one task, so the engine step never waits on the network. Publishing never
raises: with NATS down events are dropped (and counted) and the engine keeps serving;
consumers see the sequence gap when it returns and resync.
"""
from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from services.executor.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from services.mesh.nats_bus import EventBus
from weft.v1 import events_pb2

log = structlog.get_logger(__name__)


class ExecutorState(enum.Enum):
    JOINING = events_pb2.EXECUTOR_STATE_JOINING
    SERVING = events_pb2.EXECUTOR_STATE_SERVING
    DRAINING = events_pb2.EXECUTOR_STATE_DRAINING


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


def kv_event_to_proto(event: KVEvent, model_id: str, block_size: int) -> events_pb2.KvEvent:
    msg = events_pb2.KvEvent(tier=events_pb2.TIER_ACTIVE, model_id=model_id, block_size=block_size)
    if isinstance(event, BlockStored):
        msg.kind = events_pb2.KV_EVENT_KIND_STORED
        msg.block_hashes.extend(event.block_hashes)
        if event.parent_hash is not None:
            msg.parent_hash = event.parent_hash
        msg.partition = event.partition
    elif isinstance(event, BlockRemoved):
        msg.kind = events_pb2.KV_EVENT_KIND_REMOVED
        msg.block_hashes.extend(event.block_hashes)
    elif isinstance(event, AllBlocksCleared):
        msg.kind = events_pb2.KV_EVENT_KIND_CLEARED
    else:
        raise TypeError(f"unknown kv event {event!r}")
    return msg


class ExecutorEvents:
    """Publishes this executor's heartbeat, load and kv events."""

    def __init__(
        self,
        bus: EventBus,
        identity: Identity,
        heartbeat_interval_s: float,
        load_interval_s: float,
        read_load: Callable[[], Awaitable[dict]] | None = None,
    ) -> None:
        self.bus = bus
        self.identity = identity
        self.heartbeat_interval_s = heartbeat_interval_s
        self.load_interval_s = load_interval_s
        self.read_load = read_load
        self.state = ExecutorState.JOINING
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kv_queue: asyncio.Queue[Sequence[KVEvent]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.bus.on_connect(self.publish_heartbeat)
        self._tasks = [
            asyncio.create_task(self._every(self.heartbeat_interval_s, self.publish_heartbeat), name="heartbeat"),
            asyncio.create_task(self._every(self.load_interval_s, self.publish_load), name="load-report"),
            asyncio.create_task(self._publish_kv_forever(), name="kv-events"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

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
        ident = self.identity
        while True:
            events = await self._kv_queue.get()
            for event in events:
                await self.bus.publish("kv", kv_event_to_proto(event, ident.model_id, ident.block_size))

    # -- heartbeat and load -------------------------------------------------------------
    async def publish_heartbeat(self) -> None:
        i = self.identity
        await self.bus.publish("heartbeat", events_pb2.ExecutorHeartbeat(
            name=i.name, address=i.address, model_id=i.model_id, block_size=i.block_size,
            state=self.state.value, max_num_seqs=i.max_num_seqs, num_blocks=i.num_blocks,
            interval_ms=int(self.heartbeat_interval_s * 1000), max_model_len=i.max_model_len,
        ))

    async def publish_load(self) -> None:
        if self.read_load is None or self.state is not ExecutorState.SERVING:
            return
        stats = await self.read_load()
        await self.bus.publish("load", events_pb2.LoadReport(
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

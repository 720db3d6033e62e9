"""Which executors exist, learned from their heartbeats; expiry after missed beats.

An executor appears with its first heartbeat and is placeable while SERVING; one that
says DRAINING stays known (its streams finish) but gets no new work; one silent for
``missed_heartbeats`` of its own intervals is dropped, and ``on_removed`` listeners
(kv index, channel pool) forget it. No restart is ever needed to add or remove one.

The address-change rule: a heartbeat decides where prompts (and the mesh secret) go, so an
unverified heartbeat never changes a verified executor — not its address, not its state
(``admits``). Verified means its mesh signature checked out (heartbeat_signing.py). With a
mesh secret the scheduler drops unverified heartbeats before they get here, so every
record is verified and this rule is the second lock; without one (development) nothing is
verified and a restarted executor may move to a new port as before.

Each executor serves one degradation rung (``none``: full quality); the rungs the
placeable executors serve are the ones the ladder can act on (degradation.py).

Each load report also carries the executor's measured cost-model rates (``MeasuredRates``:
prefill and transfer throughput); the latest ones price that executor's pause decisions
(policy/pause.py), where a rate not measured yet leaves the configured cost.
"""
from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from services.shared.vocabulary import Rung


class ExecutorState(enum.Enum):
    JOINING = "joining"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"  # engine dead or wedged: no new work; the process exits for a restart


def _finite_positive(ms: float) -> float | None:
    """A per-unit cost from a reported rate; None (not measured) unless finite and > 0: an
    infinite, NaN or vanishing rate is a broken measurement, never a free option."""
    return ms if math.isfinite(ms) and ms > 0 else None


@dataclass(frozen=True)
class MeasuredRates:
    """An executor's measured cost-model rates, as its latest load report says (the
    promotion cost model's EWMAs). A count of 0: that rate is not measured yet."""

    prefill_tokens_per_s: float = 0.0
    num_prefills: int = 0
    transfer_bytes_per_s: float = 0.0
    num_transfers: int = 0
    block_bytes: int = 0  # one KV block as it transfers
    transfer_overhead_ms: float = 0.0  # fixed cost per transfer in the executor's cost model

    @property
    def prefill_ms_per_token(self) -> float | None:
        """1000 / prefill tokens per second; None when not measured."""
        if self.num_prefills > 0 and self.prefill_tokens_per_s > 0:
            return _finite_positive(1000.0 / self.prefill_tokens_per_s)
        return None

    @property
    def transfer_ms_per_block(self) -> float | None:
        """1000 × block bytes / transfer bytes per second; None when not measured."""
        if self.num_transfers > 0 and self.transfer_bytes_per_s > 0 and self.block_bytes > 0:
            return _finite_positive(1000.0 * self.block_bytes / self.transfer_bytes_per_s)
        return None


@dataclass(frozen=True)
class ExecutorLoad:
    """Latest load report of an executor."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    rates: MeasuredRates = MeasuredRates()


@dataclass(frozen=True)
class ExecutorRecord:
    """What a heartbeat says, plus when it was last heard (monotonic seconds)."""

    name: str
    address: str
    model_id: str
    block_size: int
    state: ExecutorState
    max_num_seqs: int = 0
    num_blocks: int = 0
    max_model_len: int = 0
    interval_s: float = 1.0
    heartbeat_sequence: int = 0  # sequence number of the heartbeat this record came from
    last_seen_s: float = 0.0
    load: ExecutorLoad | None = None
    serves_rung: Rung = Rung.NONE  # the degradation rung its pool is configured for
    kv_cache_dtype: str = "auto"  # its KV storage, part of its block-hash salt
    verified: bool = False  # its heartbeat carried a valid mesh signature (heartbeat_signing.py)

    @property
    def is_placeable(self) -> bool:
        return self.state is ExecutorState.SERVING


def _same_beat(cur: ExecutorRecord | None, rec: ExecutorRecord) -> bool:
    """Whether ``cur`` is still the record ``rec`` was read from: no heartbeat since."""
    return cur is not None and cur.address == rec.address and cur.last_seen_s == rec.last_seen_s


class Membership:
    """The executor table. Not thread-safe: used from the event loop only."""

    def __init__(self, missed_heartbeats: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        if missed_heartbeats < 1:
            raise ValueError("missed_heartbeats must be >= 1")
        self.missed_heartbeats = missed_heartbeats
        self.clock = clock
        self._executors: dict[str, ExecutorRecord] = {}
        self._on_removed: list[Callable[[ExecutorRecord], None]] = []

    def on_removed(self, listener: Callable[[ExecutorRecord], None]) -> None:
        self._on_removed.append(listener)

    def admits(self, record: ExecutorRecord) -> bool:
        """Whether ``record`` may be applied: not if it is unverified and its executor is
        known verified (the address-change rule above). Does not modify."""
        prev = self._executors.get(record.name)
        return prev is None or record.verified or not prev.verified

    def heartbeat(self, record: ExecutorRecord) -> bool:
        """Record a heartbeat (its ``last_seen_s`` is set to now). True if the executor is new.
        Raises ValueError for a record ``admits`` refuses (check first)."""
        if not self.admits(record):
            raise ValueError(f"unverified heartbeat for verified executor {record.name!r}")
        prev = self._executors.get(record.name)
        if prev is not None and prev.address != record.address:
            self._remove(prev)  # same name at a new address: a replacement process
            prev = None
        self._executors[record.name] = replace(
            record, last_seen_s=self.clock(), load=prev.load if prev is not None else record.load)
        return prev is None

    def update_load(self, name: str, load: ExecutorLoad) -> None:
        """Attach a load report; ignored for an unknown executor (its heartbeat comes first)."""
        rec = self._executors.get(name)
        if rec is not None:
            self._executors[name] = replace(rec, load=load)

    def silent(self) -> list[ExecutorRecord]:
        """Executors silent for more than ``missed_heartbeats`` intervals. Does not modify."""
        now = self.clock()
        return [r for r in self._executors.values() if now - r.last_seen_s > self.missed_heartbeats * r.interval_s]

    def expire(self) -> list[ExecutorRecord]:
        """Drop executors silent for more than ``missed_heartbeats`` intervals; returns them."""
        dead = self.silent()
        for rec in dead:
            self._remove(rec)
        return dead

    def vouch(self, rec: ExecutorRecord) -> bool:
        """``rec`` answered a direct probe although its heartbeats were silent (a frozen or
        partitioned bus): treat it as just heard from. False (nothing changed) when the
        record was replaced or removed meanwhile."""
        cur = self._executors.get(rec.name)
        if not _same_beat(cur, rec):
            return False
        self._executors[rec.name] = replace(cur, last_seen_s=self.clock())
        return True

    def remove_if_unchanged(self, rec: ExecutorRecord) -> bool:
        """Drop ``rec`` unless a heartbeat replaced it meanwhile (a probe took time)."""
        cur = self._executors.get(rec.name)
        if not _same_beat(cur, rec):
            return False
        self._remove(cur)
        return True

    def refresh_all(self) -> None:
        """Treat every executor as just heard from. Called when this scheduler's own bus
        reconnects: silence during our outage says nothing about the executors."""
        now = self.clock()
        for name, rec in self._executors.items():
            self._executors[name] = replace(rec, last_seen_s=now)

    def remove(self, name: str) -> ExecutorRecord | None:
        rec = self._executors.get(name)
        if rec is not None:
            self._remove(rec)
        return rec

    def _remove(self, rec: ExecutorRecord) -> None:
        del self._executors[rec.name]
        for listener in self._on_removed:
            listener(rec)

    def get(self, name: str) -> ExecutorRecord | None:
        return self._executors.get(name)

    def rates(self, name: str) -> MeasuredRates | None:
        """The measured rates of ``name``'s latest load report; None for an unknown executor
        or one without a load report yet. Does not modify."""
        rec = self._executors.get(name)
        return rec.load.rates if rec is not None and rec.load is not None else None

    def all(self) -> list[ExecutorRecord]:
        return sorted(self._executors.values(), key=lambda r: r.name)

    def placeable(self, model_id: str = "", rung: Rung | None = None) -> list[ExecutorRecord]:
        """SERVING executors, of ``model_id`` when given, serving ``rung`` when given, by name.
        (A smaller-model pool runs another checkpoint, so ``model_id`` is not its own: a
        request names the model it wants, and the rung says whether a smaller one may do.)"""
        return [r for r in self.all() if r.is_placeable and (rung is None or r.serves_rung is rung)
                and (not model_id or r.model_id == model_id or r.serves_rung is Rung.SMALLER_MODEL)]

    def offered_rungs(self, model_id: str = "") -> frozenset[Rung]:
        """Degradation rungs some placeable executor (of ``model_id``) serves. Does not modify."""
        return frozenset(r.serves_rung for r in self.placeable(model_id))

    def kv_used_fraction(self, model_id: str = "") -> float:
        """KV blocks in use / KV blocks in all, over the placeable full-quality executors
        with a load report (0.0 when none has reported). Does not modify."""
        used = total = 0
        for rec in self.placeable(model_id, Rung.NONE):
            if rec.load is not None and rec.load.num_blocks > 0:
                used += max(0, rec.load.num_blocks - rec.load.num_free_blocks)
                total += rec.load.num_blocks
        return used / total if total else 0.0

    def __len__(self) -> int:
        return len(self._executors)

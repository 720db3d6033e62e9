"""The degradation ladder: under load, each request class steps down to cheaper rungs
before anything is refused, and climbs back only when load has clearly fallen.

    none → kv_int8 → kv_compress → smaller_model → shed
    (full)  (int8 KV)  (heavy hitters   (small-model    (RESOURCE_EXHAUSTED
                        + recent window) pool)           + retry hint)

NOTE: hysteresis. Each rung has an *enter* threshold and a lower *exit* threshold on
the load signal (0 = idle, 1 = admission full or the full-quality KV pool full). A class moves up one rung when load
reaches the next rung's enter threshold and down one rung when load falls below its
current rung's exit threshold *and* it has stayed on that rung ``min_dwell_s``; so a
load hovering at one threshold cannot flap the rung on every request.

NOTE: a degraded rung is served by an executor pool configured for it (``--serves-rung``,
or ``--kv-cache-dtype int8`` / ``--kv-compress-budget-blocks``), so a rung *acts* only
while at least one live executor offers it. The state machine moves through every rung
enabled in config (default: all); what a request is actually served on is

    served_rung(class rung, contract, offered) = shed                 if the class sheds
                                               = max { r <= class rung : r accepted, r offered }
                                               = none                 if there is no such r

and placement sends it only to executors serving that rung (a degraded pool never serves
a full-quality request). A rung's enter threshold of 0 pins the class on it (forced
degradation: a deliberately degraded deployment, or a test).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.shared.vocabulary import Rung

__all__ = ["Rung", "ALWAYS_ACTING", "Thresholds", "LadderConfig", "parse_thresholds", "LoadSignal",
           "DegradationContract", "ClassLadder", "DegradationLadder", "served_rung"]  # Rung: defined in shared


# Rungs that act without any executor pool: full quality, and refusing.
ALWAYS_ACTING = frozenset({Rung.NONE, Rung.SHED})


@dataclass(frozen=True)
class Thresholds:
    """Load at which a rung is entered, and below which it is left (exit < enter).
    ``enter == exit == 0`` pins the rung: entered on the first observation, never left."""

    enter: float
    exit: float

    def __post_init__(self) -> None:
        pinned = self.enter == self.exit == 0.0
        if not pinned and not 0.0 <= self.exit < self.enter:
            raise ValueError(f"need 0 <= exit < enter (or both 0: pinned), got exit={self.exit} enter={self.enter}")

    @property
    def pinned(self) -> bool:
        return self.enter == 0.0


DEFAULT_THRESHOLDS = {
    Rung.KV_INT8: Thresholds(enter=0.60, exit=0.45),
    Rung.KV_COMPRESS: Thresholds(enter=0.70, exit=0.55),
    Rung.SMALLER_MODEL: Thresholds(enter=0.80, exit=0.65),
    Rung.SHED: Thresholds(enter=0.95, exit=0.75),
}


@dataclass(frozen=True)
class LadderConfig:
    """Which rungs exist and where they start; ``none`` is always the bottom rung."""

    enabled: frozenset[Rung] = frozenset({Rung.NONE, Rung.SHED})  # the scheduler's config enables all
    thresholds: dict[Rung, Thresholds] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    min_dwell_s: float = 2.0

    def __post_init__(self) -> None:
        if Rung.NONE not in self.enabled:
            raise ValueError("the 'none' rung cannot be disabled")
        missing = [r.label for r in self.enabled if r is not Rung.NONE and r not in self.thresholds]
        if missing:
            raise ValueError(f"no thresholds for rungs {missing}")
        if self.min_dwell_s < 0:
            raise ValueError("min_dwell_s must be >= 0")

    @property
    def rungs(self) -> list[Rung]:
        """Enabled rungs, bottom (none) first."""
        return sorted(self.enabled)


def parse_thresholds(text: str) -> dict[Rung, Thresholds]:
    """``"kv_int8=0.5:0.3,shed=0.9:0.7"`` (rung=enter:exit) over the defaults; raises
    ValueError naming the bad item."""
    out = dict(DEFAULT_THRESHOLDS)
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, values = item.partition("=")
        enter, sep2, exit_ = values.partition(":")
        try:
            if not sep or not sep2:
                raise ValueError("expected rung=enter:exit")
            rung = Rung.parse(name)
            if rung is Rung.NONE:
                raise ValueError("the 'none' rung has no thresholds")
            out[rung] = Thresholds(enter=float(enter), exit=float(exit_))
        except ValueError as exc:
            raise ValueError(f"degradation threshold {item!r}: {exc}") from None
    return out


@dataclass(frozen=True)
class LoadSignal:
    """What the ladder reads. Fractions in [0, 1]."""

    admission_fraction: float  # (in flight + queued) / (max in flight + max queue)
    kv_used_fraction: float = 0.0  # KV blocks in use / total over the full-quality pool

    @property
    def load(self) -> float:
        return max(self.admission_fraction, self.kv_used_fraction)

    def load_for(self, rung: Rung) -> float:
        """The load that moves a class onto (or off) ``rung``. KV pressure drives the
        quality rungs, which buy KV capacity; only admission occupancy drives ``shed``: a
        full KV pool is normal operation (the engine queues and preempts), and refusing
        work for it alone would shed a mesh that has no degraded pool to offer."""
        return self.admission_fraction if rung is Rung.SHED else self.load


@dataclass(frozen=True)
class DegradationContract:
    """Rungs a task accepts; ``none`` and ``shed`` always (shed is never negotiable).
    Built from the contract's accepted steps: none listed = every rung accepted."""

    accepted: frozenset[Rung] = frozenset(Rung)

    @classmethod
    def from_labels(cls, labels: Iterable[str]) -> DegradationContract:
        """Raises ValueError on an unknown rung name."""
        rungs = {Rung.parse(x) for x in labels if x.strip()}
        return cls(frozenset(rungs | ALWAYS_ACTING)) if rungs else cls()

    def lowest_offered(self, offered: Iterable[Rung]) -> Rung | None:
        """The least degraded rung this contract accepts among ``offered`` (none and shed
        excluded): where a DEGRADE fallback serves a request. None when there is none."""
        return min((r for r in offered if r in self.accepted and r not in ALWAYS_ACTING), default=None)


class ClassLadder:
    """The rung of one request class. ``observe`` mutates; ``rung`` does not."""

    def __init__(self, config: LadderConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._index = 0  # into config.rungs
        self._since_s = clock()

    @property
    def rung(self) -> Rung:
        return self.config.rungs[self._index]

    def observe(self, signal: LoadSignal) -> Rung:
        """Move at most one rung for this observation; returns the rung after it."""
        rungs, now = self.config.rungs, self.clock()
        up = rungs[self._index + 1] if self._index + 1 < len(rungs) else None
        if up is not None and signal.load_for(up) >= self.config.thresholds[up].enter:
            self._index += 1
            self._since_s = now
        elif (self._index > 0 and signal.load_for(self.rung) < self.config.thresholds[self.rung].exit
              and now - self._since_s >= self.config.min_dwell_s):
            self._index -= 1
            self._since_s = now
        return self.rung


class DegradationLadder:
    """One ``ClassLadder`` per request class, created on first sight."""

    def __init__(self, config: LadderConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or LadderConfig()
        self.clock = clock
        self._classes: dict[str, ClassLadder] = {}

    def observe(self, request_class: str, signal: LoadSignal) -> Rung:
        ladder = self._classes.get(request_class)
        if ladder is None:
            ladder = self._classes[request_class] = ClassLadder(self.config, self.clock)
        return ladder.observe(signal)

    def rungs(self) -> dict[str, Rung]:
        """Current rung per class seen so far (does not modify)."""
        return {name: ladder.rung for name, ladder in self._classes.items()}


def served_rung(class_rung: Rung, contract: DegradationContract, offered: Iterable[Rung] = ()) -> Rung:
    """The rung a request is actually served on: shed always applies; otherwise the
    highest rung at or below the class's that the contract accepts and that some live
    executor offers (``offered``), else none. Pure."""
    if class_rung is Rung.SHED:
        return Rung.SHED
    acting = ALWAYS_ACTING | frozenset(offered)
    for rung in sorted((r for r in Rung if r <= class_rung), reverse=True):
        if rung in contract.accepted and rung in acting:
            return rung
    return Rung.NONE

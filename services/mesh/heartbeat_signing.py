"""Signed executor heartbeats: only a holder of the mesh secret can say where an executor is.

A heartbeat decides where the scheduler sends prompts, tenant names and the mesh secret
itself, so NATS credentials alone (nats_auth.py) are one lock too few: with a mesh secret
set, every ``ExecutorHeartbeat`` carries ``signature`` = HMAC-SHA256 under a key derived
from the secret, and the scheduler drops a heartbeat that lacks it or fails it.

Key: ``HMAC-SHA256(key=secret, msg=b"weft/heartbeat-signing/v1")`` — never the secret
itself, so a signature reveals nothing usable as the gRPC secret header.

Signed bytes (``canonical_bytes``), in this order, each field as a 4-byte big-endian
length then its bytes (strings UTF-8, integers and enum values as ASCII decimal), after
the tag ``weft.heartbeat.v1``:

    header.source  header.epoch  header.sequence  header.timestamp_ms
    name  address  model_id  state  block_size  max_num_seqs  num_blocks  interval_ms
    max_model_len  serves_rung  kv_cache_dtype

That is every field but ``header.event_id`` (random, meaningless) and ``signature``;
``SIGNED_FIELDS`` lists them and a test fails when the proto grows a field this list does
not name. Not ``SerializeToString``: protobuf bytes are not canonical across versions or
languages, and one unknown field would break every signature.

Replay: a captured heartbeat replays only what its executor itself said; within an epoch
the bus drops it as a duplicate (its sequence is signed). Publishing one at all needs the
executor role's NATS password.

Without a secret nothing is signed or checked (development: ``weft up`` without
``WEFT_MESH_SECRET``); the scheduler warns once that heartbeats are unverified.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Callable

from google.protobuf.message import Message

from weft.v1 import events_pb2

_TAG = b"weft.heartbeat.v1"
_KEY_CONTEXT = b"weft/heartbeat-signing/v1"
SIGNED_HEADER_FIELDS = ("source", "epoch", "sequence", "timestamp_ms")
SIGNED_FIELDS = ("name", "address", "model_id", "state", "block_size", "max_num_seqs", "num_blocks",
                 "interval_ms", "max_model_len", "serves_rung", "kv_cache_dtype")
UNSIGNED_FIELDS = ("header", "signature")  # header: its fields above; signature: the result
UNSIGNED_HEADER_FIELDS = ("event_id",)


class Verdict(enum.Enum):
    """What checking a heartbeat's signature found."""

    VALID = "valid"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"

    @property
    def ok(self) -> bool:
        return self is Verdict.VALID


def signing_key(secret: str) -> bytes:
    """The heartbeat key derived from the mesh secret (ValueError for an empty one)."""
    if not secret:
        raise ValueError("an empty mesh secret signs nothing")
    return hmac.new(secret.encode(), _KEY_CONTEXT, hashlib.sha256).digest()


def canonical_bytes(msg: events_pb2.ExecutorHeartbeat) -> bytes:
    """The bytes the signature covers (module docstring). Does not modify ``msg``."""
    parts = [_TAG]
    values = [getattr(msg.header, f) for f in SIGNED_HEADER_FIELDS] + [getattr(msg, f) for f in SIGNED_FIELDS]
    for value in values:
        raw = value.encode() if isinstance(value, str) else str(int(value)).encode()
        parts.append(struct.pack(">I", len(raw)) + raw)
    return b"".join(parts)


class HeartbeatSigner:
    """Signs and checks heartbeats under one mesh secret."""

    def __init__(self, secret: str) -> None:
        self._key = signing_key(secret)

    def digest(self, msg: events_pb2.ExecutorHeartbeat) -> bytes:
        return hmac.new(self._key, canonical_bytes(msg), hashlib.sha256).digest()

    def sign(self, msg: Message) -> None:
        """Set ``msg.signature`` (in place); call after the header is stamped."""
        if not isinstance(msg, events_pb2.ExecutorHeartbeat):
            raise TypeError(f"only ExecutorHeartbeat is signed, not {type(msg).__name__}")
        msg.signature = self.digest(msg)

    def verify(self, msg: events_pb2.ExecutorHeartbeat) -> Verdict:
        """Whether ``msg`` carries a valid signature (constant-time compare). Does not modify."""
        if not msg.signature:
            return Verdict.UNSIGNED
        return Verdict.VALID if hmac.compare_digest(msg.signature, self.digest(msg)) else Verdict.BAD_SIGNATURE


def signer_for(security) -> HeartbeatSigner | None:
    """A signer under ``security``'s mesh secret (``mesh_auth.MeshSecurity``); None without one."""
    return HeartbeatSigner(security.secret) if security.secret else None


def default_sealers() -> dict[str, Callable[[Message], None]]:
    """What an ``EventBus`` applies before sending (nats_bus.py): heartbeats are signed
    when this process has a mesh secret, so every publisher of heartbeats signs them
    without further wiring."""
    from services.mesh import mesh_auth

    signer = signer_for(mesh_auth.current())
    return {"heartbeat": signer.sign} if signer is not None else {}

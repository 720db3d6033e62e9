"""Moves the bytes of cached KV blocks out of and into the engine's paged cache.

NOTE: both directions touch engine state (the pool and ``runner.kv_caches``), so the
parts that do run on the engine thread through ``AsyncEngine.call``, between steps;
everything slow (bytes conversion, the network) happens outside it. A step therefore
never waits on the cachestore.

Payload layout of one block, all layers together (row-major)::

    [2, num_layers, block_size, num_kv_heads, head_dim]     (K/V, layer, slot, head, dim)

The header (dtype, shape) travels with it; an import whose header disagrees with the
engine's cache is refused, never reinterpreted.

An int8 cache (``QuantizedKVCache``) does not transfer: its scales have no place in that
header, so export finds nothing and import refuses everything (``can_transfer``); the
executor does not build tier operations for it (app.py).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.executor.attention.base import QuantizedKVCache
from services.shared.block_hash import BlockHash
from services.shared.vocabulary import DEFAULT_PARTITION
from services.executor.engine.engine import LLMEngine

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in _DTYPES.items()}


def checksum(data: bytes) -> int:
    """The wire checksum of a payload: its 8-byte blake2b digest as a little-endian uint64."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True)
class KvPayload:
    """One block's K/V for every layer, as bytes, with its header."""

    block_hash: BlockHash
    dtype: str
    shape: tuple[int, ...]  # [2, num_layers, block_size, num_kv_heads, head_dim]
    data: bytes

    @property
    def size_bytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class ImportResult:
    num_imported: int  # blocks copied in and registered
    num_present: int  # already resident here (skipped)
    num_refused: int  # did not fit the pool, or a header disagreed with the cache


def can_transfer(engine: LLMEngine) -> bool:
    """Whether ``engine``'s cache blocks can move to and from the cachestore (not int8)."""
    return not isinstance(engine.runner.kv_caches[0], QuantizedKVCache)


def block_layout(engine: LLMEngine) -> tuple[str, tuple[int, ...]]:
    """(dtype name, payload shape) of one block of ``engine``'s cache. Reads only.
    Raises ValueError for an int8 cache, which has no payload layout."""
    if not can_transfer(engine):
        raise ValueError("kv_cache_dtype 'int8' blocks do not transfer to the cachestore")
    kv = engine.runner.kv_caches[0]  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    return _NAMES[kv.dtype], (2, len(engine.runner.kv_caches), *kv.shape[2:])


def _gather(engine: LLMEngine, block_hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, torch.Tensor]]:
    """Engine thread: copies of the resident blocks among ``block_hashes`` (missing ones
    are skipped; an int8 cache yields none). Does not modify the pool."""
    out = []
    if not can_transfer(engine):
        return out
    for h in block_hashes:
        block = engine.pool.cached_block(h)
        if block is None:
            continue
        # [2, num_layers, block_size, num_kv_heads, head_dim]
        out.append((h, torch.stack([kv[:, block.block_id] for kv in engine.runner.kv_caches], dim=1).cpu()))
    return out


def to_payload(block_hash: BlockHash, t: torch.Tensor) -> KvPayload:
    return KvPayload(block_hash, _NAMES[t.dtype], tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())


def from_payload(p: KvPayload, dtype: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The payload as a tensor, or None when its header or size disagrees with (dtype, shape)."""
    if p.dtype != dtype or tuple(p.shape) != tuple(shape):
        return None
    torch_dtype = _DTYPES[dtype]
    if len(p.data) != torch.Size(shape).numel() * torch_dtype.itemsize:
        return None
    return torch.frombuffer(bytearray(p.data), dtype=torch.uint8).view(torch_dtype).view(shape)


def export_blocks(engine: LLMEngine, block_hashes: Sequence[BlockHash]) -> list[KvPayload]:
    """Synchronous form (tests, benchmarks, or already on the engine thread)."""
    return [to_payload(h, t) for h, t in _gather(engine, block_hashes)]


def import_blocks(
    engine: LLMEngine,
    payloads: Sequence[KvPayload],
    parent_hash: BlockHash | None,
    partition: str = DEFAULT_PARTITION,
    hold_hashes: Sequence[BlockHash] = (),
) -> ImportResult:
    """Engine thread: copy ``payloads`` (one hash chain, in order, continuing from
    ``parent_hash``) into fresh blocks and register their hashes, so the next prefix
    match hits them. The blocks end free-cached (evictable, tail first), exactly like
    blocks a finished request left behind. ``hold_hashes`` (the chain's resident head)
    are referenced while fresh blocks are taken, so making room never evicts them.
    Mutates the pool and the KV cache tensors. An int8 cache refuses every payload."""
    if not can_transfer(engine):
        return ImportResult(0, 0, len(payloads))
    dtype, shape = block_layout(engine)
    tensors = []
    num_present = 0
    for p in payloads:
        if engine.pool.contains(p.block_hash):
            num_present += 1
            tensors.append(None)
            continue
        t = from_payload(p, dtype, shape)
        if t is None:
            break  # a chain cannot skip a block: stop at the first bad one
        tensors.append(t)
    todo = [(p, t) for p, t in zip(payloads, tensors) if t is not None]
    refused = len(payloads) - len(tensors)
    if not todo:
        return ImportResult(0, num_present, refused)
    held = [b for b in (engine.pool.cached_block(h) for h in hold_hashes) if b is not None]
    engine.pool.touch(held, partition)
    try:
        blocks = engine.pool.allocate(len(todo), partition)
    finally:
        engine.pool.free(held, partition)
    if blocks is None:
        return ImportResult(0, num_present, refused + len(todo))
    for block, (_, t) in zip(blocks, todo):
        for layer, kv in enumerate(engine.runner.kv_caches):
            kv[:, block.block_id].copy_(t[:, layer])
    # Register as runs: a present block in the middle becomes the next run's parent.
    hashes = [p.block_hash for p, _ in todo]
    parent = parent_hash
    run_blocks, run_hashes, run_parent = [], [], parent_hash
    it = iter(blocks)
    for p, t in zip(payloads, tensors):
        if t is None:
            if run_blocks:
                engine.pool.cache_full_blocks(run_blocks, run_hashes, run_parent, partition)
                run_blocks, run_hashes = [], []
        else:
            if not run_blocks:
                run_parent = parent
            run_blocks.append(next(it))
            run_hashes.append(p.block_hash)
        parent = p.block_hash
    if run_blocks:
        engine.pool.cache_full_blocks(run_blocks, run_hashes, run_parent, partition)
    engine.pool.free(blocks, partition)
    return ImportResult(len(hashes), num_present, refused)


class KvTransfer:
    """The same two operations for service code: the engine-state parts run on the
    engine thread via ``AsyncEngine.call``; byte conversion runs outside it."""

    def __init__(self, async_engine) -> None:
        self.engine = async_engine

    async def export(self, block_hashes: Sequence[BlockHash]) -> list[KvPayload]:
        hashes = list(block_hashes)
        copies = await self.engine.call(lambda e: _gather(e, hashes))
        return [to_payload(h, t) for h, t in copies]

    async def import_(self, payloads: Sequence[KvPayload], parent_hash: BlockHash | None,
                      partition: str = DEFAULT_PARTITION, hold_hashes: Sequence[BlockHash] = ()) -> ImportResult:
        items, hold = list(payloads), list(hold_hashes)
        return await self.engine.call(lambda e: import_blocks(e, items, parent_hash, partition, hold))

    async def layout(self) -> tuple[str, tuple[int, ...]]:
        return await self.engine.call(block_layout)

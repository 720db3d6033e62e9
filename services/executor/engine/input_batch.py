"""The persistent batch: a step's model inputs built in reused host buffers, with each
running sequence's block-table row kept from step to step.

NOTE: why persistent. A decode step changes one token, one position and (every
``block_size`` steps) one block per sequence. Rebuilding every input from Python lists
each step (token ids, positions, slots, block tables padded row by row) costs host time
in proportion to the blocks of the whole batch. Here:

- each scheduled sequence owns a *row* of one block table for as long as it keeps being
  scheduled; its row is appended to when its block list grows and rewritten only when the
  list is replaced (preemption, compression, a prefix hit: the KV manager assigns a new
  list then, see ``Sequence.blocks``). Steady-state decode writes O(rows) numbers.
- token-level inputs (ids, positions, slots) and decode lengths live in preallocated
  buffers that grow by doubling and are never shrunk.
- when the step's rows are 0..n-1 in order (the steady state), the step's block tables are
  views of the persistent table; otherwise one ``index_select`` gathers them.

Row layout of the persistent table (``_table``, [row_capacity, block_capacity] int32)::

    row r:  | b0 | b1 | ... | b{k-1} | stale or 0 ... |   k = blocks written so far
    entries past a row's blocks are padding: valid block ids, never read (lengths bound reads)

Views handed out (``StepInputs``) stay valid until the next ``prepare``: the engine runs
one step at a time, and no caller keeps them past the step. On a GPU the step's slices
are copied to the device (the host buffers stay the persistent state).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from services.executor.attention.base import AttentionMetadata
from services.executor.engine.sequence import Sequence
from services.executor.engine.step_plan import StepPlan


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, absolute (RoPE sees the true position)
    meta: AttentionMetadata
    sample_rows: slice | list[int]  # rows of ``hidden`` whose logits are sampled, in plan order
    row_starts: list[int]  # each scheduled item's first token row


@dataclass
class _Row:
    """What a table row was last written from: the sequence, the block list it held then
    (by identity) and how many of its entries are in the row."""

    seq: Sequence
    blocks: list
    num_blocks: int


class InputBatch:
    """Builds each step's inputs in place. Not thread-safe (the engine's one thread owns it)."""

    def __init__(self, block_size: int, device: torch.device, num_blocks: int,
                 row_capacity: int = 16, block_capacity: int = 16, token_capacity: int = 256) -> None:
        """``num_blocks``: the pool's size; rows are padded with block 0, always valid."""
        self.block_size = block_size
        self.device = device
        self.num_pool_blocks = num_blocks
        self._table = torch.zeros((row_capacity, block_capacity), dtype=torch.int32)
        self._step_table = torch.zeros_like(self._table)  # gather target when rows are out of order
        self._rows: list[_Row | None] = [None] * row_capacity
        self._row_of: dict[str, int] = {}  # request_id -> row
        self._last_rows: list[int] = []
        self._tokens = torch.zeros((3, token_capacity), dtype=torch.int64)  # ids, positions, slots
        self._decode_lens = torch.zeros(row_capacity, dtype=torch.int32)
        empty = torch.zeros(0, dtype=torch.int32, device=device)  # never written: shared by every step
        self._no_prefills = (torch.zeros(1, dtype=torch.int32, device=device), empty, empty)
        self._np()

    def _np(self) -> None:
        """Numpy views of the host buffers (they share memory), refreshed after a grow."""
        self._table_np = self._table.numpy()
        self._tokens_np = self._tokens.numpy()
        self._decode_lens_np = self._decode_lens.numpy()

    # -- capacity ---------------------------------------------------------------
    def _grow_rows(self, need: int) -> None:
        cap = self._table.shape[0]
        if need <= cap:
            return
        new = max(need, 2 * cap)
        table = torch.zeros((new, self._table.shape[1]), dtype=torch.int32)
        table[:cap] = self._table
        self._table, self._step_table = table, torch.zeros_like(table)
        self._rows.extend([None] * (new - cap))
        self._decode_lens = torch.zeros(new, dtype=torch.int32)
        self._np()

    def _grow_blocks(self, need: int) -> None:
        cap = self._table.shape[1]
        if need <= cap:
            return
        table = torch.zeros((self._table.shape[0], max(need, 2 * cap)), dtype=torch.int32)
        table[:, :cap] = self._table
        self._table, self._step_table = table, torch.zeros_like(table)
        self._np()

    def _grow_tokens(self, need: int) -> None:
        cap = self._tokens.shape[1]
        if need > cap:
            self._tokens = torch.zeros((3, max(need, 2 * cap)), dtype=torch.int64)
            self._np()

    # -- rows -------------------------------------------------------------------
    def _row_for(self, seq: Sequence) -> int:
        """The row holding ``seq``'s block table, synced with its blocks (appends only,
        unless its block list was replaced)."""
        r = self._row_of.get(seq.request_id)
        row = self._rows[r] if r is not None else None
        if row is None or row.seq is not seq:
            r = self._free_row()
            row = self._rows[r] = _Row(seq, seq.blocks, 0)
            self._row_of[seq.request_id] = r
        blocks = seq.blocks
        n = len(blocks)
        if row.blocks is not blocks or n < row.num_blocks:  # replaced: rewrite the row
            row.blocks, row.num_blocks = blocks, 0
        if n > row.num_blocks:
            self._grow_blocks(n)
            self._table_np[r, row.num_blocks:n] = [b.block_id for b in blocks[row.num_blocks:n]]
            row.num_blocks = n
        return r

    def _free_row(self) -> int:
        for r, row in enumerate(self._rows):
            if row is None:
                return r
        r = len(self._rows)
        self._grow_rows(r + 1)
        return r

    def _release_unused(self, rows: list[int]) -> None:
        """Free the rows of sequences this step did not schedule (finished, preempted or
        waiting for budget: a later step rewrites their row). O(rows), only on change."""
        if rows == self._last_rows:
            return
        keep = set(rows)
        for r in self._last_rows:
            row = self._rows[r]
            if r not in keep and row is not None:
                self._rows[r] = None
                if self._row_of.get(row.seq.request_id) == r:
                    del self._row_of[row.seq.request_id]
        self._last_rows = rows

    def num_rows_in_use(self) -> int:
        return sum(row is not None for row in self._rows)

    def _tables(self, rows: list[int]) -> torch.Tensor:
        """[len(rows), block_capacity] int32: the rows' block tables in step order."""
        n = len(rows)
        if rows == list(range(n)):
            return self._table[:n]
        idx = torch.tensor(rows, dtype=torch.int64)
        torch.index_select(self._table, 0, idx, out=self._step_table[:n])
        return self._step_table[:n]

    # -- the step ---------------------------------------------------------------
    def prepare(self, plan: StepPlan, on_device: bool = True) -> StepInputs:
        """The step's inputs (decodes first, then prefill chunks). Reads the sequences,
        writes only this object's buffers; the previous step's views are overwritten.
        ``on_device=False``: decode tensors stay host views even on a GPU (the CUDA graph
        path copies them into its own static buffers; see ``token_rows``)."""
        bs = self.block_size
        dev = self._on_device if on_device else _host
        items = plan.decodes + plan.prefills
        rows = [self._row_for(item.seq) for item in items]
        self._release_unused(rows)
        num_decodes = len(plan.decodes)
        num_tokens = num_decodes + sum(item.num_new_tokens for item in plan.prefills)
        self._grow_tokens(num_tokens)
        ids, pos, slots = self._tokens_np

        # Decodes: one token each, O(1) per row (plain Python: at tens of rows it beats
        # numpy's per-call cost). cache index = position - evicted, in block idx // bs.
        decode_ids, decode_pos, decode_slots, decode_lens = [], [], [], []
        for item in plan.decodes:
            seq = item.seq
            start = seq.num_computed_tokens
            idx = start - seq.num_evicted_tokens
            decode_ids.append(seq.all_token_ids[start])
            decode_pos.append(start)
            decode_slots.append(seq.blocks[idx // bs].block_id * bs + idx % bs)
            decode_lens.append(idx + 1)
        ids[:num_decodes] = decode_ids
        pos[:num_decodes] = decode_pos
        slots[:num_decodes] = decode_slots
        self._decode_lens_np[:num_decodes] = decode_lens
        decode_lens = tuple(decode_lens)

        # Prefill chunks: their cost is the chunk's, so plain per-chunk slices.
        row_starts = list(range(num_decodes))
        t = num_decodes
        for item, r in zip(plan.prefills, rows[num_decodes:]):
            seq, n = item.seq, item.num_new_tokens
            start, ev = seq.num_computed_tokens, seq.num_evicted_tokens
            row_starts.append(t)
            ids[t:t + n] = seq.all_token_ids[start:start + n]
            pos[t:t + n] = np.arange(start, start + n)
            cache_idx = np.arange(start - ev, start + n - ev)
            slots[t:t + n] = self._table_np[r, cache_idx // bs].astype(np.int64) * bs + cache_idx % bs
            t += n

        q_lens = tuple(item.num_new_tokens for item in plan.prefills)
        ctx_lens = tuple(item.seq.num_cached_kv_tokens for item in plan.prefills)
        tables = self._tables(rows)
        start_loc, ctx, seq_lens = self._prefill_lens(q_lens, ctx_lens)
        meta = AttentionMetadata(
            slot_mapping=dev(self._tokens[2, :num_tokens]),
            num_decodes=num_decodes,
            decode_block_tables=dev(tables[:num_decodes]),
            decode_seq_lens=dev(self._decode_lens[:num_decodes]),
            num_prefills=len(plan.prefills),
            prefill_query_start_loc=start_loc,
            prefill_context_lens=ctx,
            prefill_seq_lens=seq_lens,
            prefill_block_tables=dev(tables[num_decodes:]),
            prefill_query_lens_host=q_lens,
            prefill_context_lens_host=ctx_lens,
            decode_seq_lens_host=decode_lens,
        )
        sample = [i for i, item in enumerate(items) if item.samples]
        sample_rows: slice | list[int] = [row_starts[i] + items[i].num_new_tokens - 1 for i in sample]
        if sample_rows == list(range(len(sample_rows))):  # a decode-only batch: a view, no gather
            sample_rows = slice(0, len(sample_rows))
        return StepInputs(dev(self._tokens[0, :num_tokens]), dev(self._tokens[1, :num_tokens]), meta,
                          sample_rows, row_starts)

    def token_rows(self, num_tokens: int) -> torch.Tensor:
        """[3, num_tokens] int64 host view: the last step's ids, positions and slots."""
        return self._tokens[:, :num_tokens]

    def _prefill_lens(self, q_lens: tuple[int, ...],
                      ctx_lens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query_start_loc [P + 1], context_lens [P], seq_lens [P] (int32, on the device);
        a decode-only step gets the same empty ones every time."""
        if not q_lens:
            return self._no_prefills
        dev = self.device
        return (torch.tensor(np.cumsum((0,) + q_lens), dtype=torch.int32, device=dev),
                torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
                torch.tensor([c + q for c, q in zip(ctx_lens, q_lens)], dtype=torch.int32, device=dev))

    def _on_device(self, host: torch.Tensor) -> torch.Tensor:
        """The host view itself on CPU; a fresh device copy elsewhere (the copy is
        synchronous, so the host buffer may be rewritten by the next step at once)."""
        if self.device.type == "cpu":
            return host
        return host.to(self.device)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t

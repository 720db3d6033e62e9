"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

NOTE: why. On a GPU a small model's decode step is bound by the host, not the device: a
0.85 B model's forward is ~16 layers x ~15 kernel launches, each a Python call and a
launch (~20-30 us), where the weights stream in ~0.4 ms (benchmarks/results/gpu.md: 7-11 ms
a step eager). A graph captured once replays the whole forward, lm_head included, with one
launch. As in vLLM and SGLang, a decode-only step of ``n`` rows runs the graph of the
smallest captured bucket ``B >= n``; rows ``n..B-1`` are padding.

Static inputs, one set shared by every bucket (bucket B reads rows ``[:B]``)::

    tokens    [3, Bmax] int64   input ids, positions, slots      a padding row's slot is -1:
                                                                  the KV write skips it
    seq_lens  [Bmax]    int32   keys each row attends to         0 for padding rows: their
                                                                  attention output is 0
    tables    [Bmax, W] int32   block tables, W = blocks of max_model_len; entries past a
                                row's blocks are stale and never read (seq_lens bound reads)

Each graph's output (logits [B, vocab] fp32) lives in the graphs' shared memory pool and is
valid until the next replay; the runner samples from it before the next step.

What makes the captured forward replay-safe: the step's metadata carries no host-side
lengths, so the triton back end takes its split-K factor from the table width (fixed per
bucket) and its kernels never sync with the host; RoPE tables are gathered on the device;
the KV write and the attention read only the static buffers. Capturing runs the forward
with every row padding, so it writes no KV.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch

from services.executor.attention.base import AttentionMetadata
from services.executor.model.llama import LlamaModel

# Largest bucket captured, whatever max_num_seqs says (vLLM's default capture limit is
# 512; past a few hundred rows the launches are a small part of the step).
MAX_GRAPH_BATCH = 256

# A capture function: given the step function, returns (replay, output). ``replay()``
# recomputes the step from the static inputs into ``output``.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], object], torch.Tensor]]


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8 up to ``max_batch`` (and ``max_batch`` itself)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {b for b in (1, 2, 4) if b <= max_batch} | set(range(8, max_batch + 1, 8)) | {max_batch}
    return tuple(sorted(sizes))


class CudaCapture:
    """Captures with ``torch.cuda.CUDAGraph``: two eager runs on a side stream first
    (kernels compiled, allocator warmed), then the capture, all graphs in one memory pool
    (captured largest first, so the smaller ones reuse its blocks)."""

    def __init__(self, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def __call__(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], object], torch.Tensor]:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = step()
        torch.cuda.current_stream().synchronize()
        return graph.replay, out


def eager_capture(step: Callable[[], torch.Tensor]) -> tuple[Callable[[], object], torch.Tensor]:
    """A stand-in for ``CudaCapture`` that re-runs the step eagerly on each replay, into
    the same output tensor: the static-buffer bookkeeping (padding, stale rows, slicing)
    without a GPU. For tests."""
    out = step()

    def replay() -> None:
        with torch.inference_mode():  # ``out`` was made in inference mode
            out.copy_(step())

    return replay, out


class DecodeGraphs:
    """Decode-only steps of up to ``buckets[-1]`` rows, run from captured graphs."""

    def __init__(self, model: LlamaModel, kv_caches: list, max_batch: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = graph_buckets(min(max_batch, MAX_GRAPH_BATCH))
        self.max_blocks_per_seq = max_blocks_per_seq
        dev, bmax = model.device, self.buckets[-1]
        self._tokens = torch.zeros((3, bmax), dtype=torch.int64, device=dev)  # ids, positions, slots
        self._tokens[2].fill_(-1)
        self._seq_lens = torch.zeros(bmax, dtype=torch.int32, device=dev)
        self._tables = torch.zeros((bmax, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self._no_prefills = (torch.zeros(1, dtype=torch.int32, device=dev),
                             torch.zeros(0, dtype=torch.int32, device=dev),
                             torch.zeros(0, dtype=torch.int32, device=dev))
        self._graphs: dict[int, tuple[Callable[[], object], torch.Tensor]] = {}
        self.num_replays = 0
        self.capture_s = 0.0

    def _step(self, b: int) -> torch.Tensor:
        """The forward of bucket ``b`` over the static inputs: logits [b, vocab] fp32."""
        start_loc, ctx, seq_lens = self._no_prefills
        meta = AttentionMetadata(
            slot_mapping=self._tokens[2, :b], num_decodes=b,
            decode_block_tables=self._tables[:b], decode_seq_lens=self._seq_lens[:b],
            num_prefills=0, prefill_query_start_loc=start_loc, prefill_context_lens=ctx,
            prefill_seq_lens=seq_lens, prefill_block_tables=self._tables[:0],
        )  # no host lengths: nothing in the step depends on this step's values
        hidden = self.model.forward(self._tokens[0, :b], self._tokens[1, :b], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def capture(self, capture: Capture | None = None) -> None:
        """Capture every bucket, largest first. ``capture``: how (default ``CudaCapture``)."""
        capture = capture or CudaCapture(self.model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self._graphs[b] = capture(lambda b=b: self._step(b))
        self.capture_s = time.perf_counter() - start

    def covers(self, num_rows: int, max_blocks: int) -> bool:
        """True when a decode step of ``num_rows`` rows, none holding more than
        ``max_blocks`` blocks, has a graph."""
        return 0 < num_rows <= self.buckets[-1] and max_blocks <= self.max_blocks_per_seq and bool(self._graphs)

    def run(self, tokens: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Replay for one decode step. ``tokens`` [3, n] (ids, positions, slots), ``seq_lens``
        [n] and ``tables`` [n, w] may be host tensors. Returns logits [n, vocab], a view of
        the graph's output: read it before the next ``run``."""
        n, w = tokens.shape[1], tables.shape[1]
        # checked before anything is copied: ``copy_`` would broadcast a short input over
        # every row (a slot numbered by a token id, a length that is another row's)
        if not self._graphs:
            raise RuntimeError("decode graphs were not captured: call capture() first")
        if tokens.dim() != 2 or tokens.shape[0] != 3:
            raise ValueError(f"tokens must be [3, n] (ids, positions, slots), got {tuple(tokens.shape)}")
        if seq_lens.shape != (n,) or tables.dim() != 2 or tables.shape[0] != n:
            raise ValueError(f"seq_lens [{n}] and tables [{n}, w] must have one row per token column, got "
                             f"{tuple(seq_lens.shape)} and {tuple(tables.shape)}")
        if n > self.buckets[-1]:
            raise ValueError(f"{n} rows: more than the largest captured bucket ({self.buckets[-1]})")
        if w > self.max_blocks_per_seq:
            raise ValueError(f"tables {w} blocks wide: wider than the captured width ({self.max_blocks_per_seq})")
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        replay, logits = self._graphs[b]
        self._tokens[:, :n].copy_(tokens, non_blocking=True)
        self._seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self._tables[:n, :w].copy_(tables, non_blocking=True)
        if n < b:  # rows a larger step left: they must write no KV (their slots are others')
            self._tokens[2, n:b].fill_(-1)
            self._seq_lens[n:b].zero_()
        replay()
        self.num_replays += 1
        return logits[:n]


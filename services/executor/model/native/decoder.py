"""A decode step in one C call, over the model's own tensors: one sequence (``decode.c``)
or R sequences at once (``decode_batch.c``).

The C side gets raw pointers into tensors torch owns: the model's row-major fp32 weights
(kept beside oneDNN's or gemm.c's packed copies, see linear.py; steps of more than a few
rows read gemm.c's copies where the model has them), its RoPE tables and the runner's KV
cache. ``NativeDecoder`` holds references to every tensor it hands out, so none is freed
while the C struct points at it; the KV cache tensors must not be replaced afterwards
(the model runner allocates them once).

What it covers: decode only (one new token per sequence), fp32 weights and KV cache, the
Llama family's plain forward (qkv bias, o bias, tied or untied lm_head, GQA). Everything
else (prefill, int8 KV, compression's attention mass, prompt logprobs) stays on the torch
path; the model runner decides once per step (``step`` / ``step_rows`` are only called for
a plan they cover).
"""
from __future__ import annotations

import ctypes

import torch

_F32P = ctypes.POINTER(ctypes.c_float)

# Most decode rows one native step takes; a step with more goes through torch. The native
# step was faster than the torch path at every row count measured, 1-64 (median speed-up,
# 2 threads, ~160 context, benchmarks/results/native_batch.md): SmolLM2 1.39x 1.30x 1.20x
# 1.30x 1.10x 1.33x 1.32x at 1 2 4 8 16 32 64 rows, bench 1.62x 1.39x 1.34x 1.33x 1.29x
# 1.09x 1.19x; 64 is also the engine's default max_num_seqs. Larger batches are unmeasured.
MAX_ROWS = 64


class _ModelStruct(ctypes.Structure):
    """Mirror of ``weft_model`` in decode.c (field order and types must match)."""

    _fields_ = [
        *[(name, ctypes.c_int32) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
                                              "vocab", "num_layers", "block_size", "num_blocks")],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *[(name, ctypes.c_void_p) for name in ("embed", "final_norm", "lm_head", "cos", "sin")],
        *[(name, ctypes.POINTER(ctypes.c_void_p)) for name in
          ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "down", "kv_cache")],
        ("lm_head_p", ctypes.c_void_p),
        *[(name, ctypes.POINTER(ctypes.c_void_p)) for name in ("qkv_p", "o_p", "gate_up_p", "down_p")],
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"native decode needs contiguous fp32 CPU tensors, got {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


class NativeDecoder:
    """fp32 decode steps for ``model`` writing into ``kv_caches``.

    ``kv_caches``: one tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]
    fp32, contiguous (the model runner's). ``step`` mutates one slot of each, ``step_rows``
    one slot per row, and nothing else of the model's."""

    def __init__(self, lib: ctypes.CDLL, model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> None:
        c = model.config
        self._lib = lib
        layers = model.layers
        _, num_blocks, block_size, kvh, d = kv_caches[0].shape
        if kvh != model.num_kv_heads or d != model.head_dim:
            raise ValueError("kv cache shape does not match the model")
        # every tensor the struct points into, kept alive as long as this object
        per_layer = {
            "input_norm": [lw.input_norm for lw in layers],
            "qkv": [lw.qkv.plain_weight for lw in layers],
            "qkv_bias": [lw.qkv.bias for lw in layers],
            "o": [lw.o.plain_weight for lw in layers],
            "o_bias": [lw.o.bias for lw in layers],
            "post_norm": [lw.post_norm for lw in layers],
            "gate_up": [lw.gate_up.plain_weight for lw in layers],
            "down": [lw.down.plain_weight for lw in layers],
            "kv_cache": list(kv_caches),
        }
        # gemm.c's packed copies (linear.py's PackedLinear) where every projection has one:
        # decode steps of many rows read those; else NULL and they read the plain weights
        packed = {f"{name}_p": [getattr(getattr(lw, name), "packed", None) for lw in layers]
                  for name in ("qkv", "o", "gate_up", "down")}
        if not all(t is not None for ts in packed.values() for t in ts) or not all(
                getattr(lw.gate_up, "_gate_up", False) for lw in layers):  # gate_up's panels interleaved
            packed = {}
        lm_head_p = getattr(model.lm_head, "packed", None) if packed else None
        self._keep = [model.embed, model.final_norm, model.lm_head.plain_weight, model.cos, model.sin, per_layer,
                      packed, lm_head_p]
        self._arrays = {name: (ctypes.c_void_p * len(ts))(*[_ptr(t) for t in ts])
                        for name, ts in {**per_layer, **packed}.items()}
        self._struct = _ModelStruct(
            hidden=c.hidden_size, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim, intermediate=c.intermediate_size, vocab=model.lm_head.out_features,
            num_layers=len(layers), block_size=block_size, num_blocks=num_blocks,
            eps=model.eps, scale=model.head_dim ** -0.5,
            embed=_ptr(model.embed), final_norm=_ptr(model.final_norm), lm_head=_ptr(model.lm_head.plain_weight),
            cos=_ptr(model.cos), sin=_ptr(model.sin), lm_head_p=_ptr(lm_head_p),
            **{name: ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p)) for name, arr in self._arrays.items()},
        )
        self._struct_ref = ctypes.byref(self._struct)
        self._max_position = model.cos.shape[0]
        self._vocab = model.lm_head.out_features
        self._heads, self._head_dim = model.num_heads, model.head_dim
        self._block_size, self._num_blocks = block_size, num_blocks
        self._checked: tuple | None = None  # the block tables / lengths _check_tables last passed

    @staticmethod
    def covers(num_rows: int) -> bool:
        """Whether a decode-only step of ``num_rows`` rows runs natively (1..MAX_ROWS)."""
        return 1 <= num_rows <= MAX_ROWS

    def step(self, token_id: int, position: int, slot: int, block_table: torch.Tensor,
             seq_len: int) -> torch.Tensor:  # [1, vocab] fp32 logits
        """Decode ``token_id`` at ``position``: its K/V go to cache ``slot``; attention reads
        the sequence's first ``seq_len`` cache entries through ``block_table`` (int32, at
        least ceil(seq_len / block_size) entries, contiguous)."""
        if not 0 <= position < self._max_position:
            raise ValueError(f"position {position} outside the RoPE table")
        if block_table.dtype != torch.int32 or not block_table.is_contiguous():
            raise ValueError("block_table must be a contiguous int32 tensor")
        logits = torch.empty((1, self._vocab), dtype=torch.float32)
        rc = self._lib.weft_decode_step(self._struct_ref, token_id, position, slot, block_table.data_ptr(),
                                        seq_len, logits.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("native decode step could not allocate its scratch buffer")
        return logits

    def argmax_rows(self, logits: torch.Tensor) -> list[int] | None:  # logits: [R, vocab]
        """Each row's greedy token, ``logits.argmax(-1).tolist()`` as torch gives it (the
        first index among equal maxima), or None when the native argmax cannot answer: not
        a contiguous fp32 CPU [R, vocab] tensor, or a row holding NaN (torch's argmax picks
        the NaN; the caller asks torch). Reads ``logits`` only."""
        if (logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous()
                or logits.device.type != "cpu" or logits.shape[0] == 0):
            return None
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        if self._lib.weft_argmax_rows(logits.data_ptr(), rows, vocab, out.data_ptr(), torch.get_num_threads()) != 0:
            return None
        return out.tolist()

    def argmax_entropy_rows(self, logits: torch.Tensor,
                            want: list[bool]) -> tuple[list[int], list[float]] | None:  # logits: [R, vocab]
        """``argmax_rows`` and each wanted row's entropy in nats (0.0 for the others), what
        the sampler's ``-(p * log p).sum()`` of the raw logits gives up to float rounding;
        None when ``argmax_rows`` would be. Reads ``logits`` only."""
        if (logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous()
                or logits.device.type != "cpu" or logits.shape[0] != len(want) or not want):
            return None
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        entropy = torch.empty(rows, dtype=torch.float64)
        mask = torch.tensor(want, dtype=torch.uint8)
        if self._lib.weft_argmax_entropy_rows(logits.data_ptr(), rows, vocab, out.data_ptr(), mask.data_ptr(),
                                              entropy.data_ptr(), torch.get_num_threads()) != 0:
            return None
        return out.tolist(), entropy.tolist()

    def step_rows(self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  seq_lens_host: tuple[int, ...]) -> torch.Tensor:  # [R, vocab] fp32 logits
        """Decode R sequences at once: row r decodes ``token_ids[r]`` at ``positions[r]``
        (int64 [R]), its K/V go to cache slot ``slots[r]`` (int64 [R]); attention reads row
        r's first ``seq_lens[r]`` (int32 [R]; ``seq_lens_host`` the same as ints) cache
        entries through ``block_tables[r]`` (int32 [R, W], W >= each row's block count).
        Slots must be distinct (each row owns its last block)."""
        rows = token_ids.shape[0]
        for t, dtype in ((token_ids, torch.int64), (positions, torch.int64), (slots, torch.int64),
                         (seq_lens, torch.int32), (block_tables, torch.int32)):
            if t.dtype != dtype or not t.is_contiguous() or t.shape[0] != rows:
                raise ValueError(f"step_rows needs contiguous {dtype} inputs with {rows} rows, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if len(seq_lens_host) != rows or min(seq_lens_host) < 1:
            raise ValueError("every row needs a sequence length >= 1")
        self._check_tables(block_tables, seq_lens)
        low, high = torch.aminmax(positions)
        if low < 0 or high >= self._max_position:
            raise ValueError(f"a position in [{int(low)}, {int(high)}] is outside the RoPE table")
        logits = torch.empty((rows, self._vocab), dtype=torch.float32)
        rc = self._lib.weft_decode_rows(self._struct_ref, rows, token_ids.data_ptr(), positions.data_ptr(),
                                        slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                                        seq_lens.data_ptr(), logits.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("native decode step could not allocate its scratch buffer")
        return logits

    def _check_tables(self, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Every length in [1, the table's width in tokens] and every block a row reads inside
        the pool: the C side trusts both (a block past the pool read outside the cache)."""
        if not len(seq_lens):
            return
        # every layer of a step passes the same two tensors: checked once. The last pair checked
        # is held (so no new tensor can reuse its memory) and compared by identity and by
        # _version (a tensor changed in place bumps it, so a changed table is checked again).
        last = self._checked
        if (last is not None and last[0] is block_tables and last[1] == block_tables._version
                and last[2] is seq_lens and last[3] == seq_lens._version):
            return
        low, high = torch.aminmax(seq_lens)
        if low < 1 or high > block_tables.shape[1] * self._block_size:
            raise ValueError(f"a sequence length in [{int(low)}, {int(high)}] is outside [1, "
                             f"{block_tables.shape[1] * self._block_size}] (the block tables' width)")
        need = (seq_lens.to(torch.int64) + self._block_size - 1) // self._block_size
        used = block_tables[torch.arange(block_tables.shape[1])[None, :] < need[:, None]]
        low, high = torch.aminmax(used)
        if low < 0 or high >= self._num_blocks:
            raise ValueError(f"a block id in [{int(low)}, {int(high)}] is outside the pool's {self._num_blocks}")
        self._checked = (block_tables, block_tables._version, seq_lens, seq_lens._version)

    def attend_rows(self, cache: torch.Tensor, q: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor) -> torch.Tensor:  # [R, num_heads, head_dim]
        """The attention of R decode rows over one layer's ``cache`` (one of the
        ``kv_caches`` this decoder was made with; each row's new K/V already written): row r's
        query ``q[r]`` ([R, num_heads, head_dim] fp32, rotated; rows may be strided, as a view
        of the step's fused qkv projection is) over its first ``seq_lens[r]``
        (int32 [R]) entries through ``block_tables[r]`` (int32 [R, W]). What the torch
        path's decode rows use instead of gathering their contexts (attention.torch_backend)."""
        rows, heads, d = q.shape
        if (q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d or block_tables.dtype != torch.int32
                or seq_lens.dtype != torch.int32 or block_tables.stride(1) != 1 or not seq_lens.is_contiguous()
                or block_tables.shape[0] != rows or seq_lens.shape[0] != rows):
            raise ValueError("attend_rows needs fp32 q with contiguous rows and int32 block_tables / seq_lens, "
                             "one row each")
        if q.device.type != "cpu" or (heads, d) != (self._heads, self._head_dim):
            raise ValueError(f"attend_rows needs CPU q of [rows, {self._heads}, {self._head_dim}], got "
                             f"{tuple(q.shape)} on {q.device}")
        if not any(cache.data_ptr() == c.data_ptr() for c in self._keep[5]["kv_cache"]):
            raise ValueError("attend_rows reads only the caches this decoder was made with")
        self._check_tables(block_tables, seq_lens)
        out = torch.empty((rows, heads, d), dtype=torch.float32)
        rc = self._lib.weft_attend_rows(self._struct_ref, cache.data_ptr(), rows, q.data_ptr(), q.stride(0),
                                        out.data_ptr(), heads * d, block_tables.data_ptr(), block_tables.stride(0),
                                        seq_lens.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("native attention could not allocate its scratch buffer")
        return out


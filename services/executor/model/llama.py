"""The Llama family (Llama 2/3, Qwen2's qkv bias, Mistral) over a paged KV cache.

Weights are held as plain tensors with q/k/v and gate/up fused into one matmul each:
at 16 concurrent decodes a CPU step is ~30 ms of matmul, and every extra op or
small matmul shows. The math follows Hugging Face's modeling code op for op
(RMSNorm in fp32, rotate-half RoPE) so greedy output matches it token for token.

On a CPU in fp32 the model also offers a native batch-1 decode step (``native_decoder``,
model/native/): one C call per step streams the row-major weights (kept for it beside
oneDNN's packed copies). ``forward`` stays the path for everything else.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.executor.attention.base import AttentionBackend, AttentionMetadata
from services.executor.errors import CheckpointError
from services.executor.model.linear import Linear, make_linear, onednn_usable, packed_usable
from services.executor.model.config import ModelConfig
from services.executor.model.native import library as native_library
from services.executor.model.native.decoder import NativeDecoder
from services.executor.model.rope import rope_inv_freq


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [q_dim + 2 * kv_dim, hidden], bias for Qwen2
    o: Linear  # [hidden, q_dim] (Llama's attention_bias also biases o_proj)
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear  # [hidden, intermediate]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op, same math in fp32
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin``, written into ``x`` (a view is fine).

    ``x``: [n, heads, d]; ``cos``: [n, 1, d]; ``sin_signed``: [n, 1, d], the sin table
    with its first half negated. rotate_half(x) * sin == swap_halves(x) * sin_signed
    exactly (negating a product is exact), so this is bit-identical to HF's order of
    operations, in 4 ops instead of 7 and with no new tensor for the result."""
    n, heads, d = x.shape
    rot = x.view(n, heads, 2, d // 2).flip(2).view(n, heads, d)  # [x2, x1]: a copy
    rot.mul_(sin_signed)
    return x.mul_(cos).add_(rot)


class _NativeRows:
    """RMSNorm and RoPE of one forward pass through native/rows.c: one C call over all rows
    each (torch's F.rms_norm is six passes over [rows, hidden]; its RoPE a copy and three).
    RoPE is bit-identical to apply_rope_; RMSNorm equal to fp32 rounding."""

    __slots__ = ("_lib", "_model", "_positions", "_threads")

    def __init__(self, model: LlamaModel, positions: torch.Tensor) -> None:
        self._lib, self._model, self._positions = model._native_lib, model, positions
        self._threads = torch.get_num_threads()

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> new [n, hidden]
        y = torch.empty_like(x)
        self._lib.weft_rms_norm_rows(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1],
                                     self._model.eps, self._threads)
        return y

    def rope_(self, qkv: torch.Tensor, heads: int) -> None:  # the first `heads` heads of each contiguous row
        m = self._model
        self._lib.weft_rope_rows(qkv.data_ptr(), qkv.shape[1], self._positions.data_ptr(), m.cos.data_ptr(),
                                 m.sin_signed.data_ptr(), heads, m.head_dim, qkv.shape[0], self._threads)


class LlamaModel:
    """Forward pass of a decoder-only Llama-family model. Holds no per-request state."""

    def __init__(
        self,
        config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        backend_factory: Callable[..., AttentionBackend],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        use_onednn: bool | None = None,
        native_decode: bool | None = None,
    ) -> None:
        """``native_decode``: offer the native batch-1 decode step (CPU fp32 only; None or
        True: on unless ``WEFT_NATIVE_DECODE=0``). Its library is built here (once per machine,
        cached); if that fails a warning is logged and only the torch path runs."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.q_dim = c.num_attention_heads * c.head_dim
        self.kv_dim = c.num_key_value_heads * c.head_dim
        self.eps = c.rms_norm_eps
        self.use_onednn = onednn_usable(self.device, dtype) if use_onednn is None else use_onednn
        native_wanted = native_decode is not False and native_library.native_enabled()  # env can veto
        native_fits = self.device.type == "cpu" and dtype == torch.float32
        self._native_lib = native_library.load() if native_wanted and native_fits else None
        self.attn = backend_factory(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            scale=self.head_dim**-0.5,
        )
        self._load(state_dict)
        inv_freq, attn_scaling = rope_inv_freq(c)
        positions = torch.arange(c.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        self.cos = (emb.cos() * attn_scaling).to(dtype=dtype, device=self.device)
        self.sin = (emb.sin() * attn_scaling).to(dtype=dtype, device=self.device)
        half = self.head_dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)  # see apply_rope_

    def _take(self, sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        try:
            t = sd[name]
        except KeyError:
            raise CheckpointError(f"missing tensor {name}") from None
        return t.to(dtype=self.dtype, device=self.device)

    def _load(self, sd: dict[str, torch.Tensor]) -> None:
        c = self.config
        keep_plain = self._native_lib is not None  # the native step streams row-major weights
        # On AVX2 CPUs the projections run through native/gemm.c's packed GEMM (prefills,
        # decode steps of many rows) in place of oneDNN's; the plain weight stays beside it.
        packed_lib = self._native_lib if self.use_onednn and packed_usable(self._native_lib) else None
        lin = lambda w, b=None, gate_up=False: make_linear(  # noqa: E731
            w, b, self.use_onednn, keep_plain, packed_lib=packed_lib, gate_up=gate_up)
        # Weights the native step streams as loaded get a copy from torch's allocator (huge
        # pages, process_env.py): the tied lm_head read at 70 GB/s from the checkpoint's
        # buffer and 80 GB/s from a copy. (qkv and gate_up are fresh concatenations already.)
        fresh = (lambda t: t.clone()) if keep_plain else (lambda t: t)  # noqa: E731
        self.embed = fresh(self._take(sd, "model.embed_tokens.weight"))  # [vocab, hidden]
        tied = c.tie_word_embeddings and "lm_head.weight" not in sd
        self.lm_head = lin(self.embed if tied else fresh(self._take(sd, "lm_head.weight")))
        self.final_norm = self._take(sd, "model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat([self._take(sd, a + f"{n}_proj.weight") for n in "qkv"], dim=0).contiguous()
            bias = None
            if c.attention_bias:
                bias = torch.cat([self._take(sd, a + f"{n}_proj.bias") for n in "qkv"], dim=0).contiguous()
            gate_up = torch.cat(
                [self._take(sd, p + "mlp.gate_proj.weight"), self._take(sd, p + "mlp.up_proj.weight")], dim=0
            ).contiguous()
            o_bias = self._take(sd, a + "o_proj.bias") if c.attention_output_bias else None
            self.layers.append(
                LayerWeights(
                    input_norm=self._take(sd, p + "input_layernorm.weight"),
                    qkv=lin(qkv, bias),
                    o=lin(fresh(self._take(sd, a + "o_proj.weight")), o_bias),
                    post_norm=self._take(sd, p + "post_attention_layernorm.weight"),
                    gate_up=lin(gate_up, gate_up=True),
                    down=lin(fresh(self._take(sd, p + "mlp.down_proj.weight"))),
                )
            )

    def native_decoder(self, kv_caches: list[torch.Tensor]) -> NativeDecoder | None:
        """A native batch-1 decode step over ``kv_caches`` (fp32 tensors, one per layer),
        or None when the native library is off or unavailable for this model."""
        if self._native_lib is None:
            return None
        return NativeDecoder(self._native_lib, self, kv_caches)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def param_bytes(self) -> int:
        """Bytes of weights read per forward pass (the lm_head once even when tied)."""
        norms = [self.final_norm] + [t for lw in self.layers for t in (lw.input_norm, lw.post_norm)]
        linears = [self.lm_head] + [m for lw in self.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        return sum(t.numel() * t.element_size() for t in norms) + sum(m.num_bytes for m in linears)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kvh, d]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] after the final norm
        n = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)  # [n, hidden], this pass's own: the residual adds go into it
        k_end = self.q_dim + self.kv_dim
        heads = self.num_heads + self.num_kv_heads
        # native RMSNorm and RoPE, or None: torch's (which also serves, or refuses, positions
        # that are not one per token: the C loop reads positions[r] for every row r)
        rows = self._row_ops(positions) if positions.shape == (n,) else None
        tables = None if rows else self._rope_tables(positions)
        for lw, kv_cache in zip(self.layers, kv_caches):
            x = rows.norm(h, lw.input_norm) if rows else rms_norm(h, lw.input_norm, self.eps)
            qkv = lw.qkv(x)  # [n, q_dim + 2 * kv_dim]
            # q and k heads rotate together, in place in the projection's output
            qk = qkv[:, :k_end].view(n, heads, self.head_dim)
            if rows and qkv.is_contiguous():
                rows.rope_(qkv, heads)
            else:
                tables = tables or self._rope_tables(positions)
                apply_rope_(qk, *tables)
            q = qk[:, : self.num_heads]
            k = qk[:, self.num_heads :]
            v = qkv[:, k_end:].view(n, self.num_kv_heads, self.head_dim)
            o = self.attn.forward(q, k, v, kv_cache, meta)  # [n, heads, d]
            lw.o.add_into(o.view(n, self.q_dim), h)  # h += o W^T, in place
            x = rows.norm(h, lw.post_norm) if rows else rms_norm(h, lw.post_norm, self.eps)
            lw.down.add_into(lw.gate_up.silu_mul(x), h)  # silu(gate) * up: [n, intermediate]
        return rows.norm(h, self.final_norm) if rows else rms_norm(h, self.final_norm, self.eps)

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin_signed rows of these positions, each [n, 1, d] (apply_rope_'s)."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def _row_ops(self, positions: torch.Tensor) -> _NativeRows | None:
        """The native RMSNorm and RoPE over this pass's rows (native/rows.c), or None: no
        native library, or positions the tables do not hold (torch's indexing says so)."""
        if self._native_lib is None or positions.dtype != torch.int64 or not positions.numel():
            return None
        lo, hi = torch.aminmax(positions)
        if int(lo) < 0 or int(hi) >= self.cos.shape[0]:
            return None
        return _NativeRows(self, positions.contiguous())

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] fp32
        return self.lm_head(hidden).float()

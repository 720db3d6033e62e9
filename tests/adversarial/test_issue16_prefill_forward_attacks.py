"""Issue 16, attacks on the prefill forward's neighbours of native/rows.c (a330e28:
llama.py's _NativeRows / _row_ops / forward, Linear.add_into / PackedLinear.add_into,
torch_backend's _prefill reading a fresh chunk's K/V from the projection). rows.c itself:
test_issue16_native_prefill_rows_attacks.py; gemm.c's few-row column blocks (2ccad7f):
test_issue16_packed_gemm_attacks.py (the kernels) and test_issue16_packed_linear_attacks.py
(the decode step).

What is attacked (every case deterministic; nothing here repeats test_native_rows.py):

3. The model: the forward with the native rows is the pre-commit forward (written out
   here) to fp32 rounding, and bit for bit with the native rows off, in bf16 (no native
   library) and under WEFT_NATIVE_DECODE=0; a non-contiguous qkv falls back to torch's
   RoPE with the same bits; positions at the table's last row; positions that are not one
   per token (found: one position for three tokens made the C loop read past the
   positions tensor and segfault; five for three were silently truncated).
4. add_into: x aliasing out (found: PackedLinear's accumulate epilogue overwrote inputs it
   still had to read), broadcasting shapes, a non-contiguous / bf16 out, 3-D x, no rows:
   always what ``out + linear(x)`` in place gives (or the same error as torch's linear).
5. Attention: a mixed step (decodes, fresh prefills, a chunk with cached context, block
   scores on) equal bit for bit to the gather route: fp32 and bf16 caches, and an int8
   QuantizedKVCache dequantising to either (which still attends to its dequantised copy).
   (A plain cache of another dtype than the activations is refused by index_copy_.)
6. The engine: greedy tokens with the native rows on and off (chunked prefills included),
   and two identical prompts in one step giving what each gives alone.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from services.executor.attention.base import AttentionMetadata, QuantizedKVCache
from services.executor.attention.selector import backend_class
from services.executor.attention.torch_backend import TorchAttentionBackend
from services.executor.model.config import ModelConfig
from services.executor.model.linear import Linear, PackedLinear, packed_usable
from services.executor.model.llama import LlamaModel, apply_rope_, rms_norm
from services.executor.model import llama as llama_mod
from services.executor.model.native import library
from tests.adversarial.native_kernel_shim import NAN, pytestmark as _native_only
from tests.unit.executor.test_native_rows import _prefill_meta
from weft.testing.tiny_model import make_tiny_checkpoint, model_config_dict, random_weights

LIB = library.load() if library.native_enabled() else None
pytestmark = [_native_only, pytest.mark.skipif(LIB is None, reason="the native library did not build")]
ROOT = str(library.SOURCES[0].parents[4])


# ---- 3. the model -----------------------------------------------------------------------

def _model(monkeypatch, packed: bool = True, dtype=torch.float32, native=True) -> LlamaModel:
    monkeypatch.setenv("WEFT_PACKED_GEMM", "1" if packed else "0")
    config = ModelConfig.from_dict({**model_config_dict("tiny", "llama"), "num_hidden_layers": 2})
    return LlamaModel(config, random_weights(config, seed=4), backend_class("torch"), dtype=dtype,
                      native_decode=native)


def _old_forward(model: LlamaModel, ids, positions, caches, meta) -> torch.Tensor:
    """The forward as it was before a330e28: torch's RMSNorm and RoPE, out-of-place adds."""
    n = ids.shape[0]
    h = F.embedding(ids, model.embed)
    cos, sin = model.cos[positions].unsqueeze(1), model.sin_signed[positions].unsqueeze(1)
    k_end, heads = model.q_dim + model.kv_dim, model.num_heads + model.num_kv_heads
    for lw, kv_cache in zip(model.layers, caches):
        x = rms_norm(h, lw.input_norm, model.eps)
        qkv = lw.qkv(x)
        qk = apply_rope_(qkv[:, :k_end].view(n, heads, model.head_dim), cos, sin)
        v = qkv[:, k_end:].view(n, model.num_kv_heads, model.head_dim)
        o = model.attn.forward(qk[:, : model.num_heads], qk[:, model.num_heads:], v, kv_cache, meta)
        h = h + lw.o(o.view(n, model.q_dim))
        x = rms_norm(h, lw.post_norm, model.eps)
        h = h + lw.down(lw.gate_up.silu_mul(x))
    return rms_norm(h, model.final_norm, model.eps)


LENS, CTX = [5, 11, 1, 6], [0, 0, 0, 7]  # the last chunk has 7 tokens cached before it


def _inputs(model: LlamaModel, seed: int = 1, last_positions: bool = False):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (sum(LENS),), generator=gen)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(CTX, LENS)])
    if last_positions:  # the RoPE table's last rows (the attention does not look at positions)
        positions = model.cos.shape[0] - 1 - torch.arange(sum(LENS)) % 3
    meta, blocks = _prefill_meta(LENS, 4, CTX)
    caches = [torch.randn(2, blocks, 4, model.num_kv_heads, model.head_dim, generator=gen).to(model.dtype)
              for _ in model.layers]  # the cached context: whatever the cache holds
    return ids, positions, caches, meta


def _run(fn, model, ids, positions, caches, meta):
    caches = [c.clone() for c in caches]
    return fn(model, ids, positions, caches, meta), caches


def _new(model, ids, positions, caches, meta):
    return model.forward(ids, positions, caches, meta)


def _no_rows(monkeypatch):
    monkeypatch.setattr(LlamaModel, "_row_ops", lambda self, p: None)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("last_positions", [False, True])
def test_the_forward_is_the_old_forward_to_rounding_and_bitwise_without_native_rows(monkeypatch, packed,
                                                                                    last_positions):
    model = _model(monkeypatch, packed)
    inputs = _inputs(model, last_positions=last_positions)
    assert model._row_ops(inputs[1]) is not None
    old, old_caches = _run(_old_forward, model, *inputs)
    new, new_caches = _run(_new, model, *inputs)
    torch.testing.assert_close(new, old, rtol=2e-5, atol=2e-5)
    for a, b in zip(new_caches, old_caches):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    _no_rows(monkeypatch)
    off, off_caches = _run(_new, model, *inputs)
    assert torch.equal(off, old), "with torch's row ops the forward is no longer the old one bit for bit"
    assert all(torch.equal(a, b) for a, b in zip(off_caches, old_caches))


def test_a_bf16_model_and_a_disabled_native_library_run_the_old_forward_bit_for_bit(monkeypatch):
    bf16 = _model(monkeypatch, dtype=torch.bfloat16)
    assert bf16._native_lib is None
    inputs = _inputs(bf16)
    assert torch.equal(_run(_new, bf16, *inputs)[0], _run(_old_forward, bf16, *inputs)[0])
    monkeypatch.setenv("WEFT_NATIVE_DECODE", "0")
    off = _model(monkeypatch)
    assert off._native_lib is None and off._row_ops(torch.arange(3)) is None
    inputs = _inputs(off)
    got = _run(_new, off, *inputs)[0]
    assert torch.equal(got, _run(_old_forward, off, *inputs)[0])
    monkeypatch.delenv("WEFT_NATIVE_DECODE")
    on = _model(monkeypatch, packed=False)  # the same linears as `off` (no packed GEMM without the library)
    torch.testing.assert_close(_run(_new, on, *inputs)[0], got, rtol=2e-5, atol=2e-5)


class _Strided:
    """A linear whose output is a non-contiguous view (every other column of a wider buffer)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, x):
        y = self.inner(x)
        wide = torch.full((y.shape[0], 2 * y.shape[1]), NAN)
        wide[:, ::2] = y
        return wide[:, ::2]


def test_a_non_contiguous_qkv_falls_back_to_torchs_rope_with_the_same_bits(monkeypatch):
    model = _model(monkeypatch)
    inputs = _inputs(model)
    seen: list[list[torch.Tensor]] = [[], []]  # q, k, v as the attention receives them, per run
    attend = model.attn.forward

    def spy(run):
        def forward(q, k, v, kv_cache, meta):
            seen[run].append(torch.cat([q, k, v], 1).clone())
            return attend(q, k, v, kv_cache, meta)
        return forward

    monkeypatch.setattr(model.attn, "forward", spy(0))
    want = _run(_new, model, *inputs)[0]
    calls = []
    real = llama_mod._NativeRows.rope_
    monkeypatch.setattr(llama_mod._NativeRows, "rope_",
                        lambda self, qkv, heads: calls.append(1) or real(self, qkv, heads))
    monkeypatch.setattr(model.attn, "forward", spy(1))
    for lw in model.layers:
        monkeypatch.setattr(lw, "qkv", _Strided(lw.qkv))
    got = _run(_new, model, *inputs)[0]
    assert not calls, "the native RoPE ran on a non-contiguous qkv"
    # the first layer's rotated q and k: apply_rope_ on the strided view, bit for bit the
    # native RoPE on the contiguous one (later layers differ by SDPA's kernel choice for
    # inputs whose last dimension is strided, as they did before this commit)
    assert torch.equal(seen[1][0], seen[0][0])
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_positions_that_are_not_one_per_token_are_left_to_torch():
    """One position for three tokens made weft_rope_rows read positions[1], positions[2]
    past the tensor (a segfault in the first run of this file); five for three were cut to
    three where torch refuses. Run in a child: a crash must fail this test, not the run."""
    script = textwrap.dedent("""
        import torch
        from services.executor.model.config import ModelConfig
        from services.executor.model.llama import LlamaModel
        from services.executor.attention.selector import backend_class
        from tests.unit.executor.test_native_rows import _prefill_meta
        from weft.testing.tiny_model import model_config_dict, random_weights
        config = ModelConfig.from_dict({**model_config_dict("tiny", "llama"), "num_hidden_layers": 1})
        model = LlamaModel(config, random_weights(config, seed=4), backend_class("torch"), native_decode=True)
        assert model._native_lib is not None

        def run(positions):
            meta, blocks = _prefill_meta([3], 4)
            caches = [torch.zeros(2, blocks, 4, model.num_kv_heads, model.head_dim)]
            try:
                return model.forward(torch.tensor([5, 6, 7]), positions, caches, meta)
            except RuntimeError as e:
                return type(e).__name__

        results = {}
        cases = (("one", torch.tensor([1000] * 100)[:1]), ("five", torch.arange(5)), ("col", torch.arange(3)[:, None]))
        for name, p in cases:
            native = run(p)
            row_ops = LlamaModel._row_ops
            LlamaModel._row_ops = lambda self, p: None
            torch_ = run(p)
            LlamaModel._row_ops = row_ops
            strs = isinstance(native, str) or isinstance(torch_, str)
            results[name] = native == torch_ if strs else torch.equal(native, torch_)
        print("RESULTS", results)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-2000:]}"
    assert "RESULTS {'one': True, 'five': True, 'col': True}" in proc.stdout, proc.stdout[-2000:]


# ---- 4. add_into ------------------------------------------------------------------------

def _linears(out_features: int, in_features: int, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    lins = [Linear(w, b)]
    if packed_usable(LIB):
        lins.append(PackedLinear(w, b, LIB))
    return lins, gen


def _outcome(fn):
    try:
        return fn()
    except RuntimeError as e:
        return type(e)


@pytest.mark.parametrize("rows", [1, 7, 49, 130])
def test_add_into_with_x_aliasing_out_is_out_plus_the_product(rows):
    lins, gen = _linears(40, 40, rows)
    assert len(lins) == 2 or not packed_usable(LIB)
    for lin in lins:
        h = torch.randn(rows, 40, generator=gen)
        want = h + lin(h)
        out = h.clone()
        assert lin.add_into(out, out) is out
        assert torch.equal(out, want), f"{type(lin).__name__}: x is out"
        # x a view of out's memory (its first 24 columns as a narrower linear's input)
        narrow = type(lin)(torch.randn(40, 24, generator=gen), None, LIB) if isinstance(lin, PackedLinear) \
            else Linear(torch.randn(40, 24, generator=gen))
        out = h.clone()
        want = out + narrow(out[:, :24].clone())
        narrow.add_into(out[:, :24], out)
        assert torch.equal(out, want), f"{type(lin).__name__}: x a view into out"


def test_add_into_odd_shapes_layouts_and_dtypes_do_what_torch_does():
    lins, gen = _linears(20, 12, 5)
    for lin in lins:
        name = type(lin).__name__
        x1, x = torch.randn(1, 12, generator=gen), torch.randn(6, 12, generator=gen)
        h = torch.randn(6, 20, generator=gen)
        # x broadcast over out's rows
        out = h.clone()
        assert torch.equal(lin.add_into(x1, out), h + lin(x1)), name
        # out that would have to broadcast: an error, as torch's in-place add gives
        assert _outcome(lambda: lin.add_into(x, torch.zeros(1, 20))) is RuntimeError, name
        # a transposed (non-contiguous) out
        out_t = h.t().contiguous().t()
        assert not out_t.is_contiguous()
        want = h + lin(x)
        assert torch.equal(lin.add_into(x, out_t), want), name
        # 3-D x into a 3-D out; and into a 2-D out of the flat shape (torch refuses)
        x3, h3 = torch.randn(2, 3, 12, generator=gen), torch.randn(2, 3, 20, generator=gen)
        out3 = h3.clone()
        assert torch.equal(lin.add_into(x3, out3), h3 + lin(x3)), name
        assert _outcome(lambda: lin.add_into(x3, h3.view(6, 20).clone())) is RuntimeError, name
        # a bf16 out: torch's in-place add of the fp32 product
        hb = h.to(torch.bfloat16)
        assert torch.equal(lin.add_into(x, hb.clone()), hb.clone().add_(lin(x))), name
        # no rows
        empty = torch.empty(0, 20)
        assert lin.add_into(torch.empty(0, 12), empty).shape == (0, 20), name


# ---- 5. attention: the fast route against the gather route -------------------------------

def _mixed_step(gen, kvh: int, d: int, dtype, quantized: bool, bs: int = 4):
    """2 decodes (contexts 5 and 9), then fresh prefills of 3 and 7, a chunk of 5 after 6
    cached tokens, a fresh prefill of 1; every sequence in its own blocks."""
    dec_lens, pre = [5, 9], [(0, 3), (6, 5), (0, 7), (0, 1)]
    seqs = dec_lens + [c + q for c, q in pre]
    per = [-(-s // bs) for s in seqs]
    nb = 1 + sum(per)
    tables, first = [], 1
    for b in per:
        tables.append(list(range(first, first + b)))
        first += b
    width = max(per)
    pad = lambda t: t + [0] * (width - len(t))  # noqa: E731
    slot = lambda i, t: tables[i][t // bs] * bs + t % bs  # noqa: E731
    slots = [slot(i, n - 1) for i, n in enumerate(dec_lens)]
    for j, (c, q) in enumerate(pre):
        slots += [slot(2 + j, t) for t in range(c, c + q)]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decodes=2, decode_block_tables=i32([pad(t) for t in tables[:2]]),
        decode_seq_lens=i32(dec_lens), num_prefills=len(pre),
        prefill_query_start_loc=i32([0, *torch.tensor([q for _, q in pre]).cumsum(0).tolist()]),
        prefill_context_lens=i32([c for c, _ in pre]), prefill_seq_lens=i32(seqs[2:]),
        prefill_block_tables=i32([pad(t) for t in tables[2:]]), prefill_query_lens_host=tuple(q for _, q in pre),
        prefill_context_lens_host=tuple(c for c, _ in pre), decode_seq_lens_host=tuple(dec_lens),
        block_scores=torch.zeros(len(seqs), width))
    if quantized:
        cache = QuantizedKVCache.zeros(nb, bs, kvh, d, dtype, "cpu")
        cache.data.copy_(torch.randint(-127, 128, cache.data.shape, generator=gen, dtype=torch.int8))
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=gen) / 50)
    else:
        cache = torch.randn(2, nb, bs, kvh, d, generator=gen).to(dtype)  # the cached context
    return meta, cache, len(slots)


def _clone(cache):
    if isinstance(cache, QuantizedKVCache):
        return QuantizedKVCache(cache.data.clone(), cache.scales.clone(), cache.dtype)
    return cache.clone()


@pytest.mark.parametrize("act_dtype,cache_dtype,quantized", [
    (torch.float32, torch.float32, False), (torch.bfloat16, torch.bfloat16, False),
    (torch.float32, torch.float32, True), (torch.bfloat16, torch.bfloat16, True)])
def test_a_mixed_step_equals_the_gather_route_bit_for_bit(act_dtype, cache_dtype, quantized):
    heads, kvh, d = 4, 2, 8
    backend = TorchAttentionBackend(num_heads=heads, num_kv_heads=kvh, head_dim=d, scale=d ** -0.5)
    gen = torch.Generator().manual_seed(7)
    meta, cache, n = _mixed_step(gen, kvh, d, cache_dtype, quantized)
    qkv = (torch.randn(n, (heads + 2 * kvh) * d, generator=gen) * 2).to(act_dtype)
    q, k, v = (qkv[:, : heads * d].view(n, heads, d), qkv[:, heads * d:(heads + kvh) * d].view(n, kvh, d),
               qkv[:, (heads + kvh) * d:].view(n, kvh, d))
    fast_cache, ref_cache = _clone(cache), _clone(cache)
    out = backend.forward(q, k, v, fast_cache, meta)
    # the reference: the same step with every prefill gathered back from the cache (k / v
    # of another dtype than the cache's make _prefill take the gather route)
    ref_meta = dataclasses.replace(meta, block_scores=torch.zeros_like(meta.block_scores))
    ref_out = backend.forward(q, k, v, ref_cache, ref_meta)  # writes the cache; decodes as above
    nd = meta.num_decodes
    ref_out[nd:] = 0
    ref_meta.block_scores[nd:] = 0
    backend._prefill(q[nd:], k[nd:].double(), v[nd:].double(), ref_cache, ref_meta, 4, ref_out[nd:])
    assert torch.equal(out, ref_out)
    assert torch.equal(meta.block_scores, ref_meta.block_scores)
    if isinstance(cache, QuantizedKVCache):
        assert torch.equal(fast_cache.data, ref_cache.data) and torch.equal(fast_cache.scales, ref_cache.scales)
    else:
        assert torch.equal(fast_cache, ref_cache)
    # the int8 cache still attends to its dequantised copy (what its decodes will read):
    # the fresh chunk's output is not the one over the projection's exact keys
    if quantized:
        qlen = meta.prefill_query_lens_host[0]
        heads_first = [t[nd:nd + qlen].transpose(0, 1)[None] for t in (q, k, v)]
        exact = F.scaled_dot_product_attention(*heads_first, is_causal=True, scale=backend.scale,
                                               enable_gqa=True)[0].transpose(0, 1)
        assert not torch.equal(out[nd:nd + qlen], exact.to(out.dtype))


# ---- 6. the engine ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", "llama", seed=6)


def _engine_tokens(path, prompts, max_tokens: int = 6, **config) -> list[list[int]]:
    from services.executor.engine.config import EngineConfig
    from services.executor.engine.engine import LLMEngine
    from services.executor.engine.sampling_params import SamplingParams

    engine = LLMEngine(path, EngineConfig(**{"block_size": 4, "num_kv_blocks": 256, **config}))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


PROMPTS = [[5, 9, 200, 31, 7, 12, 90, 4, 8], list(range(40, 77)), [17] * 3, [6] * 21, [3]]


def test_engine_greedy_tokens_are_the_same_with_the_native_rows_on_and_off(checkpoint, monkeypatch):
    used = []
    row_ops = LlamaModel._row_ops
    monkeypatch.setattr(LlamaModel, "_row_ops", lambda self, p: used.append(r := row_ops(self, p)) or r)
    on = _engine_tokens(checkpoint, PROMPTS, max_prefill_chunk=16)  # the 37-token prompt in chunks
    assert any(r is not None for r in used), "the native rows never ran"
    _no_rows(monkeypatch)
    off = _engine_tokens(checkpoint, PROMPTS, max_prefill_chunk=16)
    assert on == off


def test_two_identical_prompts_in_one_step_give_what_each_gives_alone(checkpoint):
    prompt = [11, 250, 3, 77, 19, 4, 4, 901, 12, 60, 33]  # 11 tokens: two full blocks of 4 and a partial one
    together = _engine_tokens(checkpoint, [prompt, prompt, [8, 8, 8]])
    alone = _engine_tokens(checkpoint, [prompt])
    assert together[0] == together[1] == alone[0]
    assert together[2] == _engine_tokens(checkpoint, [[8, 8, 8]])[0]

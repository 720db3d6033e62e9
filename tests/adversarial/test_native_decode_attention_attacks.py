"""The torch path's native decode-row attention (``NativeDecoder.attend_rows`` over
decode_batch.c's ``weft_attend_rows``, installed by ``ModelRunner.execute`` as
``TorchAttentionBackend.native_decode``), attacked as a hostile client and an unlucky
operator would.

The kernel, called directly, must compute what the gather path (``_decode`` without the
hook) computes, for every query-head group (1..5) at head_dim 16 / 56 / 64 / 128: rows of
1 token, of exactly one / two blocks, of 237 tokens, forks sharing full blocks, more rows
than the native step's 64, queries that are strided views of a fused qkv projection. Its
rows must not depend on each other or on the thread count (bit for bit), and NaN / inf in
slots past a row's length (its last block's tail, the table's padding block, free blocks)
must not reach any output: the gather path zeroes them; the native path must never read
them. Bad inputs must be refused with ValueError, never crash the process; the ones it
did not refuse were found here and are fixed (the comments above their tests).

Through the engine: test_native_decode_attention_engine_attacks.py.
"""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.selector import backend_class
from services.executor.model.config import ModelConfig
from services.executor.model.llama import LlamaModel
from services.executor.model.native import library
from services.executor.model.native.decoder import NativeDecoder
from tests.adversarial.attention_shapes import BS, SHAPES, overrides, threads
from weft.testing.tiny_model import model_config_dict, random_weights

COMPILER = os.environ.get("WEFT_NATIVE_CC", "gcc")
pytestmark = pytest.mark.skipif(
    shutil.which(COMPILER) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")

ROOT = Path(__file__).resolve().parents[2]
_MODELS: dict[tuple, LlamaModel] = {}


def _model(shape: str) -> LlamaModel:
    if shape not in _MODELS:
        config = ModelConfig.from_dict({**model_config_dict("tiny", "llama"), **overrides(*SHAPES[shape], 1)})
        _MODELS[shape] = LlamaModel(config, random_weights(config, seed=3), backend_class("torch"),
                                    native_decode=True)
    return _MODELS[shape]


def _layout(lens: list[int], forks: int, gen: torch.Generator, pad: int = 2) -> tuple[torch.Tensor, int]:
    """Block tables [rows, width] int32 for rows of ``lens`` tokens: rows 0..forks-1 start
    with the same two full blocks (a prefix-cache fork: their lengths must exceed 2 * BS),
    the others own scattered blocks; block 0 is nobody's (the table's padding, as the
    engine's), ``pad`` spare zero entries after the widest row. Returns (tables, num_blocks)."""
    own = [-(-n // BS) for n in lens]
    need = 1 + 2 + sum(own) + 8
    perm = (torch.randperm(need - 1, generator=gen) + 1).tolist()
    shared, free = perm[:2], iter(perm[2:])
    width = max(own) + pad
    table = torch.zeros((len(lens), width), dtype=torch.int32)
    for r, n in enumerate(own):
        first = shared if r < forks else []
        table[r, :n] = torch.tensor(first + [next(free) for _ in range(n - len(first))], dtype=torch.int32)
    return table, need


def _query(model: LlamaModel, rows: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, heads, d] fp32, a strided view of a fused qkv projection's q columns (as the
    model's forward hands the attention its q)."""
    q_dim, kv_dim = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    qkv = torch.randn(rows, q_dim + 2 * kv_dim, generator=gen)
    q = qkv[:, :q_dim].view(rows, model.num_heads, model.head_dim)
    assert not q.is_contiguous() or rows == 1
    return q


def _gathered(model: LlamaModel, cache: torch.Tensor, q: torch.Tensor, table: torch.Tensor,
              lens: list[int]) -> torch.Tensor:
    """The torch back end's gather path over the same rows (these models' back ends never
    get the runner's hook)."""
    assert model.attn.native_decode is None
    meta = AttentionMetadata.decode_only(torch.zeros(len(lens), dtype=torch.int64), table, lens)
    return model.attn._decode(q.contiguous(), cache, meta, BS)


def _owned_mask(table: torch.Tensor, lens: list[int], num_blocks: int) -> torch.Tensor:
    """[num_blocks * BS] bool: the slots some row reads (its first lens[r] tokens)."""
    owned = torch.zeros(num_blocks * BS, dtype=torch.bool)
    for r, n in enumerate(lens):
        for t in range(n):
            owned[int(table[r, t // BS]) * BS + t % BS] = True
    return owned


# ---------------------------------------------------------------------------------------
# the kernel, called directly


# 1-token rows, rows of exactly one and two blocks, a 237-token row beside them, a row
# one past a block boundary; rows 0-2 are forks over two shared full blocks
UNEVEN = [40, 33, 2 * BS + 2, 1, BS, 2 * BS, 237, 1, 5 * BS + 1, 3]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_attend_rows_equals_the_gather_path_and_is_deterministic(shape):
    model = _model(shape)
    gen = torch.Generator().manual_seed(7)
    table, num_blocks = _layout(UNEVEN, forks=3, gen=gen)
    cache = torch.randn(2, num_blocks, BS, model.num_kv_heads, model.head_dim, generator=gen)
    decoder = model.native_decoder([cache])
    q = _query(model, len(UNEVEN), gen)
    lens = torch.tensor(UNEVEN, dtype=torch.int32)

    want = _gathered(model, cache, q, table, UNEVEN)
    with threads(1):
        one = decoder.attend_rows(cache, q, table, lens)
    with threads(2):
        two = decoder.attend_rows(cache, q, table, lens)
    assert one.shape == (len(UNEVEN), model.num_heads, model.head_dim) and one.dtype == torch.float32
    torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)
    # the threads split rows (or a row's KV heads) differently; each head's sums are the same
    assert torch.equal(one, two), "1 and 2 threads give different bits"
    # a row alone (its KV heads then split over the threads) is the same row in the batch
    with threads(2):
        for r in (0, 3, 6):
            alone = decoder.attend_rows(cache, q[r:r + 1], table[r:r + 1], lens[r:r + 1])
            assert torch.equal(alone[0], one[r]), f"row {r} depends on the rows beside it"
    # the kernel reads the cache only
    assert decoder.attend_rows(cache, q, table, lens).equal(one)


@pytest.mark.parametrize("shape", ["g5_d64", "g2_d16", "g3_d128"])
def test_more_rows_than_the_native_step_takes_in_one_call(shape):
    """70 rows (MAX_ROWS is 64; the single pass hands any number here), lengths 1..40 and
    one of 250, the first four forks of one prefix, a table wider than every row needs."""
    model = _model(shape)
    gen = torch.Generator().manual_seed(70)
    lens = [int(x) for x in torch.randint(1, 41, (70,), generator=gen)]
    lens[:4] = [2 * BS + 1, 2 * BS + 9, 3 * BS, 2 * BS + 1]
    lens[50] = 250
    table, num_blocks = _layout(lens, forks=4, gen=gen, pad=5)
    cache = torch.randn(2, num_blocks, BS, model.num_kv_heads, model.head_dim, generator=gen)
    decoder = model.native_decoder([cache])
    q = _query(model, 70, gen)
    with threads(2):
        got = decoder.attend_rows(cache, q, table, torch.tensor(lens, dtype=torch.int32))
    torch.testing.assert_close(got, _gathered(model, cache, q, table, lens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("poison", ["nan_keys_inf_values", "inf_keys_nan_values"])
@pytest.mark.parametrize("shape", ["g2_d64", "g5_d128", "g3_d56", "g2_d16"])
def test_non_finite_values_past_a_rows_length_never_reach_an_output(shape, poison):
    """Every slot no row reads (the tails of last blocks, the padding block 0 every table
    ends in, blocks nobody owns) holds NaN / inf, in both halves of the cache. The native
    rows stay finite, equal the gather path (which zeroes those values), and equal the
    native rows over a clean cache bit for bit: it reads nothing past a row's length."""
    model = _model(shape)
    gen = torch.Generator().manual_seed(13)
    lens = [2 * BS + 3, 3 * BS, 2 * BS + 5, 1, 7, BS + 3, 100]
    table, num_blocks = _layout(lens, forks=3, gen=gen, pad=3)
    clean = torch.randn(2, num_blocks, BS, model.num_kv_heads, model.head_dim, generator=gen)
    stale = ~_owned_mask(table, lens, num_blocks)
    assert stale[:BS].all() and stale.sum() > num_blocks  # block 0 and every partial block's tail
    poisoned = clean.clone()
    k_bad, v_bad = (float("nan"), float("inf")) if poison == "nan_keys_inf_values" else (float("inf"), float("nan"))
    flat = poisoned.view(2, num_blocks * BS, -1)
    flat[0, stale] = k_bad
    flat[1, stale] = v_bad
    q = _query(model, len(lens), gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    got = model.native_decoder([poisoned]).attend_rows(poisoned, q, table, seq_lens)
    assert torch.isfinite(got).all(), "a stale slot's NaN / inf reached a row's output"
    torch.testing.assert_close(got, _gathered(model, poisoned, q, table, lens), rtol=1e-5, atol=1e-5)
    assert torch.equal(got, model.native_decoder([clean]).attend_rows(clean, q, table, seq_lens))


def _two_rows(seed: int):
    """A g2_d64 decoder over a random one-layer cache and two valid rows (20 and 5 tokens):
    (model, decoder, cache, q, block table, lengths, num_blocks)."""
    model = _model("g2_d64")
    gen = torch.Generator().manual_seed(seed)
    lens_list = [20, 5]
    table, num_blocks = _layout(lens_list, forks=0, gen=gen)
    cache = torch.randn(2, num_blocks, BS, model.num_kv_heads, model.head_dim, generator=gen)
    decoder = model.native_decoder([cache])
    return model, decoder, cache, _query(model, 2, gen), table, torch.tensor(lens_list, dtype=torch.int32), num_blocks


def test_bad_inputs_are_refused_with_value_error_and_the_decoder_still_works():
    model, decoder, cache, q, table, lens, _ = _two_rows(1)
    gen = torch.Generator().manual_seed(2)
    good = decoder.attend_rows(cache, q, table, lens)

    bad = {
        "q float64": (cache, q.double(), table, lens),
        "q float16": (cache, q.half(), table, lens),
        "q 2-D": (cache, q.reshape(2, -1), table, lens),
        "q head_dim strided": (cache, torch.randn(2, model.num_heads, 2 * model.head_dim)[..., ::2], table, lens),
        "q heads transposed": (cache, q.contiguous().transpose(0, 1).contiguous().transpose(0, 1), table, lens),
        "3 query rows, 2 table rows": (cache, _query(model, 3, gen), table, lens),
        "3 table rows": (cache, q, torch.cat([table, table[:1]]), lens),
        "3 seq_lens": (cache, q, table, torch.tensor([20, 5, 1], dtype=torch.int32)),
        "1 seq_len": (cache, q, table, lens[:1]),
        "int64 tables": (cache, q, table.long(), lens),
        "int64 seq_lens": (cache, q, table, lens.long()),
        "tables column-major": (cache, q, table.t().contiguous().t(), lens),
        "tables every other column": (cache, q, torch.cat([table, table], 1)[:, ::2], lens),
        "seq_lens strided": (cache, q, table, torch.tensor([20, 0, 5, 0], dtype=torch.int32)[::2]),
        "a copy of the cache": (cache.clone(), q, table, lens),
        "a cache of the same shape": (torch.zeros_like(cache), q, table, lens),
        "the values half alone": (cache[1], q, table, lens),
    }
    assert table.t().contiguous().t().stride(1) != 1
    for why, args in bad.items():
        with pytest.raises(ValueError):
            decoder.attend_rows(*args)
            pytest.fail(f"{why}: accepted")
    assert torch.equal(decoder.attend_rows(cache, q, table, lens), good)


# Inputs attend_rows did not check although the C kernel trusts them (now refused). These do not
# write out of bounds (q / out rows keep their strides), so they run in this process:
# each silently returned garbage (uninitialised heads, a reshaped query, zeros for an
# empty context) where the gather path raises or gives NaN and step_rows refuses
# seq_lens < 1.
# Found by this attack, fixed since (NativeDecoder._check_tables and the q shape check):
# NativeDecoder.attend_rows checks q's dtype and strides but not that q is [R, num_heads,
# head_dim] of the model, nor that seq_lens >= 1 (step_rows refuses < 1): the kernel reads
# num_heads * head_dim floats per row whatever q's shape and returns torch.empty's garbage / zeros
# instead of raising ValueError
@pytest.mark.parametrize("case", ["more_heads", "heads_reshaped", "seq_len_zero", "seq_len_negative"])
def test_unchecked_shapes_and_lengths_are_refused(case):
    model = _model("g2_d64")
    gen = torch.Generator().manual_seed(2)
    table, num_blocks = _layout([20, 5], forks=0, gen=gen)
    cache = torch.randn(2, num_blocks, BS, model.num_kv_heads, model.head_dim, generator=gen)
    decoder = model.native_decoder([cache])
    h, d = model.num_heads, model.head_dim
    q, lens = _query(model, 2, gen), torch.tensor([20, 5], dtype=torch.int32)
    if case == "more_heads":
        q = torch.randn(2, h + 1, d)
    elif case == "heads_reshaped":
        q = torch.randn(2, 2 * h, d // 2)
    elif case == "seq_len_zero":
        lens = torch.tensor([20, 0], dtype=torch.int32)
    else:
        lens = torch.tensor([20, -7], dtype=torch.int32)
    with pytest.raises(ValueError):
        decoder.attend_rows(cache, q, table, lens)


_CRASH_SCRIPT = r"""
import sys, torch
from services.executor.attention.selector import backend_class
from services.executor.model.config import ModelConfig
from services.executor.model.llama import LlamaModel
from weft.testing.tiny_model import model_config_dict, random_weights
config = ModelConfig.from_dict({**model_config_dict("tiny", "llama"), "num_hidden_layers": 1})
model = LlamaModel(config, random_weights(config, seed=1), backend_class("torch"), native_decode=True)
cache = torch.randn(2, 8, 16, model.num_kv_heads, model.head_dim)
decoder = model.native_decoder([cache])
rows, h, d = 64, model.num_heads, model.head_dim
q = torch.randn(rows, h, d)
table = torch.tensor([[1, 2]] * rows, dtype=torch.int32)
lens = torch.full((rows,), 20, dtype=torch.int32)
case = sys.argv[1]
if case == "one_head":  # out is [rows, 1, d]: the kernel writes num_heads * d floats a row into it
    q = torch.randn(rows, 1, d)
elif case == "block_id_past_the_pool":
    table = torch.tensor([[1, 2 + 10**8]] * rows, dtype=torch.int32)
elif case == "table_narrower_than_seq_len":
    table = torch.tensor([[1]] * rows, dtype=torch.int32)
    lens = torch.full((rows,), 16 * 4000, dtype=torch.int32)
try:
    out = decoder.attend_rows(cache, q, table, lens)
except ValueError as exc:
    print("REFUSED", exc)
    sys.exit(0)
print("ACCEPTED", tuple(out.shape))
sys.exit(3)
"""


# Inputs that make the kernel read (or write) outside the tensors it was given: in a child
# process, so a crash or heap corruption fails this test, not the session.
# Found by this attack, fixed since (NativeDecoder._check_tables and the q shape check):
# NativeDecoder.attend_rows does not check q's head count against the model (the kernel writes
# num_heads * head_dim floats per row into an `out` sized from q: a heap overflow), nor block ids
# against num_blocks, nor seq_lens against the table width (out-of-bounds reads; the gather path
# raises IndexError): it must raise ValueError
@pytest.mark.parametrize("case", ["one_head", "block_id_past_the_pool", "table_narrower_than_seq_len"])
def test_out_of_bounds_inputs_are_refused_without_touching_memory(case):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, case], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "REFUSED" in proc.stdout, (
        f"{case}: exit {proc.returncode}, stdout {proc.stdout[-300:]!r}, stderr {proc.stderr[-300:]!r}")


# flags appended after -march=native (the last one wins), as on CPUs without them
WITHOUT = {
    "avx2_only": ("-mno-avx512f",),
    "no_avx": ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-avx"),
}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="the extensions are turned off with x86 flags")
@pytest.mark.parametrize("variant", list(WITHOUT))
def test_attend_rows_of_a_library_built_without_avx512(variant, tmp_path):
    script = tmp_path / "cc-without"
    script.write_text(f'#!/bin/sh\nexec {shutil.which(COMPILER)} "$@" {" ".join(WITHOUT[variant])}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    lib = library._declare(ctypes.CDLL(str(library.build(str(script), tmp_path))))
    gen = torch.Generator().manual_seed(5)
    lens = [2 * BS + 3, 3 * BS, 1, BS, 237, 7]
    for shape in ("g5_d64", "g3_d56"):
        model = _model(shape)
        table, num_blocks = _layout(lens, forks=2, gen=gen)
        cache = torch.randn(2, num_blocks, BS, model.num_kv_heads, model.head_dim, generator=gen)
        cache.view(2, num_blocks * BS, -1)[:, ~_owned_mask(table, lens, num_blocks)] = float("nan")
        decoder = NativeDecoder(lib, model, [cache])
        q = _query(model, len(lens), gen)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        with threads(1):
            one = decoder.attend_rows(cache, q, table, seq_lens)
        with threads(2):
            two = decoder.attend_rows(cache, q, table, seq_lens)
        assert torch.isfinite(one).all() and torch.equal(one, two)
        torch.testing.assert_close(one, _gathered(model, cache, q, table, lens), rtol=1e-5, atol=1e-5)


def test_a_table_changed_in_place_after_a_call_is_checked_again():
    # the decoder checks a step's tables once for all its layers (by identity and _version):
    # a table written in place between calls must not ride on the earlier check
    _, decoder, cache, q, table, lens, num_blocks = _two_rows(3)
    decoder.attend_rows(cache, q, table, lens)
    table[0, 0] = num_blocks + 5
    with pytest.raises(ValueError, match="outside the pool"):
        decoder.attend_rows(cache, q, table, lens)
    lens[1] = table.shape[1] * BS + 1
    table[0, 0] = 0
    with pytest.raises(ValueError, match="sequence length"):
        decoder.attend_rows(cache, q, table, lens)

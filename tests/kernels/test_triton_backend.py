"""TritonAttentionBackend.forward on a mixed step: 2 decodes, then 2 prefill chunks."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.reference import (
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
    ref_write_kv_cache,
)
from services.executor.attention.base import AttentionMetadata
from services.executor.attention.triton_backend import TritonAttentionBackend
from tests.kernels.paged_inputs import (
    DEVICE,
    ON_GPU,
    assert_close,
    generator,
    int32,
    make_block_tables,
    make_kv_cache,
    query_start_loc,
    randn,
    slots_of,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4
SCALE = HEAD_DIM ** -0.5


def _mixed_step(decode_seq_lens: list[int], prefill_context_lens: list[int],
                prefill_query_lens: list[int], seed: int = 0):
    """Inputs of one step; the cache already holds every token before this step's."""
    gen = generator(seed)
    prefill_seq_lens = [c + n for c, n in zip(prefill_context_lens, prefill_query_lens)]
    all_lens = decode_seq_lens + prefill_seq_lens
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in all_lens) + 4
    kv_cache = make_kv_cache(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, gen)
    tables = make_block_tables(all_lens, BLOCK_SIZE, num_blocks, gen)
    num_decodes = len(decode_seq_lens)
    decode_tables, prefill_tables = tables[:num_decodes], tables[num_decodes:]

    slots = []
    for row, seq_len in enumerate(decode_seq_lens):  # each decode's new token is its last
        slots += slots_of(decode_tables[row], [seq_len - 1], BLOCK_SIZE)
    for row, (context_len, seq_len) in enumerate(zip(prefill_context_lens, prefill_seq_lens)):
        slots += slots_of(prefill_tables[row], list(range(context_len, seq_len)), BLOCK_SIZE)
    num_tokens = len(slots)

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        num_decodes=num_decodes,
        decode_block_tables=decode_tables,
        decode_seq_lens=int32(decode_seq_lens),
        num_prefills=len(prefill_query_lens),
        prefill_query_start_loc=query_start_loc(prefill_query_lens),
        prefill_context_lens=int32(prefill_context_lens),
        prefill_seq_lens=int32(prefill_seq_lens),
        prefill_block_tables=prefill_tables,
        prefill_query_lens_host=tuple(prefill_query_lens),
        prefill_context_lens_host=tuple(prefill_context_lens),
        decode_seq_lens_host=tuple(decode_seq_lens),
    )
    q = randn(num_tokens, NUM_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen)
    k = randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen)
    v = randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen)
    return q, k, v, kv_cache, meta


def _expected(q, k, v, kv_cache, meta: AttentionMetadata):
    """Direct computation with the references: write, then decode rows, then prefill rows."""
    cache = kv_cache.clone()
    ref_write_kv_cache(k, v, cache, meta.slot_mapping)
    d = meta.num_decodes
    out = torch.cat([
        ref_paged_decode_attention(q[:d], cache, meta.decode_block_tables, meta.decode_seq_lens, SCALE),
        ref_paged_prefill_attention(q[d:], cache, meta.prefill_block_tables,
                                    meta.prefill_query_start_loc, meta.prefill_context_lens,
                                    meta.prefill_seq_lens, SCALE),
    ])
    return out, cache


@pytest.mark.parametrize("decode_seq_lens,prefill_context_lens,prefill_query_lens", [
    ([7, BLOCK_SIZE + 1], [0, BLOCK_SIZE + 2], [5, 4]),  # 2 decodes + 2 prefill chunks
    ([1, 2 * BLOCK_SIZE], [], []),  # decodes only
    ([], [BLOCK_SIZE - 1, 0], [1, 2 * BLOCK_SIZE + 1]),  # prefills only
], ids=["mixed", "decode_only", "prefill_only"])
def test_forward_writes_cache_and_matches_references(decode_seq_lens, prefill_context_lens,
                                                     prefill_query_lens):
    q, k, v, kv_cache, meta = _mixed_step(decode_seq_lens, prefill_context_lens, prefill_query_lens)
    expected_out, expected_cache = _expected(q, k, v, kv_cache, meta)
    backend = TritonAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE)

    out = backend.forward(q, k, v, kv_cache, meta)
    assert backend.name == "triton"
    assert out.shape == q.shape
    assert torch.equal(kv_cache, expected_cache)
    assert_close(out, expected_out, torch.float32)


def test_forward_without_host_lengths_matches_references():
    # Without host copies the decode split count comes from the block-table width.
    q, k, v, kv_cache, meta = _mixed_step([3, 6 * BLOCK_SIZE + 1], [2], [3], seed=5)
    meta = dataclasses.replace(meta, decode_seq_lens_host=(), prefill_query_lens_host=(),
                               prefill_context_lens_host=())
    expected_out, _ = _expected(q, k, v, kv_cache, meta)
    out = TritonAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE).forward(q, k, v, kv_cache, meta)
    assert_close(out, expected_out, torch.float32)


def test_forward_rejects_wrong_head_count():
    q, k, v, kv_cache, meta = _mixed_step([3], [], [])
    backend = TritonAttentionBackend(2 * NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE)
    with pytest.raises(ValueError, match="expected"):
        backend.forward(q, k, v, kv_cache, meta)


def test_import_is_lazy_and_cpu_use_turns_the_interpreter_on():
    if ON_GPU:
        pytest.skip("checks the CPU path: with CUDA the interpreter stays off")
    script = (
        "import os, sys, torch\n"
        "from services.executor.attention.triton_backend import TritonAttentionBackend\n"
        "assert 'triton' not in sys.modules, 'importing the back end imported triton'\n"
        "TritonAttentionBackend(2, 1, 16, 0.25)._load_kernels()\n"
        "assert os.environ.get('TRITON_INTERPRET') == '1'\n"
        "from kernels.paged_decode import is_interpreted\n"
        "assert is_interpreted()\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

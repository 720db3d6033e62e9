"""Issue 16, attacks on the seventh pass's attention (72aabab, d9bd226), at the level of the
steps that call it: both decode steps (decode.c's batch-1 step and decode_batch.c's
multi-row step, which call llama_step.h's ``attend_kv_heads``) against the torch forward
pass, with the helpers of test_issue16_native_avx2_attacks.py: context lengths around
16-token blocks over block sizes 4, 5 and 16, head_dim 144 / 250 / 258 (9, 16 and 17
chunks of 16), and one row of 2,048 tokens beside rows of 1, 15, 17 and 1,024 in the same
step (one attention item per row, and per (row, KV head)). The kernel itself, through the
ctypes shim: test_issue16_avx512_attention.py.
"""
from __future__ import annotations

import pytest

from tests.adversarial.native_kernel_shim import pytestmark as native_only
from tests.adversarial.test_issue16_native_avx2_attacks import Case, _check, _model


@native_only
@pytest.mark.parametrize("bs", [4, 5, 16])
def test_both_steps_at_context_lengths_around_16_token_blocks(bs):
    model = _model({"head_dim": 20, "hidden_size": 40, "intermediate_size": 50, "vocab_size": 97})
    _check(Case(model, bs, [1, 15, 16, 17, 31, 32, 33, 48, 49], seed=bs))


@native_only
@pytest.mark.parametrize("head_dim", [144, 250, 258])
def test_both_steps_with_more_than_8_chunks_per_head(head_dim):
    # 9, 16 and 17 chunks of 16: the value pass's later register groups; SmolLM2's GQA
    # ratio 3 (6 query heads over 2 KV heads)
    model = _model({"head_dim": head_dim, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 36,
                    "intermediate_size": 40, "vocab_size": 61})
    _check(Case(model, 16, [1, 16, 17, 40], seed=head_dim))


@native_only
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("bs", [7, 16])
def test_one_step_with_rows_of_very_different_lengths(bs, threads):
    # 2,048 tokens beside 1, 15, 17 and 1,024 in one multi-row step (one thread's scratch
    # serves rows of every length in turn; 3 threads: 5 rows < 2 per thread, one item per
    # (row, KV head)), and each through the batch-1 step
    model = _model({"head_dim": 32, "hidden_size": 32, "intermediate_size": 40, "vocab_size": 67,
                    "max_position_embeddings": 4096})
    _check(Case(model, bs, [2048, 1, 15, 1024, 17], seed=bs), threads=threads)

"""Block hash chains: fixed values, stable across processes, salted per tenant and model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.shared.block_hash import extra_keys_for, hash_block, hash_block_chain

REPO_ROOT = Path(__file__).resolve().parents[3]


# Computed once with blake2b; a change here breaks agreement with every other
# executor, the scheduler and the cachestore over the wire.
EXPECTED_CHAIN = [17594570968189765551, 10329346635462605514]
CHAIN_INPUT = ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, extra_keys_for("m", "t"))


def test_block_hash_chain_has_a_fixed_value_for_a_fixed_input():
    tokens, block_size, extra = CHAIN_INPUT
    assert hash_block_chain(tokens, block_size, extra) == EXPECTED_CHAIN


def test_block_hash_chain_is_the_same_in_a_process_with_another_hash_seed():
    code = (
        "from services.shared.block_hash import extra_keys_for, hash_block_chain;"
        "print(hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, extra_keys_for('m', 't')))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(EXPECTED_CHAIN)


def test_tenant_salt_and_model_id_change_every_block_hash():
    tokens = list(range(8))
    base = hash_block_chain(tokens, 4, extra_keys_for("m", "alice"))
    other_tenant = hash_block_chain(tokens, 4, extra_keys_for("m", "bob"))
    other_model = hash_block_chain(tokens, 4, extra_keys_for("m2", "alice"))
    assert len(base) == 2
    assert not set(base) & set(other_tenant)
    assert not set(base) & set(other_model)


def test_block_hash_covers_the_parent_so_equal_tokens_after_different_prefixes_differ():
    a = hash_block_chain([1, 1, 5, 5], 2)
    b = hash_block_chain([2, 2, 5, 5], 2)
    assert a[1] != b[1]
    assert hash_block_chain([1, 1, 5, 5], 2, parent=a[0], start=2) == [a[1]]


def test_a_chain_is_hash_block_applied_block_by_block_from_any_start_and_parent():
    tokens = [(i * 7919) % 50_000 for i in range(203)]  # a trailing partial block too
    extra = extra_keys_for("m", "t")
    for block_size in (1, 4, 16):
        for parent, start in ((None, 0), (12345, 0), (None, 2 * block_size), (2**64 - 1, 3 * block_size)):
            expected, prev = [], parent
            for begin in range(start, len(tokens) - block_size + 1, block_size):
                prev = hash_block(prev, tokens[begin:begin + block_size], extra)
                expected.append(prev)
            assert hash_block_chain(tokens, block_size, extra, parent=parent, start=start) == expected
    assert hash_block_chain(tokens[:3], 4) == []
    assert hash_block_chain(tokens, 4, start=len(tokens) - len(tokens) % 4) == []

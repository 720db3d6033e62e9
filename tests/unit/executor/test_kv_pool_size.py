"""How many KV blocks a byte budget buys: the budget, but never more than twice what
``max_num_seqs`` full-length sequences fill (a tiny model would otherwise set up 10^5
blocks it never touches; a real one, e.g. SmolLM2 at 1 GiB, is bound by the bytes)."""
from __future__ import annotations

import pytest

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.model_runner import ModelRunner
from weft.testing.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-pool"), preset="tiny", arch="llama")


def test_a_byte_budget_beyond_what_the_batch_can_use_stops_at_twice_the_batch(checkpoint):
    config = EngineConfig(max_num_seqs=4, max_model_len=256)
    engine = LLMEngine(checkpoint, config)
    block_bytes = ModelRunner.kv_bytes_per_block(engine.model, config.block_size, config.kv_cache_dtype)
    assert config.kv_cache_memory_bytes // block_bytes > 2 * 4 * 256 // 16  # the budget alone would buy more
    assert engine.num_blocks == 2 * 4 * 256 // 16


def test_a_small_byte_budget_and_an_explicit_block_count_are_kept(checkpoint):
    small = LLMEngine(checkpoint, EngineConfig(max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=1 << 16))
    block_bytes = ModelRunner.kv_bytes_per_block(small.model, 16, "auto")
    assert small.num_blocks == (1 << 16) // block_bytes < 2 * 4 * 256 // 16
    assert LLMEngine(checkpoint, EngineConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=1000)).num_blocks == 1000

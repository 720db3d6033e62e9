"""Per-tenant salted prefix cache: a request for another tenant's cached prefix misses
(no cross-tenant timing leak), while the owning tenant hits."""
from __future__ import annotations

import pytest

from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.engine.sampling_params import SamplingParams
from weft.testing.tiny_model import make_tiny_checkpoint

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    return LLMEngine(path, EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=64, num_threads=1))


def _cached_tokens(engine: LLMEngine, rid: str, prompt: list[int], tenant: str) -> int:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), tenant_salt=tenant)
    cached = None
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                cached = out.num_cached_tokens
    return cached


def test_another_tenants_cached_prefix_misses_and_the_owner_hits(engine):
    prompt = [(11 * i) % 400 + 30 for i in range(4 * BLOCK_SIZE + 3)]
    assert _cached_tokens(engine, "acme-1", prompt, "acme") == 0  # cold
    assert _cached_tokens(engine, "globex-1", prompt, "globex") == 0  # same tokens, other tenant: miss
    assert _cached_tokens(engine, "acme-2", prompt, "acme") == 4 * BLOCK_SIZE  # owner: every full block hits

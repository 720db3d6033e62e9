"""A promotion's lookup never waits for the engine thread's step in progress.

Every request passes ``Promoter.promote`` before the engine gets it; when its count of the
prompt's local blocks went through ``AsyncEngine.call`` it waited for the step running at
that moment, adding up to a whole step to every time to first token under load. The engine
thread here is held inside a ``call`` (standing for a long step) while a promotion runs:
the promotion must finish, and see the blocks the pool holds."""
from __future__ import annotations

import asyncio
import threading

import pytest

from services.executor.engine.async_engine import AsyncEngine
from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.tiers.kv_transfer import KvTransfer
from services.executor.tiers.promotion import Promoter
from weft.testing.tiny_model import make_tiny_checkpoint

BLOCK_SIZE = 16
DEADLINE_S = 20.0


class _EmptyStore:
    """A cachestore that holds nothing: the lookup answers "absent" for every block."""

    def __init__(self) -> None:
        self.looked_up: list[list[int]] = []

    async def contains(self, hashes):
        self.looked_up.append(list(hashes))
        return [None] * len(hashes)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-promo"), preset="tiny", arch="llama")


def test_the_local_block_count_does_not_wait_for_a_busy_engine_thread(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32, block_size=BLOCK_SIZE, num_threads=1))
    ae = AsyncEngine(engine)
    store = _EmptyStore()
    promoter = Promoter(KvTransfer(ae), store, engine.model_id, BLOCK_SIZE)
    prompt = [(7 + 3 * i) % 500 for i in range(5 * BLOCK_SIZE + 3)]
    release = threading.Event()

    async def scenario():
        from services.executor.engine.sampling_params import SamplingParams
        async for _ in ae.generate("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)):
            pass  # the prompt's full blocks are now cached in the pool
        busy = asyncio.ensure_future(ae.call(lambda e: release.wait(DEADLINE_S)))  # the thread is held
        try:
            result = await asyncio.wait_for(promoter.promote(prompt), DEADLINE_S / 2)
            assert not busy.done(), "the engine thread was not held during the promotion"
            return result
        finally:
            release.set()
            await busy

    try:
        result = asyncio.run(scenario())
    finally:
        release.set()
        ae.shutdown(timeout_s=5.0)
    # 5 full blocks of 83 tokens can hit (never the last prompt token): all local
    assert result.num_local_blocks == 5
    assert store.looked_up == []  # nothing beyond the local blocks: the store is not asked

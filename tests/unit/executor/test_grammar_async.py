"""A grammar compiles off the engine thread: a cache miss must not pause every stream."""
from __future__ import annotations

import asyncio
import threading

import pytest

from services.executor.engine.async_engine import AsyncEngine
from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
from services.executor.errors import InvalidRequestError
from services.executor.grammar.compiler import GrammarCache
from weft.testing.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


def test_the_compile_of_a_new_grammar_runs_outside_the_engine_thread(checkpoint, monkeypatch):
    compiled_on: list[str] = []
    original = GrammarCache._compile

    def recording(self, spec):
        compiled_on.append(threading.current_thread().name)
        return original(self, spec)

    monkeypatch.setattr(GrammarCache, "_compile", recording)
    engine = AsyncEngine(LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32, num_threads=1)))

    async def go():
        params = SamplingParams(max_tokens=8, temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{3}"))
        outs = [o async for o in engine.generate("r1", [1, 2, 3], params)]
        with pytest.raises(InvalidRequestError) as err:  # a refusal still comes before any output
            async for _ in engine.generate("r2", [1, 2, 3], SamplingParams(
                    max_tokens=8, grammar=GrammarSpec("ebnf", "root ::= undefined_rule"))):
                pass
        return outs, err.value

    try:
        outs, err = asyncio.run(go())
    finally:
        engine.shutdown()
    assert outs[-1].finished
    assert "grammar.ebnf" in str(err)
    assert len(compiled_on) == 2, compiled_on  # each grammar compiled once ...
    assert "weft-engine" not in compiled_on, compiled_on  # ... and never on the engine thread

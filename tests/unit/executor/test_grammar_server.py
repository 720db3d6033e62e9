"""Constrained decoding at the executor's gRPC door (real server, real engine, tiny model):
a bad grammar is INVALID_ARGUMENT naming the field, a good one constrains the stream, and
the executor keeps serving after either."""
from __future__ import annotations

import asyncio
import contextlib
import re

import grpc
import pytest

from services.executor.engine.async_engine import AsyncEngine
from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.server import ERROR_RULES, ExecutorServicer
from services.mesh.grpc_server import GrpcServer, channel_options
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


@contextlib.asynccontextmanager
async def executor(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32, num_threads=1))
    async_engine = AsyncEngine(engine)
    server = GrpcServer("weft.v1.Executor", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1)
    executor_pb2_grpc.add_ExecutorServicer_to_server(
        ExecutorServicer(async_engine, "executor-g", engine.model_id, 16), server.server)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    try:
        yield executor_pb2_grpc.ExecutorStub(channel), engine
    finally:
        await channel.close()
        await server.server.stop(0)
        async_engine.shutdown()


async def _generate(stub, rid: str, grammar: common_pb2.Grammar) -> list[int]:
    sampling = common_pb2.SamplingParams(max_tokens=16, temperature=0.0, grammar=grammar)
    tokens = []
    async for chunk in stub.Generate(executor_pb2.ExecuteRequest(request_id=rid, prompt_token_ids=PROMPT,
                                                                 sampling=sampling), timeout=60):
        tokens.extend(chunk.token_ids_delta)
    return tokens


@pytest.mark.parametrize("grammar,field", [
    (common_pb2.Grammar(json_schema='{"type": "objec"}'), "grammar.json_schema"),
    (common_pb2.Grammar(json_schema="{not json"), "grammar.json_schema"),
    (common_pb2.Grammar(regex="([a-"), "grammar.regex"),
    (common_pb2.Grammar(ebnf="root ::= missing"), "grammar.ebnf"),
    (common_pb2.Grammar(structural_tag='{"type": "structural_tag"}'), "grammar.structural_tag"),
])
def test_a_bad_grammar_is_invalid_argument_naming_the_field_and_the_executor_keeps_serving(
        checkpoint, grammar, field):
    async def go():
        async with executor(checkpoint) as (stub, engine):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(stub, "bad", grammar)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{field}: ")
            tokens = await _generate(stub, "good", common_pb2.Grammar(regex="[0-9]{2}"))
            vocab = engine.grammars.tokenizer_info.decoded_vocab
            text = b"".join(vocab[t] for t in tokens if t not in engine.model_config.eos_token_ids)
            assert re.fullmatch(rb"[0-9]{2}", text)
    asyncio.run(go())

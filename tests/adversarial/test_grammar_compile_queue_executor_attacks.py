"""The grammar compile queue attacked through the real executor: clients that hang up while
their compile waits (gRPC), and requests whose grammar is cached arriving behind a flood of
new ones (the async engine's thread pool). The cache itself: test_grammar_compile_queue_attacks.py."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.executor.engine.sampling_params import GrammarSpec
from tests.adversarial.grammar_queue import GUARD, LONG, Holds, idle, regex
from weft.testing.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


def test_clients_cancelling_while_their_compile_waits_do_not_wedge_the_executor(checkpoint, monkeypatch):
    from services.executor.engine.async_engine import AsyncEngine
    from services.executor.engine.config import EngineConfig
    from services.executor.engine.engine import LLMEngine
    from services.executor.server import ERROR_RULES, ExecutorServicer
    from services.mesh.grpc_server import GrpcServer, channel_options
    from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc

    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32, num_threads=1, grammar_compile_timeout_s=LONG))
    cache = engine.grammars
    held = ["[0-9]{2}", "[a-z]{2}", "[0-9][a-z]", "[a-z][0-9]"]
    holds = Holds(cache, monkeypatch, held=held)

    async def until(cond, what: str) -> None:  # wait_for, without blocking the event loop
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GUARD
        while not cond():
            assert loop.time() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)

    async def generate(stub, rid: str, pattern: str) -> list[int]:
        sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, grammar=common_pb2.Grammar(regex=pattern))
        tokens = []
        async for chunk in stub.Generate(executor_pb2.ExecuteRequest(
                request_id=rid, prompt_token_ids=[5, 6, 7, 8], sampling=sampling), timeout=LONG):
            tokens.extend(chunk.token_ids_delta)
        return tokens

    async def go():
        async_engine = AsyncEngine(engine)
        server = GrpcServer("weft.v1.Executor", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1)
        executor_pb2_grpc.add_ExecutorServicer_to_server(
            ExecutorServicer(async_engine, "executor-q", engine.model_id, 16), server.server)
        port = await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        try:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            calls = [asyncio.ensure_future(generate(stub, f"r{i}", pattern)) for i, pattern in enumerate(held)]
            await until(lambda: len(cache.workers) == 2 and cache._waiting == 2, "two compiling, two waiting")
            # two waiting clients and one compiling client hang up
            waiting_texts = [t for t in held if ("regex", t) not in cache._inflight]
            compiling_texts = [t for t in held if ("regex", t) in cache._inflight]
            gone = {held.index(t) for t in waiting_texts + compiling_texts[:1]}
            for i in gone:
                calls[i].cancel()
            holds.release()
            for i, call in enumerate(calls):
                if i in gone:
                    with pytest.raises(asyncio.CancelledError):
                        await call
                else:
                    assert await asyncio.wait_for(call, GUARD)
            await until(lambda: idle(cache), "every compile finished")
            # the executor still serves: a grammar a cancelled client sent, and a new one
            assert await asyncio.wait_for(generate(stub, "again", waiting_texts[0]), GUARD)
            assert await asyncio.wait_for(generate(stub, "new", "[0-9]{3}"), GUARD)
            await until(lambda: not engine.requests, "no request left in the engine")
        finally:
            await channel.close()
            await server.server.stop(0)
            async_engine.shutdown()

    asyncio.run(go())
    assert idle(cache) and cache.num_compiles == len(held) + 1


# Found by this attack, fixed since: AsyncEngine.generate sends every grammar request, cached or
# not, through loop.run_in_executor(None, grammars.get): the loop's default pool, min(32, cpus +
# 4) threads. Since 83810dd a compile that finds both compilers busy holds its pool thread while
# it waits (up to compile_timeout_s, then up to compile_timeout_s more compiling), and up to
# MAX_WAITING (16) + compile_threads (2) = 18 may do so: on a box with under 14 CPUs, a client
# sending that many new grammars fills the pool, and every other request with a grammar, even one
# already cached, queues behind them for up to 2 x compile_timeout_s (before the change busy
# compiles were refused at once and held no pool thread).
def test_a_request_whose_grammar_is_cached_is_not_queued_behind_compiles_waiting_for_a_worker(
        checkpoint, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from services.executor.engine.async_engine import AsyncEngine
    from services.executor.engine.config import EngineConfig
    from services.executor.engine.engine import LLMEngine
    from services.executor.engine.sampling_params import SamplingParams

    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32, num_threads=1, grammar_compile_timeout_s=LONG))
    cache = engine.grammars
    cached = GrammarSpec("regex", "[0-9]{2}")
    cache.get(cached)
    pool = ThreadPoolExecutor(max_workers=8 + 4)  # the default pool of an 8-CPU executor
    new = [regex(i) for i in range(pool._max_workers)]
    holds = Holds(cache, monkeypatch, held=[s.text for s in new])

    async def collect(rid: str, spec: GrammarSpec):
        params = SamplingParams(max_tokens=4, temperature=0.0, grammar=spec)
        return [o async for o in async_engine.generate(rid, [5, 6, 7, 8], params)]

    async def go():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(pool)
        flood = [asyncio.ensure_future(collect(f"new{i}", s)) for i, s in enumerate(new)]
        deadline = loop.time() + GUARD
        while not (len(cache.workers) == 2 and cache._waiting == len(new) - 2):
            assert loop.time() < deadline, "the flood never filled the compilers and the queue"
            await asyncio.sleep(0.02)
        victim = asyncio.ensure_future(collect("victim", cached))
        while not (victim.done() or pool._work_queue.qsize() > 0):
            assert loop.time() < deadline, "the cached request neither finished nor queued"
            await asyncio.sleep(0.02)
        served_while_flooded = victim.done()
        holds.release()
        for task in flood + [victim]:
            assert (await asyncio.wait_for(task, GUARD))[-1].finished
        return served_while_flooded

    async_engine = AsyncEngine(engine)
    try:
        served_while_flooded = asyncio.run(go())
    finally:
        holds.release()
        async_engine.shutdown()
        pool.shutdown(wait=False)
    assert idle(cache)
    assert served_while_flooded, "a cached grammar's request waited in the pool behind compiles waiting for a worker"

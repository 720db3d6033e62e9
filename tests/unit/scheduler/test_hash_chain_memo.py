"""The dispatcher hashes a prompt's block chain once per request (issue 16, the scheduler's
own work on the first-token path): a request with a TTFT ceiling ranks its prompt for the
contract's cached-prefix estimate and again for placement; the memo is keyed by content,
so a changed prompt is never served an old chain, and it is bounded."""
from __future__ import annotations

import asyncio

from services.scheduler.api import convert
from services.scheduler.api.executor_port import ChannelPool
from services.scheduler.app import build_dispatcher
from services.scheduler.config import SchedulerConfig
from services.scheduler.dispatch import dispatcher as dispatcher_module
from services.scheduler.dispatch.dispatcher import _HashChains
from services.shared.block_hash import hash_block_chain
from tests.unit.scheduler.test_dispatcher import FakePort, mesh
from weft.v1 import common_pb2, scheduler_pb2

KEYS = b"m\x00t"


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []

    def counted(prompt, block_size, extra_keys=b"", parent=None, start=0):
        calls.append(len(prompt))
        return hash_block_chain(prompt, block_size, extra_keys, parent, start)

    monkeypatch.setattr(dispatcher_module, "hash_block_chain", counted)
    return calls


def test_equal_content_is_hashed_once_a_changed_prompt_anew(monkeypatch):
    calls = _counting(monkeypatch)
    chains = _HashChains()
    prompt = list(range(40))
    first = chains.get(prompt, 4, KEYS)
    assert chains.get(list(range(40)), 4, KEYS) is first  # an equal copy: the same chain
    assert calls == [40]
    prompt[3] = 999  # the same list object, changed: never the old chain
    assert chains.get(prompt, 4, KEYS) == hash_block_chain(prompt, 4, KEYS) != first
    assert chains.get(list(range(40)), 8, KEYS) == hash_block_chain(list(range(40)), 8, KEYS)  # block size
    assert chains.get(list(range(40)), 4, b"m\x00u") == hash_block_chain(list(range(40)), 4, b"m\x00u")  # tenant
    assert calls == [40, 40, 40, 40]


def test_the_memo_keeps_the_most_recently_used_chains_only(monkeypatch):
    calls = _counting(monkeypatch)
    chains = _HashChains(capacity=2)
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    chains.get(a, 4, KEYS)
    chains.get(b, 4, KEYS)
    chains.get(a, 4, KEYS)  # a is now the most recent
    chains.get(c, 4, KEYS)  # b goes
    assert len(chains._chains) == 2
    chains.get(a, 4, KEYS)
    assert len(calls) == 3
    chains.get(b, 4, KEYS)
    assert len(calls) == 4


def test_a_request_with_a_ttft_ceiling_hashes_its_prompt_once(monkeypatch):
    calls = _counting(monkeypatch)
    d = build_dispatcher(SchedulerConfig(), mesh("a"), ChannelPool(1 << 20), None)
    port = FakePort({"a": "ok"})
    d.relay.port = d.agent.port = port
    prompt = [(7 * i) % 1000 for i in range(64)]
    req = scheduler_pb2.ScheduleRequest(request_id="r1", prompt_token_ids=prompt, tenant="default",
                                        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0))
    req.session.contract.ttft_ceiling_ms = 2000

    async def main():
        d.screen(req.request_id, req.prompt_token_ids)
        job = convert.job_from_pb(req, lambda: 30.0, None)
        return [c async for c in d.generate(job, lambda spans: None)]

    chunks = asyncio.run(asyncio.wait_for(main(), 20))
    assert chunks[-1].finished and [a for a, _ in port.calls] == ["a"]
    assert calls == [64]  # the contract's estimate and the placement shared one chain

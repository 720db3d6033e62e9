"""The intent check on the request path: awaited before the hop is planned, on the
cachestore's embeddings (a fake Embed over real gRPC, and the real MiniLM servicer),
with the bigram fallback on timeout or an unreachable cachestore (counted); a shift
sends the session's stale KV down to the archive tier and nothing promotes it back.
Executors are a fake ExecutorPort (no processes)."""
from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest

from services.scheduler.agent_plane import AgentPlane, HopRequest
from services.scheduler.api.cachestore_port import CachestorePort, intent_detector
from services.scheduler.dispatch.agent_steps import AgentSteps
from services.scheduler.dispatch.dispatcher import INTENT_FALLBACKS, Dispatcher
from services.scheduler.dispatch.job import Chunk, Job
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.contracts import ContractBook
from services.scheduler.policy.intent_shift import make_intent_detector
from services.scheduler.policy.pause import make_pause_policy
from services.scheduler.policy.placement import InflightTracker, Placement, Placer
from services.scheduler.policy.priority import make_prioritizer
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import ExecutorRecord, ExecutorState, Membership
from services.scheduler.state.sessions import executor_session_id
from services.shared.block_hash import extra_keys_for, hash_block_chain
from weft.v1 import cachestore_pb2, cachestore_pb2_grpc

BLOCK_SIZE = 4
TOPIC_A = list(range(1, 33))  # 8 full blocks
TOPIC_B = list(range(500, 532))


def detok(ids):
    return " ".join(("apple" if i < 100 else "zebra") for i in ids)


async def embed_by_topic(texts):
    """'apple' text and 'zebra' text are orthogonal: a shift; same topic: distance 0."""
    return [[1.0, 0.0] if t.startswith("apple") else [0.0, 1.0] for t in texts]


def stale_hashes(tokens):
    return hash_block_chain(list(tokens), BLOCK_SIZE, extra_keys_for("m", "t", "auto"))


class ByName(Placer):
    def rank(self, candidates):
        return [Placement(c.name, c.address, c.num_matched_blocks, 0.0) for c in sorted(candidates, key=lambda c: c.name)]


class OneToken:
    def __init__(self, executor):
        self.executor = executor

    def cancel(self):
        pass

    async def __aiter__(self):
        yield Chunk((7,), True, self.executor, num_prompt_tokens=1, num_output_tokens=1)


class Executors:
    """A fake ExecutorPort that records the session calls."""

    def __init__(self):
        self.released, self.demoted, self.promoted = [], [], []
        self.demote_seen = asyncio.Event()

    def generate(self, address, call, timeout_s, traceparent):
        return OneToken(address)

    async def update_priorities(self, address, request_ids, priorities):
        pass

    async def release_session(self, address, session_id, evict_block_hashes):
        self.released.append((session_id, list(evict_block_hashes)))

    async def demote_blocks(self, address, token_ids, tenant, priority, expected_pause_ms):
        self.demoted.append(list(token_ids))
        self.demote_seen.set()

    async def promote_blocks(self, address, token_ids, tenant):
        self.promoted.append(list(token_ids))


class Archive:
    def __init__(self):
        self.calls = []
        self.seen = asyncio.Event()

    async def archive_blocks(self, block_hashes):
        self.calls.append(list(block_hashes))
        self.seen.set()
        return len(block_hashes)


def dispatcher(detector, pause="demote", kv_archive=None, timeout_s=0.25):
    membership = Membership()
    membership.heartbeat(ExecutorRecord(name="a", address="a", model_id="m", block_size=BLOCK_SIZE,
                                        state=ExecutorState.SERVING, num_blocks=100))
    view = SimpleNamespace(membership=membership, kv_index=KvIndex())
    port, admission, inflight = Executors(), Admission(4, 4), InflightTracker()
    plane = AgentPlane(make_prioritizer("weft"), make_pause_policy(pause), ContractBook(), detector,
                       kv_archive=kv_archive, intent_timeout_s=timeout_s)
    steps = AgentSteps(plane, membership, port, admission, inflight)
    return Dispatcher(view, ByName(), admission, port, agent=steps, inflight=inflight), port


async def hop(d, i, prompt):
    rid = f"r{i}"
    job = Job(rid, list(prompt), "m", "t", max_tokens=1,
              hop=HopRequest(rid, "t", list(prompt), session_id="s", hop_index=i, expected_tool_ms=0))
    d.screen(rid, job.prompt_token_ids)
    return job, [c async for c in d.generate(job, lambda spans: None)]


async def wait_for(event, timeout_s=5.0):
    await asyncio.wait_for(event.wait(), timeout_s)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_demoted_sessions_new_topic_archives_its_stale_blocks_and_promotes_none_of_them():
    """Old code never judged a demoted session (only pinned ones) and promoted its blocks
    back at resume: the released KV came back from the cachestore."""
    async def main():
        archive = Archive()
        d, port = dispatcher(make_intent_detector(detokenize=detok, embed_async=embed_by_topic), kv_archive=archive)
        await hop(d, 0, TOPIC_A)
        await wait_for(port.demote_seen)  # the pause demoted hop 0's context
        job, _ = await hop(d, 1, TOPIC_B)
        await wait_for(archive.seen)
        return port, archive, job
    port, archive, job = run(main())
    context = TOPIC_A + [7]
    assert job.hop.judged_intent.decision.shifted and job.hop.judged_intent.decision.signal == "embedding"
    assert port.promoted == []  # nothing brings the released blocks back
    assert archive.calls == [stale_hashes(context)]  # down to the archive tier
    assert port.released == [(executor_session_id("t", "s"), stale_hashes(context))]


def test_a_demoted_session_that_stays_on_topic_is_promoted_as_before():
    async def main():
        archive = Archive()
        d, port = dispatcher(make_intent_detector(detokenize=detok, embed_async=embed_by_topic), kv_archive=archive)
        await hop(d, 0, TOPIC_A)
        await wait_for(port.demote_seen)
        job, _ = await hop(d, 1, TOPIC_A + [7] + list(range(40, 56)))
        return port, archive, job
    port, archive, job = run(main())
    assert job.hop.judged_intent is None  # the turn extends the whole context: nothing to judge
    assert len(port.promoted) == 1 and archive.calls == [] and port.released == []


def test_a_turn_that_resends_the_whole_context_is_not_judged_and_is_promoted():
    """The prompt reuses every old block (whole-context clients): nothing could be stale,
    so the hop neither waits for an embedding nor loses its pin, and it needs the demoted
    blocks, so they are promoted as before (a topic change in the turn itself included)."""
    async def main():
        archive = Archive()
        d, port = dispatcher(make_intent_detector(detokenize=detok, embed_async=embed_by_topic), kv_archive=archive)
        await hop(d, 0, TOPIC_A)
        await wait_for(port.demote_seen)
        job, _ = await hop(d, 1, TOPIC_A + [7] + TOPIC_B)
        return port, archive, job
    port, archive, job = run(main())
    assert job.hop.judged_intent is None
    assert port.promoted == [TOPIC_A + [7] + TOPIC_B] and archive.calls == [] and port.released == []


def test_hop_zero_and_dropped_context_are_never_judged():
    async def main():
        calls = []

        async def counting(texts):
            calls.append(texts)
            return await embed_by_topic(texts)
        d, _ = dispatcher(make_intent_detector(detokenize=detok, embed_async=counting), pause="drop")
        first, _ = await hop(d, 0, TOPIC_A)
        second, _ = await hop(d, 1, TOPIC_B)  # hop 0's KV was dropped: nothing to release
        return calls, first, second
    calls, first, second = run(main())
    assert calls == [] and first.hop.judged_intent is None and second.hop.judged_intent is None


def test_a_late_embedding_falls_back_to_bigrams_and_is_counted():
    async def main():
        never = asyncio.Event()

        async def hangs(texts):
            await never.wait()
        d, port = dispatcher(make_intent_detector(detokenize=detok, embed_async=hangs), pause="keep", timeout_s=0.05)
        await hop(d, 0, TOPIC_A)
        job, chunks = await hop(d, 1, TOPIC_B)
        return job, chunks
    before = INTENT_FALLBACKS.labels("timeout")._value.get()
    job, chunks = run(main())
    decision = job.hop.judged_intent.decision
    assert (decision.signal, decision.fallback_reason, decision.shifted) == ("bigram", "timeout", True)
    assert chunks[-1].finished  # the hop itself went on
    assert INTENT_FALLBACKS.labels("timeout")._value.get() == before + 1


# -- over real gRPC ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_cachestore_falls_back_to_bigrams():
    async def main():
        cachestore = CachestorePort(f"127.0.0.1:{free_port()}", embed_timeout_s=1.0)
        try:
            d, _ = dispatcher(make_intent_detector(detokenize=detok, embed_async=cachestore.embed), pause="keep",
                              timeout_s=2.0)
            await hop(d, 0, TOPIC_A)
            job, _ = await hop(d, 1, TOPIC_B)
            return job.hop.judged_intent.decision
        finally:
            await cachestore.close()
    decision = run(main())
    assert (decision.signal, decision.fallback_reason) == ("bigram", "unavailable")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from weft.testing.tiny_model import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny", preset="tiny"))


class KeywordEmbed(cachestore_pb2_grpc.CacheStoreServicer):
    """A CacheStore servicer whose Embed maps text to a topic by keyword; it records the
    texts it was asked about and archives nothing."""

    def __init__(self):
        self.texts = []

    async def Embed(self, request, context):
        self.texts.extend(request.texts)
        return cachestore_pb2.EmbedResponse(embeddings=[
            cachestore_pb2.Embedding(values=[1.0, 0.0] if "cat" in t else [0.0, 1.0]) for t in request.texts], dim=2)

    async def ArchiveBlocks(self, request, context):
        return cachestore_pb2.ArchiveBlocksResponse(num_archived_blocks=len(request.block_hashes))


async def serve(servicer):
    from services.mesh.grpc_server import GrpcServer

    server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, grace_s=0.1)
    cachestore_pb2_grpc.add_CacheStoreServicer_to_server(servicer, server.server)
    return server, await server.start()


def test_the_scheduler_embeds_detokenised_text_over_grpc(tokenizer_dir):
    from services.shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    cats = tok.encode("my cat sleeps all day on the warm sofa by the window") * 2
    taxes = tok.encode("how do I file my income taxes as a freelancer this year") * 2

    async def main():
        servicer = KeywordEmbed()
        server, port = await serve(servicer)
        cachestore = CachestorePort(f"127.0.0.1:{port}")
        try:
            d, _ = dispatcher(intent_detector(cachestore, tokenizer_dir, 0.9), pause="keep", kv_archive=cachestore)
            await hop(d, 0, cats)
            job, _ = await hop(d, 1, taxes)
            return servicer.texts, job.hop.judged_intent.decision
        finally:
            await cachestore.close()
            await server.server.stop(0)
    texts, decision = run(main())
    assert "cat" in texts[0] and "taxes" in texts[1]  # the context's tail and the turn's head, as text
    assert decision.shifted and decision.signal == "embedding" and decision.fallback_reason == ""


def test_without_a_cachestore_or_model_dir_the_signal_is_bigrams(tokenizer_dir):
    assert intent_detector(None, tokenizer_dir, 0.9).metric.name == "bigram"
    with pytest.raises(ValueError):
        CachestorePort("")


def test_real_minilm_over_grpc_archives_a_shifted_sessions_blocks(tmp_path, tokenizer_dir):
    """The real cachestore servicer (MiniLM embeddings, host RAM over disk): a labelled
    topic change moves the blocks the session's executor wrote back down to disk."""
    from services.cachestore.blocks import Block, BlockMeta, checksum
    from services.cachestore.disk_tier import DiskTier
    from services.cachestore.embedder import MiniLmEmbedder
    from services.cachestore.host_tier import HostTier
    from services.cachestore.semantic_service import SemanticService
    from services.cachestore.server import CacheStoreServicer
    from services.cachestore.tiers import Tier, TieredStore, TierPolicyName, make_tier_policy
    from services.shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    context = tok.encode("How do I reverse a linked list in Python without using recursion?")
    turn = tok.encode("What's a good recipe for banana bread that doesn't use eggs?")
    store = TieredStore(HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, fsync=False),
                        make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT))
    written_back = stale_hashes(context + [7])
    for h in written_back:  # what the executor's demote-on-finish wrote after hop 0
        store.put(Block(BlockMeta(h, "uint8", (8,), 8, checksum(bytes(8)), "m", BLOCK_SIZE), bytes(8)))

    async def main():
        server, port = await serve(CacheStoreServicer(store, 1 << 20, 1 << 16,
                                                      SemanticService(MiniLmEmbedder(num_threads=1))))
        cachestore = CachestorePort(f"127.0.0.1:{port}", embed_timeout_s=60.0)
        try:
            d, _ = dispatcher(intent_detector(cachestore, tokenizer_dir, 0.9), pause="keep", kv_archive=cachestore,
                              timeout_s=60.0)  # the model loads on the first Embed here
            await hop(d, 0, context)
            job, _ = await hop(d, 1, turn)
            deadline = asyncio.get_running_loop().time() + 10
            while store.tier_of(written_back[0]) is not Tier.ARCHIVED and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)  # the archive runs in the background
            return job.hop.judged_intent.decision
        finally:
            await cachestore.close()
            await server.server.stop(0)
    decision = run(main())
    assert decision.signal == "embedding" and decision.shifted
    assert all(store.tier_of(h) is Tier.ARCHIVED for h in written_back) and len(store.host) == 0


def test_decide_async_without_a_fallback_keeps_the_kv_and_says_why():
    from services.scheduler.policy.intent_shift import EmbeddingDistance, IntentShiftDetector

    async def down(texts):
        raise ConnectionError("refused")
    detector = IntentShiftDetector(EmbeddingDistance(None, detok, embed_async=down), 0.8)
    decision = run(detector.decide_async(TOPIC_A, TOPIC_B, 1.0))
    assert (decision.shifted, decision.signal, decision.fallback_reason) == (False, "none", "unavailable")
    assert detector.decide(TOPIC_A, TOPIC_B).fallback_reason == "unavailable"  # no sync embedder: no signal

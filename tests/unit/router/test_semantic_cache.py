"""The router's semantic response cache in front of the scheduler (a fake cachestore
client and a fake scheduler: the similarity itself is tested with the real model in
test_cachestore_semantic.py)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

from services.router.schema import Sampling, TokenChunk, TokenRequest
from services.router.semantic_cache import SemanticCachingStreamer, is_cacheable
from services.router.validation import parse_sampling


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class FakeStore:
    def __init__(self, fail=False):
        self.entries, self.fail, self.lookups = {}, fail, 0
        self.sessions, self.prefetched = {}, []

    async def lookup_response(self, tenant, scope, text):
        self.lookups += 1
        if self.fail:
            raise ConnectionError("cachestore down")
        return self.entries.get((tenant, scope, text))

    async def store_response(self, tenant, scope, text, token_ids):
        self.entries[(tenant, scope, text)] = tuple(token_ids)

    async def lookup_session(self, tenant, scope, text):
        self.lookups += 1
        return self.sessions.get((tenant, text))

    async def store_session(self, tenant, scope, text, token_ids):
        self.sessions[(tenant, text)] = tuple(token_ids)

    async def prefetch(self, tenant, token_ids):
        self.prefetched.append((tenant, tuple(token_ids)))
        return len(token_ids) // 16


class FakeScheduler:
    def __init__(self):
        self.calls = 0

    async def generate(self, request, timeout_s):
        self.calls += 1
        yield TokenChunk((5, 6), (), None, 3, 0, 2, "ex-0")
        yield TokenChunk((7,), (), "length", 3, 0, 3, "ex-0")


def request(tenant="acme", **sampling):
    s = Sampling(max_tokens=3, temperature=0.0, semantic_cache=True)
    return TokenRequest("r", "", (1, 2, 3), replace(s, **sampling), tenant)


async def collect(streamer, req):
    out = [c async for c in streamer.generate(req, 10)]
    await asyncio.gather(*streamer._background)
    return out


def test_an_opted_in_greedy_request_is_answered_from_the_cache_the_second_time():
    async def go():
        store, sched = FakeStore(), FakeScheduler()
        streamer = SemanticCachingStreamer(sched, store, FakeTokenizer())
        first = await collect(streamer, request())
        second = await collect(streamer, request())
        assert [t for c in first for t in c.token_ids] == [5, 6, 7] and sched.calls == 1
        assert second == [TokenChunk((5, 6, 7), (), "length", 3, 3, 3, "cachestore")]
        other_tenant = await collect(streamer, request(tenant="globex"))
        other_params = await collect(streamer, request(max_tokens=4))
        assert other_tenant[-1].executor == other_params[-1].executor == "ex-0" and sched.calls == 3
    asyncio.run(go())


def test_sampled_or_not_opted_in_requests_bypass_the_cache():
    async def go():
        store, sched = FakeStore(), FakeScheduler()
        streamer = SemanticCachingStreamer(sched, store, FakeTokenizer())
        for req in (request(temperature=0.7), request(semantic_cache=False), request(logprobs=True)):
            assert not is_cacheable(req)
            await collect(streamer, req)
        assert store.lookups == 0 and store.entries == {} and sched.calls == 3
    asyncio.run(go())


def test_a_cachestore_failure_is_a_miss_not_an_error():
    async def go():
        sched = FakeScheduler()
        out = await collect(SemanticCachingStreamer(sched, FakeStore(fail=True), FakeTokenizer()), request())
        assert out[-1].finish_reason == "length" and sched.calls == 1
    asyncio.run(go())


def test_http_extension_field_opts_in():
    from services.router.validation import Limits

    limits = Limits(served_models=("m",), max_model_len=128, vocab_size=1000)
    assert parse_sampling({"weft_semantic_cache": True}, limits, 4, "max_tokens", None).semantic_cache
    assert not parse_sampling({}, limits, 4, "max_tokens", None).semantic_cache


def test_a_new_sessions_first_turn_prefetches_the_prefix_it_shares_with_a_similar_known_session():
    from services.router.schema import Session

    async def go():
        store, sched = FakeStore(), FakeScheduler()
        streamer = SemanticCachingStreamer(sched, store, FakeTokenizer())
        shared = tuple(range(100, 140))
        known = TokenRequest("k", "", shared + (1, 2), Sampling(max_tokens=3, temperature=0.8, semantic_cache=True),
                             "acme", Session(session_id="old", hop_index=0))
        await collect(streamer, known)  # remembered as a first turn (sampled: no response caching)
        assert store.sessions == {("acme", FakeTokenizer().decode(known.prompt_token_ids)): known.prompt_token_ids}
        store.sessions[("acme", "similar")] = known.prompt_token_ids
        streamer.splitter.tokenizer = type("T", (), {"decode": lambda self, ids, skip_special_tokens=True: "similar"})()
        new = replace(known, request_id="n", prompt_token_ids=shared + (9, 9, 9), session=Session("new", hop_index=0))
        await collect(streamer, new)
        assert store.prefetched == [("acme", shared)]
        later_hop = replace(new, session=Session("new", hop_index=1))
        await collect(streamer, later_hop)
        assert len(store.prefetched) == 1  # only first turns prefetch
    asyncio.run(go())


def test_only_the_last_user_message_is_embedded_and_the_rest_must_match_exactly(tmp_path):
    from services.router.semantic_cache import PromptSplitter
    from services.shared.tokenizer import Tokenizer
    from weft.testing.tiny_model import make_tiny_checkpoint

    tok = Tokenizer.from_dir(make_tiny_checkpoint(tmp_path / "m", preset="tiny"))
    splitter = PromptSplitter(tok)

    def split(system, question):
        text = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                       tools=None, add_generation_prompt=True)
        return splitter.split(tok.encode(text, add_special_tokens=False))

    ctx_a, text_a = split("You are an agent with tools.", "How do I reset my password?")
    ctx_b, _ = split("You are an agent with tools.", "Something else entirely")
    ctx_c, _ = split("You are a different agent.", "How do I reset my password?")
    assert text_a.startswith("How do I reset my password?") and "agent" not in text_a
    assert ctx_a == ctx_b != ctx_c

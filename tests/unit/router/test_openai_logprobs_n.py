"""Issue 15 at the OpenAI HTTP door, against an in-process fake downstream: logprobs on
chat and completions, echo and prompt scoring, n completions (fan-out, indexes, the
shared prompt)."""
from __future__ import annotations

import asyncio

import pytest

from tests.unit.router.agent_io_fakes import CHAT, COMPLETION, REPLY, client_for, one
from tests.unit.router.test_http import model_dir  # noqa: F401  (fixture)


# -- logprobs --------------------------------------------------------------------------
def test_chat_logprobs_carry_token_logprob_bytes_and_alternatives(model_dir):  # noqa: F811
    status, body, fake, tok = one(model_dir, CHAT, {"logprobs": True, "top_logprobs": 2})
    assert status == 200, body
    assert (fake.requests[0].sampling.logprobs, fake.requests[0].sampling.top_logprobs) == (True, 2)
    content = body["choices"][0]["logprobs"]["content"]
    ids = tok.encode(REPLY, add_special_tokens=False)
    assert [c["token"] for c in content] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(c["token"] for c in content) == REPLY
    for c in content:
        assert c["logprob"] == -0.5 and c["bytes"] == list(c["token"].encode())
        assert [a["logprob"] for a in c["top_logprobs"]] == [-0.5, -1.5]
        assert c["top_logprobs"][0]["token"] == c["token"]
        assert c["top_logprobs"][1] == {"token": tok.decode([3], skip_special_tokens=False), "logprob": -1.5,
                                        "bytes": list(tok.decode([3], skip_special_tokens=False).encode())}


def test_chat_logprobs_stream_per_chunk_and_add_up_to_the_reply(model_dir):  # noqa: F811
    status, chunks, _, tok = one(model_dir, CHAT, {"logprobs": True, "top_logprobs": 1, "stream": True})
    assert status == 200
    entries = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert len(entries) == len(tok.encode(REPLY, add_special_tokens=False))
    assert "".join(e["token"] for e in entries) == REPLY and all(len(e["top_logprobs"]) == 1 for e in entries)


def test_no_logprobs_asked_means_logprobs_null(model_dir):  # noqa: F811
    status, body, fake, _ = one(model_dir, CHAT, {})
    assert body["choices"][0]["logprobs"] is None and not fake.requests[0].sampling.logprobs


@pytest.mark.parametrize("endpoint, extra, field", [
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"), (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"logprobs": 1}, "logprobs"), (COMPLETION, {"logprobs": 21}, "logprobs"),
    (COMPLETION, {"logprobs": True}, "logprobs"), (COMPLETION, {"logprobs": -1}, "logprobs"),
])
def test_bad_logprobs_are_400_naming_the_field(model_dir, endpoint, extra, field):  # noqa: F811
    status, body, fake, _ = one(model_dir, endpoint, extra)
    assert status == 400 and body["error"]["param"] == field, body
    assert fake.requests == []


def test_completions_logprobs_have_tokens_offsets_and_top_dicts(model_dir):  # noqa: F811
    status, body, fake, tok = one(model_dir, COMPLETION, {"logprobs": 1})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == body["choices"][0]["text"] == REPLY
    assert lp["token_logprobs"] == [-0.5] * len(lp["tokens"])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert all(d == {t: -0.5} for d, t in zip(lp["top_logprobs"], lp["tokens"]))
    assert fake.requests[0].sampling.prompt_logprobs is None  # no echo: the prompt is not scored


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_returns_the_prompt_then_the_completion_prompt_first_logprob_null(model_dir, stream):  # noqa: F811
    status, body, fake, tok = one(model_dir, COMPLETION, {"echo": True, "logprobs": 1, "stream": stream})
    assert status == 200, body
    sent = fake.requests[0]
    assert sent.sampling.prompt_logprobs == 1
    choices = [c["choices"][0] for c in body] if stream else body["choices"]
    text = "".join(c["text"] for c in choices)
    assert text == "Say:" + REPLY
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    logprobs = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    prompt_len = len(sent.prompt_token_ids)
    assert tokens[:prompt_len] == [tok.decode([i], skip_special_tokens=False) for i in sent.prompt_token_ids]
    assert logprobs[0] is None and logprobs[1:prompt_len] == [-1.0] * (prompt_len - 1)
    assert logprobs[prompt_len:] == [-0.5] * len(tok.encode(REPLY, add_special_tokens=False))


def test_echo_with_max_tokens_0_scores_the_prompt_only(model_dir):  # noqa: F811
    """The log-likelihood eval pattern: one token is generated (the executor cannot do
    none) and dropped; the response is the prompt, its logprobs, and zero completion tokens."""
    status, body, fake, tok = one(model_dir, COMPLETION, {"echo": True, "logprobs": 0, "max_tokens": 0})
    assert status == 200, body
    assert fake.requests[0].sampling.max_tokens == 1
    choice = body["choices"][0]
    assert choice["text"] == "Say:" and choice["finish_reason"] == "length"
    prompt_len = len(fake.requests[0].prompt_token_ids)
    assert choice["logprobs"]["token_logprobs"] == [None] + [-1.0] * (prompt_len - 1)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == prompt_len


def test_max_tokens_0_without_echo_is_still_400(model_dir):  # noqa: F811
    status, body, fake, _ = one(model_dir, COMPLETION, {"max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"



# -- n completions ---------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_n_completions_fan_out_after_the_first_token_and_reuse_its_cached_prompt(model_dir, endpoint):  # noqa: F811
    status, body, fake, tok = one(model_dir, endpoint, {"n": 3, "seed": 7})
    assert status == 200, body
    first = fake.requests[0].request_id
    assert fake.events[:2] == [("start", first), ("token", first)]  # the first ran alone until its token
    assert sorted(r.sampling.seed for r in fake.requests) == [7, 8, 9] and all(r.sampling.n == 1 for r in fake.requests)
    assert len({r.request_id for r in fake.requests}) == 3
    assert [fake.cached[r.request_id] > 0 for r in fake.requests] == [False, True, True]  # prefix cache hits
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    num_out = len(tok.encode(REPLY, add_special_tokens=False))
    prompt_len = len(fake.requests[0].prompt_token_ids)
    assert body["usage"]["prompt_tokens"] == prompt_len  # the prompt once
    assert body["usage"]["completion_tokens"] == 3 * num_out


def test_n_streamed_chunks_carry_their_index_and_each_choice_finishes(model_dir):  # noqa: F811
    status, chunks, _, _ = one(model_dir, CHAT, {"n": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in mine) == REPLY
        assert mine[-1]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] > 0


def test_n_completions_of_several_prompts_are_indexed_prompt_major(model_dir):  # noqa: F811
    status, body, fake, _ = one(model_dir, COMPLETION, {"prompt": ["a", "b b"], "n": 2, "echo": True})
    assert status == 200, body
    assert [(c["index"], c["text"][:3]) for c in body["choices"]] == [(0, "aHe"), (1, "aHe"), (2, "b b"), (3, "b b")]


def test_a_client_gone_mid_stream_cancels_every_completion(model_dir):  # noqa: F811
    async def go():
        client, fake, _ = await client_for(model_dir)
        fake.gate = asyncio.Event()  # every completion stops after its first token
        try:
            path, base = CHAT
            resp = await client.post(path, json={**base, "n": 3, "stream": True})
            while len([e for e in fake.events if e[0] == "token"]) < 3:
                await resp.content.readline()
            resp.close()
            await asyncio.wait_for(fake.all_cancelled.wait(), 30)  # a hang fails, never blocks the suite
            assert len(fake.requests) == 3
            assert sorted(fake.cancelled) == sorted(r.request_id for r in fake.requests)
        finally:
            await client.close()
    asyncio.run(go())


@pytest.mark.parametrize("extra, field", [({"n": 10**6}, "n"), ({"n": 0}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
                                          ({"n": 2.5}, "n")])
def test_bad_n_is_400_naming_the_field(model_dir, extra, field):  # noqa: F811
    status, body, fake, _ = one(model_dir, CHAT, extra)
    assert status == 400 and body["error"]["param"] == field, body
    assert fake.requests == []


def test_best_of_equal_to_n_is_served(model_dir):  # noqa: F811
    status, body, fake, _ = one(model_dir, COMPLETION, {"n": 2, "best_of": 2})
    assert status == 200 and len(body["choices"]) == 2




@pytest.mark.parametrize("stream", [False, True])
def test_n_completions_score_the_prompt_once_and_every_choice_echoes_its_logprobs(model_dir, stream):  # noqa: F811
    """Prompt logprobs bar the prefix cache, so n completions that each asked for them
    would each prefill the whole prompt: only the first asks, the others reuse its KV and
    are handed its prompt logprobs."""
    prompt = "word " * 12
    status, body, fake, _ = one(model_dir, COMPLETION, {"prompt": prompt, "echo": True, "logprobs": 0, "n": 3,
                                                          "stream": stream})
    assert status == 200, body
    assert [r.sampling.prompt_logprobs for r in fake.requests] == [0, None, None]
    assert [fake.cached[r.request_id] > 0 for r in fake.requests] == [False, True, True]
    prompt_len = len(fake.requests[0].prompt_token_ids)
    by_index: dict[int, list] = {}
    for choice in ([c["choices"][0] for c in body] if stream else body["choices"]):
        if choice["logprobs"]:
            by_index.setdefault(choice["index"], []).extend(choice["logprobs"]["token_logprobs"])
    assert sorted(by_index) == [0, 1, 2]
    for lps in by_index.values():
        assert lps[:prompt_len] == [None] + [-1.0] * (prompt_len - 1)

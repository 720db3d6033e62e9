"""Logprobs through the engine on the tiny random checkpoint, against a full-sequence
transformers forward of the same checkpoint: output logprobs and top_logprobs (the raw
distribution), prompt logprobs across prefill chunks, the prefix cache bypassed while
they are owed, preemption not recording them twice, and the penalties wired to each
row's own tokens."""
from __future__ import annotations

import random

import pytest
import torch

import services.executor.engine.model_runner as model_runner
from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from weft.testing.tiny_model import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")

MAX_STEPS = 400
ATOL = 1e-4  # fp32 through two implementations of the same model
CHUNK = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _prompt(n: int, seed: int, vocab: int = 1024) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def _engine(path, **options) -> LLMEngine:
    options.setdefault("num_kv_blocks", 64)
    options.setdefault("max_prefill_chunk", CHUNK)
    options.setdefault("max_num_batched_tokens", 4 * CHUNK)
    return LLMEngine(path, EngineConfig(**options))


def _run(engine: LLMEngine) -> dict[str, dict]:
    """Step until idle; per request: tokens, logprobs, top_logprobs, prompt logprobs."""
    got: dict[str, dict] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests:
            return got
        for out in engine.step():
            r = got.setdefault(out.request_id, {"tokens": [], "logprobs": [], "top": [], "prompt": None,
                                                "prompt_top": None, "cached": 0})
            r["tokens"] += out.new_token_ids
            r["logprobs"] += out.new_logprobs
            r["top"] += out.new_top_logprobs
            r["cached"] = out.num_cached_tokens
            if out.prompt_logprobs or out.prompt_top_logprobs:
                assert r["prompt"] is None, "prompt logprobs sent twice"
                r["prompt"], r["prompt_top"] = list(out.prompt_logprobs), list(out.prompt_top_logprobs)
    raise AssertionError(f"engine still busy after {MAX_STEPS} steps")


def _raw_logprobs(hf, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def _assert_prompt_logprobs(hf, prompt: list[int], got: list[float], got_top: list, k: int) -> None:
    ref = _raw_logprobs(hf, prompt)
    assert len(got) == len(prompt) - 1
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor(got), expected, atol=ATOL)
    if not k:
        assert got_top == []
        return
    assert len(got_top) == len(prompt) - 1
    values, ids = ref[:-1].topk(k, dim=-1)
    for j, alts in enumerate(got_top):
        assert [t for t, _ in alts] == ids[j].tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in alts]), values[j], atol=ATOL)


def test_output_logprobs_and_top_logprobs_are_the_full_forward_log_softmax(checkpoint):
    path, hf = checkpoint
    engine = _engine(path)
    prompt = _prompt(20, seed=1)
    params = {"greedy": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=4),
              "sampled": SamplingParams(max_tokens=6, temperature=1.2, top_k=20, seed=3, ignore_eos=True,
                                        logprobs=True, top_logprobs=2, presence_penalty=1.0)}
    for rid, p in params.items():
        engine.add_request(rid, prompt, p)
    got = _run(engine)
    for rid, p in params.items():
        r = got[rid]
        ref = _raw_logprobs(hf, prompt + r["tokens"])[len(prompt) - 1: -1]  # the position before each token
        assert torch.allclose(torch.tensor(r["logprobs"]), ref[torch.arange(6), torch.tensor(r["tokens"])], atol=ATOL)
        values, ids = ref.topk(p.top_logprobs, dim=-1)
        assert [[t for t, _ in alts] for alts in r["top"]] == ids.tolist()
        assert torch.allclose(torch.tensor([[lp for _, lp in alts] for alts in r["top"]]), values, atol=ATOL)
    assert got["greedy"]["tokens"] == [alts[0][0] for alts in got["greedy"]["top"]]


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_across_prefill_chunks_match_a_full_forward(checkpoint, k, monkeypatch):
    path, hf = checkpoint
    # logits are made a few positions at a time within a chunk too (bounded memory)
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 7)
    engine = _engine(path)
    prompts = {"long": _prompt(3 * CHUNK + 5, seed=2), "short": _prompt(2, seed=3), "one": _prompt(1, seed=4)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                       prompt_logprobs=k))
    engine.add_request("plain", prompts["long"], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    got = _run(engine)
    for rid in ("long", "short"):
        _assert_prompt_logprobs(hf, prompts[rid], got[rid]["prompt"], got[rid]["prompt_top"], k)
    assert got["one"]["prompt"] is None  # a one-token prompt has no prompt logprobs
    assert got["plain"]["prompt"] is None
    assert got["plain"]["tokens"] == got["long"]["tokens"]


def test_a_request_owed_prompt_logprobs_skips_the_prefix_cache(checkpoint):
    path, hf = checkpoint
    engine = _engine(path)
    prompt = _prompt(70, seed=5)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("warm", prompt, greedy)
    _run(engine)
    engine.add_request("wants", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                       prompt_logprobs=1))
    got = _run(engine)["wants"]
    assert got["cached"] == 0
    _assert_prompt_logprobs(hf, prompt, got["prompt"], got["prompt_top"], 1)
    engine.add_request("again", prompt, greedy)
    assert _run(engine)["again"]["cached"] == 64  # the cache itself still serves others


def test_preempted_and_recomputed_sequences_record_prompt_logprobs_once(checkpoint):
    path, hf = checkpoint
    prompts = [_prompt(40 + 9 * i, seed=10 + i) for i in range(6)]
    # room for about two of them at a time: preemption must happen
    engine = _engine(path, num_kv_blocks=10)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                           prompt_logprobs=2))
    got = _run(engine)
    assert engine.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        _assert_prompt_logprobs(hf, prompt, got[f"r{i}"]["prompt"], got[f"r{i}"]["prompt_top"], 2)


def _reference_penalised_greedy(hf, prompt: list[int], n: int, penalty: float, freq: float) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        seen = torch.tensor(sorted(set(prompt + out)))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
        for t in out:
            logits[t] -= freq
        out.append(int(logits.argmax()))
    return out


def test_penalties_read_each_rows_own_prompt_and_output(checkpoint):
    path, hf = checkpoint
    engine = _engine(path)
    prompts = [_prompt(12, seed=20), _prompt(30, seed=21)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                           repetition_penalty=1.8, frequency_penalty=0.6))
    engine.add_request("plain", prompts[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    got = _run(engine)
    for i, prompt in enumerate(prompts):
        assert got[f"p{i}"]["tokens"] == _reference_penalised_greedy(hf, prompt, 10, 1.8, 0.6)
    assert got["plain"]["tokens"] != got["p0"]["tokens"]

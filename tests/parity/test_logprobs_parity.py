"""SmolLM2-135M-Instruct logprobs equal transformers' in float32: every prompt token's
logprob and its top-5 alternatives (across several prefill chunks), and each greedy output
token's logprob and top-5 alternatives, against AutoModelForCausalLM on the same
checkpoint directory. Logprobs are the raw model distribution's (log_softmax of the
unprocessed logits), so they are comparable with a plain forward.

The checkpoint comes from ``resolve_model`` (pulled into the model cache once); the tests
skip, saying why, only when it cannot be fetched.
"""
from __future__ import annotations

import pytest
import torch

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from weft.models.sources import ModelFetchError, resolve_model

transformers = pytest.importorskip("transformers")

MODEL = "smollm2-135m-instruct"
K = 5
NUM_NEW = 8
CHUNK = 32  # max_prefill_chunk: the long prompt spans several chunks
ATOL = 1e-3  # fp32, two implementations (attention order, fused ops) of the same weights
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Explain why the sky is blue, and then why sunsets are red. " * 5}],
]
MAX_STEPS = 200


@pytest.fixture(scope="module")
def checkpoint():
    try:
        return resolve_model(MODEL, progress=False)
    except ModelFetchError as exc:
        pytest.skip(f"{MODEL} cannot be fetched here: {exc}")


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:
    from services.shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(checkpoint)
    return [list(tok.encode(tok.apply_chat_template(c, add_generation_prompt=True))) for c in CHATS]


@pytest.fixture(scope="module")
def weft_outputs(checkpoint, prompts) -> dict[int, dict]:
    engine = LLMEngine(checkpoint, EngineConfig(max_prefill_chunk=CHUNK, max_num_batched_tokens=2 * CHUNK))
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=True,
                            top_logprobs=K, prompt_logprobs=K)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    got: dict[int, dict] = {i: {"tokens": [], "logprobs": [], "top": []} for i in range(len(prompts))}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests:
            return got
        for out in engine.step():
            r = got[int(out.request_id)]
            r["tokens"] += out.new_token_ids
            r["logprobs"] += out.new_logprobs
            r["top"] += out.new_top_logprobs
            if out.prompt_logprobs:
                r["prompt"], r["prompt_top"] = list(out.prompt_logprobs), list(out.prompt_top_logprobs)
    raise AssertionError(f"engine still busy after {MAX_STEPS} steps")


def _reference(hf, token_ids: list[int]) -> torch.Tensor:  # [len, vocab] logprobs
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def _assert_alternatives(got: list, ref: torch.Tensor) -> None:
    """Each position's top-K: the same ids (up to a swap of near-ties) and logprobs."""
    values, ids = ref.topk(K, dim=-1)
    for j, alts in enumerate(got):
        got_ids = [t for t, _ in alts]
        got_lps = torch.tensor([lp for _, lp in alts])
        assert torch.allclose(got_lps, values[j], atol=ATOL), j
        # an id may differ only where two alternatives tie within the tolerance
        for slot, (a, b) in enumerate(zip(got_ids, ids[j].tolist())):
            assert a == b or abs(ref[j, a].item() - ref[j, b].item()) <= ATOL, (j, slot)


def test_prompt_logprobs_and_top5_match_transformers(hf, prompts, weft_outputs):
    assert max(len(p) for p in prompts) > 2 * CHUNK  # one prompt spans several prefill chunks
    for i, prompt in enumerate(prompts):
        got, ref = weft_outputs[i], _reference(hf, prompt)
        n = len(prompt) - 1
        assert len(got["prompt"]) == len(got["prompt_top"]) == n
        expected = ref[torch.arange(n), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor(got["prompt"]), expected, atol=ATOL)
        _assert_alternatives(got["prompt_top"], ref[:n])


def test_greedy_output_logprobs_and_top5_match_transformers(hf, prompts, weft_outputs):
    for i, prompt in enumerate(prompts):
        got = weft_outputs[i]
        ref = _reference(hf, prompt + got["tokens"])[len(prompt) - 1: -1]  # the position before each token
        assert got["tokens"] == ref.argmax(-1).tolist()  # greedy by the reference's own logits
        expected = ref[torch.arange(NUM_NEW), torch.tensor(got["tokens"])]
        assert torch.allclose(torch.tensor(got["logprobs"]), expected, atol=ATOL)
        _assert_alternatives(got["top"], ref)

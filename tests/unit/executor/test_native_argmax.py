"""The native greedy argmax (model/native/argmax.c, ``NativeDecoder.argmax_rows``) answers
what ``logits.argmax(-1)`` answers, row by row: the first index among equal maxima, rows of
-inf, vocabularies off the 16-float vector width, +inf; it declines (None) what it cannot
answer the same way (a NaN, a tensor that is not contiguous fp32 [R, vocab]); and the
engine's greedy tokens are unchanged by it. Its entropy (``argmax_entropy_rows``, for agent
sessions' rows) is the sampler's, and an agent session's tokens and reported entropy are
the same on the native path as on the sampler's."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from services.executor.attention.selector import backend_class
from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import SessionOptions
from services.executor.model.sampler import sample
from services.executor.model.config import ModelConfig
from services.executor.model.llama import LlamaModel
from services.executor.model.native import library
from weft.testing.tiny_model import make_tiny_checkpoint, model_config_dict, random_weights

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")


@pytest.fixture(scope="module")
def decoder():
    config = ModelConfig.from_dict(model_config_dict("tiny", "llama"))
    model = LlamaModel(config, random_weights(config, seed=1), backend_class("torch"), native_decode=True)
    caches = [torch.zeros((2, 4, 4, model.num_kv_heads, model.head_dim)) for _ in range(model.num_layers)]
    return model.native_decoder(caches)


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 1000, 49152])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_argmax_rows_equals_torch_argmax(decoder, rows, vocab):
    logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(rows * vocab))
    assert decoder.argmax_rows(logits) == logits.argmax(-1).tolist()


def test_ties_infinities_and_the_last_column(decoder):
    logits = torch.randn((6, 35), generator=torch.Generator().manual_seed(0))
    logits[0, [3, 19, 20]] = 9.0  # a tie across vector lanes and chunks: the first index wins
    logits[1, [21, 5]] = 9.0  # the earlier index sits in a later lane of the first chunk
    logits[2] = -float("inf")  # nothing is larger than -inf: index 0
    logits[3, 34] = 50.0  # the last column, in the masked tail chunk
    logits[4, [7, 30]] = float("inf")
    logits[5, :] = 1.5  # every entry equal
    assert decoder.argmax_rows(logits) == logits.argmax(-1).tolist() == [3, 5, 0, 34, 7, 0]


def test_declines_what_it_cannot_answer_like_torch(decoder):
    nan = torch.randn((3, 40))
    nan[1, 11] = float("nan")  # torch's argmax picks the NaN
    assert decoder.argmax_rows(nan) is None
    assert decoder.argmax_rows(torch.randn((40, 3)).t()) is None  # not contiguous
    assert decoder.argmax_rows(torch.randn((3, 40), dtype=torch.float64)) is None
    assert decoder.argmax_rows(torch.randn(40)) is None  # not [R, vocab]


def test_engine_greedy_tokens_unchanged_by_the_native_argmax(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "tiny", "llama", seed=4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 9, 200 + i] * (1 + i % 3) for i in range(6)]

    def run(native: bool) -> tuple[dict[str, list[int]], int]:
        engine = LLMEngine(path, EngineConfig(block_size=4, native_decode=native))
        calls = []
        if native:
            argmax_rows = engine.runner.native.argmax_rows
            engine.runner.native.argmax_rows = lambda logits: calls.append(1) or argmax_rows(logits)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished_requests:
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        return out, len(calls)

    native, calls = run(True)
    reference, _ = run(False)
    assert calls > 0 and native == reference


@pytest.mark.parametrize("vocab", [1, 17, 1000, 49152])
def test_entropy_rows_equal_the_samplers(decoder, vocab):
    logits = 4 * torch.randn((5, vocab), generator=torch.Generator().manual_seed(vocab))
    if vocab > 1:
        logits[2, : vocab // 2] = -float("inf")  # masked entries add nothing
    logits[3] = 0.0  # uniform: ln(vocab)
    want = [True, False, True, True, True]
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    expected = sample(logits, [greedy] * 5, [None] * 5, want)
    tokens, entropies = decoder.argmax_entropy_rows(logits, want)
    assert tokens == expected.token_ids
    assert entropies[1] == 0.0
    assert entropies == pytest.approx(expected.entropies, rel=1e-4, abs=1e-5)
    exact = torch.special.entr(logits.double().softmax(-1)).sum(-1).tolist()  # 0 log 0 = 0
    assert [e for e, w in zip(entropies, want) if w] == pytest.approx([e for e, w in zip(exact, want) if w], rel=1e-4)
    assert decoder.argmax_entropy_rows(logits.double(), want) is None
    assert decoder.argmax_entropy_rows(logits, want[:2]) is None  # one flag per row


def test_agent_rows_take_the_native_path_with_the_samplers_tokens_and_entropy(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "tiny", "llama", seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(native: bool) -> tuple[dict, dict, int]:
        engine = LLMEngine(path, EngineConfig(block_size=4, native_decode=native))
        calls = []
        if native:
            fused = engine.runner.native.argmax_entropy_rows
            engine.runner.native.argmax_entropy_rows = lambda logits, want: calls.append(1) or fused(logits, want)
        for i in range(4):  # two agent sessions beside two plain requests, one batch
            session = SessionOptions(f"s{i}", track_entropy=True) if i % 2 else None
            engine.add_request(f"r{i}", [7 + i, 9, 300 + i] * 2, params, **({"session": session} if session else {}))
        out, entropy = {f"r{i}": [] for i in range(4)}, {}
        while engine.has_unfinished_requests:
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    entropy[o.request_id] = o.mean_entropy
        return out, entropy, len(calls)

    tokens, entropy, calls = run(True)
    ref_tokens, ref_entropy, _ = run(False)
    assert calls > 0 and tokens == ref_tokens
    assert entropy == pytest.approx(ref_entropy, rel=1e-4)
    assert entropy["r1"] > 0 and entropy["r0"] == 0.0

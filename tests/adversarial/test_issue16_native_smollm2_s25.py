"""Issue 16 on the real model: SmolLM2-135M-Instruct (fetched and imported as
tests/parity/test_gguf_smollm2.py does), prompts from 1 to ~300 tokens decoded together,
greedy: the batched output, decoded by the native multi-row step and sampled by the
native argmax, equals transformers' greedy decoding of each prompt alone, token for token."""
from __future__ import annotations

import os
import shutil

import pytest

from services.executor.model.native import library
from tests.parity.test_gguf_smollm2 import TEXTS, checkpoint, gguf_file, greedy, transformers  # noqa: F401
from weft import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")

NUM_NEW = 12


def test_batched_native_greedy_equals_transformers_on_smollm2(checkpoint):  # noqa: F811
    import torch

    from services.shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(checkpoint)
    prompts = [[1]] + [list(tok.encode(t)) for t in TEXTS[:4]] + [list(tok.encode(" ".join(TEXTS) * 6))]
    assert min(map(len, prompts)) == 1 and max(map(len, prompts)) > 200
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = [greedy(hf, p, NUM_NEW) for p in prompts]
    llm = LLM(checkpoint, max_prefill_chunk=64, max_num_batched_tokens=256)
    native = llm.engine.runner.native
    assert native is not None
    rows: list[int] = []
    step_rows, argmax_rows = native.step_rows, native.argmax_rows
    native.step_rows = lambda ids, *a: rows.append(ids.shape[0]) or step_rows(ids, *a)
    picked: list[int] = []
    native.argmax_rows = lambda logits: picked.append(1) or argmax_rows(logits)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert max(rows) == len(prompts) and picked

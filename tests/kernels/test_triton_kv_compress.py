"""KV compression on the Triton back end (interpreted on CPU, compiled on a GPU): it
produces no attention scores, so the oldest middle block goes first, and with the
shorter, shifted cache it generates what the torch back end does under that policy."""
from __future__ import annotations

import torch

from weft import LLM, SamplingParams
from weft.testing.tiny_model import make_tiny_checkpoint


def test_triton_backend_compressed_generation_equals_torch_with_oldest_first(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny", preset="tiny", arch="llama")
    prompts = [[5, 9, 200, 31, 7, 8, 100, 3, 2, 1], list(range(40, 58))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    options = dict(block_size=4, num_kv_blocks=32, kv_compress_budget_blocks=4, kv_compress_sink_blocks=1,
                   kv_compress_recent_blocks=2, device="cuda" if torch.cuda.is_available() else "cpu")

    reference = LLM(path, attention_backend="torch", **options)
    reference.engine.runner.track_block_scores = False  # no scores: the same oldest-first choice
    expected = reference.generate(prompts, params, use_tqdm=False)
    triton_llm = LLM(path, attention_backend="triton", **options)
    got = triton_llm.generate(prompts, params, use_tqdm=False)

    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert triton_llm.engine.stats()["num_compressed_blocks"] == reference.engine.stats()["num_compressed_blocks"] > 0

"""The native batch-1 decode step (services/executor/model/native/) computes what the
torch forward pass computes, writes the same KV slot, is what the engine runs for a lone
decode, and falls back to the torch path when its library cannot be built."""
from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.selector import backend_class
from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.model.checkpoint import load_state_dict
from services.executor.model.config import ModelConfig
from services.executor.model.llama import LlamaModel
from services.executor.model.native import library
from weft.testing.tiny_model import make_tiny_checkpoint

BLOCK_SIZE = 4
NUM_BLOCKS = 16


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def checkpoint(request, tmp_path_factory):
    # llama/mistral: untied lm_head, no bias; qwen2: tied embeddings and a qkv bias
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), "tiny", request.param, seed=3)


def _model(path, native_decode: bool) -> LlamaModel:
    config = ModelConfig.from_dir(path)
    return LlamaModel(config, load_state_dict(path, config, dtype=torch.float32), backend_class("torch"),
                      native_decode=native_decode)


@pytest.mark.parametrize("seq_len,position_offset", [(1, 0), (6, 0), (23, 0), (9, 5)])
def test_native_step_matches_the_torch_forward_pass(checkpoint, seq_len, position_offset):
    """Logits and the written K/V slot agree with the torch path, for contexts spanning
    several scattered blocks (GQA: 4 query heads over 2 KV heads); position_offset > 0 is
    a sequence whose cache holds fewer tokens than its position (KV compression)."""
    model = _model(checkpoint, native_decode=True)
    gen = torch.Generator().manual_seed(seq_len)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    caches_torch = [torch.randn(shape, generator=gen) for _ in range(model.num_layers)]
    caches_native = [c.clone() for c in caches_torch]
    table = torch.randperm(NUM_BLOCKS, generator=gen).to(torch.int32)  # blocks out of order
    idx = seq_len - 1
    slot = int(table[idx // BLOCK_SIZE]) * BLOCK_SIZE + idx % BLOCK_SIZE
    token, position = 17, idx + position_offset

    hidden = model.forward(torch.tensor([token]), torch.tensor([position]), caches_torch,
                           AttentionMetadata.decode_only(torch.tensor([slot]), table[None], [seq_len]))
    expected = model.compute_logits(hidden)
    decoder = model.native_decoder(caches_native)
    assert decoder is not None
    logits = decoder.step(token, position, slot, table, seq_len)

    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    for native, ref in zip(caches_native, caches_torch):
        torch.testing.assert_close(native, ref, rtol=1e-5, atol=1e-5)  # the new slot, nothing else


def _greedy(path, monkeypatch, native: str, prompts: list[list[int]]) -> tuple[list[list[int]], bool]:
    monkeypatch.setenv("WEFT_NATIVE_DECODE", native)
    engine = LLMEngine(path, EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=64))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))], engine.runner.native is not None


def test_engine_greedy_tokens_are_the_same_with_the_native_step(checkpoint, monkeypatch):
    """A lone request (every decode step native, 20 tokens over several blocks) and a
    pair (batched decodes: the multi-row native step) give the same tokens as with native off."""
    for prompts in ([[5, 9, 200, 31, 7]], [[5, 9, 200], [44, 3, 900, 12, 8, 1]]):
        native, used = _greedy(checkpoint, monkeypatch, "1", prompts)
        plain, unused = _greedy(checkpoint, monkeypatch, "0", prompts)
        assert used and not unused
        assert native == plain


def test_the_engine_config_turns_the_native_step_off(checkpoint, monkeypatch):
    """EngineConfig.native_decode (weft up --no-native-decode, WEFT_EXECUTOR_NATIVE_DECODE)
    reaches the model: the option existed but the engine never passed it on."""
    monkeypatch.setenv("WEFT_NATIVE_DECODE", "1")
    off = LLMEngine(checkpoint, EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=64, native_decode=False))
    on = LLMEngine(checkpoint, EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=64, native_decode=True))
    assert off.runner.native is None and on.runner.native is not None


def test_a_failed_build_falls_back_to_the_torch_path(checkpoint, monkeypatch, tmp_path):
    """A missing compiler: one readable warning, no native decoder, the engine still serves."""
    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path))  # nothing cached: a build is needed
    monkeypatch.setenv("WEFT_NATIVE_CC", str(tmp_path / "no-such-cc"))
    library.load.cache_clear()
    try:
        with capture_logs() as logs:
            model = _model(checkpoint, native_decode=True)
        assert model.native_decoder([torch.zeros(2, 1, 1, 1, 1)]) is None
        warnings = [e for e in logs if e["event"] == "native_decode_unavailable"]
        assert len(warnings) == 1 and "no-such-cc" in warnings[0]["reason"]
        tokens, used = _greedy(checkpoint, monkeypatch, "1", [[5, 9, 200]])
        assert not used and len(tokens[0]) == 20
    finally:
        library.load.cache_clear()  # later tests build (or find) the real library again


def test_disabled_by_environment_builds_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("WEFT_NATIVE_DECODE", "0")
    library.load.cache_clear()
    try:
        assert library.load() is None
        assert not (tmp_path / "native").exists()
    finally:
        library.load.cache_clear()


def test_the_library_is_built_once_and_reused(monkeypatch, tmp_path):
    """Same source, flags, compiler and CPU: the cached file is loaded, not rebuilt."""
    first = library.build("gcc", tmp_path)
    stamp = first.stat().st_mtime_ns
    assert library.build("gcc", tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.glob("*.so")] == [first.name]  # no temporary left behind

"""RoPE tables equal transformers' bit for bit (greedy parity depends on it)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from services.executor.errors import UnsupportedModelError
from services.executor.model.config import ModelConfig
from services.executor.model.rope import rope_cos_sin, rope_inv_freq

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

# A Llama-3.1-8B-like attention shape: head_dim 128 puts frequencies in every llama3 band.
BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
    "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 131072,
}
ROPE_CASES = {
    "default": {"rope_theta": 500000.0},
    "linear": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}},
}


def hf_rotary(d: dict) -> LlamaRotaryEmbedding:
    return LlamaRotaryEmbedding(transformers.LlamaConfig(**d))


@pytest.mark.parametrize("rope_type", list(ROPE_CASES))
def test_inv_freq_equals_transformers_bitwise(rope_type):
    d = {**BASE, **ROPE_CASES[rope_type]}
    inv_freq, scaling = rope_inv_freq(ModelConfig.from_dict(d))
    reference = hf_rotary(d)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (64,)
    assert torch.equal(inv_freq, reference.inv_freq)
    assert scaling == reference.attention_scaling


@pytest.mark.parametrize("rope_type", list(ROPE_CASES))
def test_cos_sin_equal_transformers_at_far_positions(rope_type):
    d = {**BASE, **ROPE_CASES[rope_type]}
    inv_freq, scaling = rope_inv_freq(ModelConfig.from_dict(d))
    positions = torch.tensor([0, 1, 17, 4095, 8191, 100000])
    cos, sin = rope_cos_sin(inv_freq, positions, scaling)
    ref_cos, ref_sin = hf_rotary(d)(torch.zeros(1, 1, 128), positions[None, :])
    assert cos.shape == (6, 128)
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


def test_llama3_keeps_high_divides_low_and_blends_middle_frequencies():
    d = {**BASE, **ROPE_CASES["llama3"]}
    scaled, _ = rope_inv_freq(ModelConfig.from_dict(d))
    plain, _ = rope_inv_freq(ModelConfig.from_dict({**BASE, "rope_theta": 500000.0}))
    assert torch.equal(scaled[0], plain[0])                          # highest frequency kept
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)                # lowest divided by factor
    ratio = plain / scaled
    assert ((ratio > 1.0 + 1e-6) & (ratio < 8.0 - 1e-6)).any()      # a blended band exists


def test_cos_sin_use_rotate_half_layout():
    inv_freq = torch.tensor([1.0, 0.5])
    cos, sin = rope_cos_sin(inv_freq, torch.tensor([3]))
    expected = torch.tensor([3.0, 1.5, 3.0, 1.5])
    assert torch.equal(cos[0], expected.cos()) and torch.equal(sin[0], expected.sin())


def test_unsupported_rope_type_raises():
    config = ModelConfig.from_dict({**BASE, **ROPE_CASES["linear"]})
    # Bypass ModelConfig's own validation to reach rope.py's dispatch.
    bogus = dataclasses.replace(config)
    object.__setattr__(bogus, "rope_scaling", {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        rope_inv_freq(bogus)


def test_in_place_rope_is_bit_identical_to_hf_order_on_a_strided_view():
    """apply_rope_ rotates q and k heads inside the qkv projection's output (a strided view)
    and must give exactly HF's ``x * cos + rotate_half(x) * sin``, bit for bit."""
    from services.executor.model.llama import apply_rope_, rotate_half

    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, d = 5, 6, 2, 8
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    positions = torch.arange(n) * 37
    cfg_inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_cos_sin(cfg_inv, positions)
    cos, sin = cos[:, None], sin[:, None]
    x = qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d)
    expected = x * cos + rotate_half(x) * sin
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    sin_signed = torch.cat((-sin[..., : d // 2], sin[..., d // 2:]), dim=-1)
    out = apply_rope_(x, cos, sin_signed)
    assert out.data_ptr() == x.data_ptr()  # in place, in the projection's buffer
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # v untouched

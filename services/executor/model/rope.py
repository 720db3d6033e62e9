"""Rotary position embedding tables for the RoPE variants the executor supports.

NOTE: the frequencies must match transformers bit for bit, not merely closely: greedy
parity with Hugging Face depends on it, and a 1-ulp drift in ``inv_freq`` grows with
the position (angle = position * inv_freq). So every step below is float32 in the same
order of operations as ``transformers.modeling_rope_utils``.

The layout is Hugging Face's "rotate_half" convention: a head vector's first half
holds the real parts of the rotated pairs and its second half the imaginary parts, so
cos/sin tables repeat the frequencies twice: ``cat(freqs, freqs)``.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from services.executor.errors import UnsupportedModelError
from services.executor.model.config import SUPPORTED_ROPE_TYPES, ModelConfig


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq, attention_scaling)``: inv_freq is float32 ``[head_dim // 2]``;
    attention_scaling multiplies cos and sin (1.0 for every type supported here).

    Raises UnsupportedModelError for a rope type without an implementation."""
    rope_type = "default" if config.rope_scaling is None else config.rope_scaling["rope_type"]
    compute = _INV_FREQ_BY_TYPE.get(rope_type)
    if compute is None:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return compute(config), 1.0


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given positions, each float32 ``[n, head_dim]``.

    ``inv_freq``: ``[head_dim // 2]`` float32; ``positions``: ``[n]`` integer tensor.
    Does not modify its inputs."""
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
    # [n, head_dim // 2]: the same float32 product transformers forms per position.
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
    cos, sin = emb.cos(), emb.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos, sin


def _default_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    # [head_dim // 2]: theta ** (-2i / d), formed as 1 / theta ** (2i / d) like HF does.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (config.rope_theta ** exponents)


def _linear_inv_freq(config: ModelConfig) -> torch.Tensor:
    # Position interpolation: scaling positions by 1/factor equals scaling the frequencies.
    assert config.rope_scaling is not None
    return _default_inv_freq(config) / config.rope_scaling["factor"]


def _llama3_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Llama 3.1's band-wise scaling: high frequencies (short wavelengths) are kept,
    low frequencies are divided by ``factor``, and the band between them is blended."""
    assert config.rope_scaling is not None
    scaling = config.rope_scaling
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]

    inv_freq = _default_inv_freq(config)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # Blend weight: 0 at the low-frequency edge of the band, 1 at the high one.
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


_INV_FREQ_BY_TYPE: dict[str, Callable[[ModelConfig], torch.Tensor]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}

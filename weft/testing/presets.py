"""What a tiny test checkpoint can be: its presets (model shapes), architectures, RoPE
scalings and weight dtypes, by name.

Torch-free on purpose: ``weft model make-tiny --help`` lists these choices, and the CLI
must not pay torch's import (a second or more) to print its help. The writer,
``weft/testing/tiny_model.py``, maps the dtype names to torch dtypes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Arch = Literal["llama", "qwen2", "mistral"]
RopeScaling = Literal["none", "linear", "llama3"]
ARCHS: tuple[str, ...] = ("llama", "qwen2", "mistral")
ROPE_SCALINGS: tuple[str, ...] = ("none", "linear", "llama3")
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")  # torch dtypes of the stored weights


@dataclass(frozen=True)
class Preset:
    """Model shape of one preset."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 2, 128, 1024, 2048),
    "small": Preset(256, 4, 8, 2, 704, 4096, 4096),
    "bench": Preset(512, 8, 8, 2, 1408, 32000, 4096),  # ~55M parameters
}

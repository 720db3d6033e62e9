"""Picks the attention back end class by name; imports the Triton one only when asked."""
from __future__ import annotations

from services.executor.attention.base import AttentionBackend


def backend_class(name: str) -> type[AttentionBackend]:
    if name == "torch":
        from services.executor.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "triton":
        from services.executor.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    raise ValueError(f"unknown attention back end {name!r} (expected 'torch' or 'triton')")

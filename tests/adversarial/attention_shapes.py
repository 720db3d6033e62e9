"""Model attention shapes the native-attention attacks share (test_native_decode_attention_*)."""
from __future__ import annotations

import torch

BS = 16  # block size of the direct kernel tests (the engine's default too)

# (num_attention_heads, num_key_value_heads, head_dim): groups 1..5; head_dim 64 / 128 take
# the AVX-512 values pass over every query head of a KV head at once (pv_kv_head: passes
# of 4 heads at 64, 2 at 128, short last passes at groups 3 and 5), 56 and 16 the
# head-at-a-time pass (a masked last chunk at 56)
SHAPES = {
    "g1_d64": (2, 2, 64),
    "g2_d64": (4, 2, 64),
    "g3_d64": (6, 2, 64),
    "g5_d64": (5, 1, 64),
    "g1_d128": (2, 2, 128),
    "g3_d128": (3, 1, 128),
    "g4_d128": (4, 1, 128),
    "g5_d128": (5, 1, 128),
    "g3_d56": (6, 2, 56),
    "g2_d16": (4, 2, 16),
}


def overrides(heads: int, kv: int, d: int, layers: int) -> dict:
    return {"hidden_size": heads * d, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
            "num_hidden_layers": layers}


def threads(n: int):
    """A scope running torch (and the native library, which asks torch) on ``n`` threads."""
    class _Scope:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)
    return _Scope()

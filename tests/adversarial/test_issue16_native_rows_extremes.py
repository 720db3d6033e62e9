"""Issue 16, the native multi-row step's vector exp (exp16 in llama_step.h) far outside
[-1, 1]: SiLU of gate values near +-100 and softmax over scores hundreds apart (a nearly
one-hot attention) must still give what the torch forward pass gives. An exp16 that built
2^n from exponent bits without its clamp (n below -126 wraps into garbage) fails every
case here; random weights at their usual scale never leave exp's easy range."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from services.executor.attention.selector import backend_class
from services.executor.model.config import ModelConfig
from services.executor.model.llama import LlamaModel
from services.executor.model.native import library
from tests.adversarial.test_issue16_native_rows_edges import _compare
from weft.testing.tiny_model import model_config_dict, random_weights

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")

# name: (HF weight-name suffix -> gain applied to the random weights)
GAINS = {
    "silu_far_out": {"mlp.gate_proj.weight": 60.0},  # gate values ~ +-100 and beyond
    "one_hot_attention": {"self_attn.q_proj.weight": 12.0, "self_attn.k_proj.weight": 12.0},  # scores ~ +-150
    "both": {"mlp.gate_proj.weight": 60.0, "self_attn.q_proj.weight": 12.0, "self_attn.k_proj.weight": 12.0},
}


@pytest.mark.parametrize("case", list(GAINS))
def test_native_rows_match_torch_with_extreme_activations(case):
    config = ModelConfig.from_dict(model_config_dict("tiny", "llama"))
    weights = random_weights(config, seed=2)
    for name in weights:
        for suffix, gain in GAINS[case].items():
            if name.endswith(suffix):
                weights[name] = weights[name] * gain
    model = LlamaModel(config, weights, backend_class("torch"), native_decode=True)
    # rows 17 and 33 tokens long: partial 16-token score blocks; 5 rows: one attention item per row
    # the caches at 1e-4: a nearly one-hot softmax turns fp32 rounding in one layer's scores
    # into ~2e-5 differences in the next layer's K/V (torch's own reordering does the same)
    _compare(model, 16, [5, 17, 33, 48, 100], False, cache_tol=1e-4)

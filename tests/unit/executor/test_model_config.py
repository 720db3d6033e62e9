"""ModelConfig parsing: both rope spellings, defaults, validation and error messages."""
from __future__ import annotations

import json

import pytest

from services.executor.errors import CheckpointError, ModelLoadError, UnsupportedModelError
from services.executor.model.config import ModelConfig
from weft.testing.tiny_model import model_config_dict

LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def llama_dict(**overrides):
    d = model_config_dict("tiny", "llama")
    d.update(overrides)
    return d


def test_classic_form_parses_shapes_and_rope_theta():
    config = ModelConfig.from_dict(llama_dict())
    assert config.architecture == "llama"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim) == (64, 2, 4, 2, 16)
    assert config.rope_theta == 10000.0
    assert config.rope_scaling is None
    assert config.eos_token_ids == (2, 0)
    assert config.num_queries_per_kv == 2


def test_rope_parameters_form_equals_classic_form():
    classic = llama_dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING})
    new = llama_dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING})
    del new["rope_theta"], new["rope_scaling"]
    assert ModelConfig.from_dict(new) == ModelConfig.from_dict(classic)


def test_llama3_scaling_is_parsed_with_all_parameters():
    config = ModelConfig.from_dict(llama_dict(rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING}))
    assert config.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}


def test_legacy_type_key_is_accepted_for_rope_scaling():
    config = ModelConfig.from_dict(llama_dict(rope_scaling={"type": "linear", "factor": 4}))
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_llama3_original_length_defaults_to_max_position_embeddings():
    scaling = {k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"}
    config = ModelConfig.from_dict(llama_dict(rope_scaling={"rope_type": "llama3", **scaling}))
    assert config.rope_scaling["original_max_position_embeddings"] == 2048


def test_default_rope_type_normalises_to_no_scaling():
    config = ModelConfig.from_dict(llama_dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert config.rope_scaling is None and config.rope_theta == 1e6


def test_unknown_architecture_error_names_it_and_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_dict(llama_dict(architectures=["GPTNeoXForCausalLM"]))
    assert "GPTNeoXForCausalLM" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value) and "Qwen2ForCausalLM" in str(err.value)


def test_architecture_falls_back_to_model_type():
    d = llama_dict(model_type="mistral")
    del d["architectures"]
    assert ModelConfig.from_dict(d).architecture == "mistral"


def test_unsupported_rope_type_error_names_it():
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dict(llama_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size"])
def test_missing_key_error_names_the_key(key):
    d = llama_dict()
    del d[key]
    with pytest.raises(ModelLoadError, match=key):
        ModelConfig.from_dict(d)


def test_missing_llama3_parameter_error_names_it():
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        ModelConfig.from_dict(llama_dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                       "high_freq_factor": 4.0}))


def test_query_heads_not_divisible_by_kv_heads_is_rejected():
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        ModelConfig.from_dict(llama_dict(num_attention_heads=4, num_key_value_heads=3))


def test_wrongly_typed_value_is_rejected_naming_the_key():
    with pytest.raises(ModelLoadError, match="hidden_size"):
        ModelConfig.from_dict(llama_dict(hidden_size="64"))


def test_non_silu_activation_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_dict(llama_dict(hidden_act="gelu"))


def test_head_dim_defaults_to_hidden_over_heads():
    d = llama_dict()
    del d["head_dim"]
    assert ModelConfig.from_dict(d).head_dim == 16


def test_qwen2_has_qkv_bias_without_output_bias():
    config = ModelConfig.from_dict(model_config_dict("tiny", "qwen2"))
    assert config.attention_bias and not config.attention_output_bias
    assert config.tie_word_embeddings and config.bos_token_id is None


def test_llama_attention_bias_key_covers_output_projection():
    config = ModelConfig.from_dict(llama_dict(attention_bias=True))
    assert config.attention_bias and config.attention_output_bias


def test_mistral_sliding_window_defaults_like_transformers():
    d = model_config_dict("tiny", "mistral")
    assert ModelConfig.from_dict(d).sliding_window is None  # explicit null
    del d["sliding_window"]
    assert ModelConfig.from_dict(d).sliding_window == 4096  # MistralConfig's default


def test_from_dir_merges_generation_config_eos_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(llama_dict(eos_token_id=2)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2, 1]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 0, 1)


def test_from_dir_without_config_json_raises_checkpoint_error_naming_it(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fields_agree_with_transformers_config(arch):
    transformers = pytest.importorskip("transformers")
    d = model_config_dict("small", arch, rope_scaling="llama3" if arch == "llama" else "none")
    ours = ModelConfig.from_dict(d)
    hf = transformers.AutoConfig.for_model(**d)
    assert ours.head_dim == hf.head_dim
    assert ours.num_key_value_heads == hf.num_key_value_heads
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    if ours.rope_scaling is not None:
        assert ours.rope_scaling.items() <= hf.rope_parameters.items()


def test_equal_configs_hash_equal_so_they_can_key_a_cache():
    d = llama_dict(rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING})
    assert {ModelConfig.from_dict(d): "tables"}[ModelConfig.from_dict(d)] == "tables"

"""Checkpoint loading: complete, validated, and errors that name the file and tensor."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from services.executor.model.checkpoint import expected_tensor_shapes, load_state_dict
from services.executor.errors import CheckpointError
from services.executor.model.config import ModelConfig
from weft.testing.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "tiny", "llama", seed=3)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sharded"), "tiny", "llama", seed=3,
                                max_shard_bytes=200_000)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "tiny", "qwen2", seed=3)


@pytest.fixture
def llama_copy(llama_dir, tmp_path) -> Path:
    return Path(shutil.copytree(llama_dir, tmp_path / "ckpt"))


def test_loads_every_expected_tensor_with_its_shape(llama_dir):
    config = ModelConfig.from_dir(llama_dir)
    state = load_state_dict(llama_dir, config)
    expected = expected_tensor_shapes(config)
    assert set(state) == set(expected)
    assert all(tuple(state[name].shape) == shape for name, shape in expected.items())
    on_disk = load_file(str(llama_dir / "model.safetensors"))
    assert all(torch.equal(state[name], on_disk[name]) for name in expected)


def test_tensors_are_cast_to_the_requested_dtype(llama_dir):
    state = load_state_dict(llama_dir, dtype=torch.bfloat16)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_sharded_checkpoint_loads_equal_to_unsharded(llama_dir, sharded_dir):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single, sharded = load_state_dict(llama_dir), load_state_dict(sharded_dir)
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[name], sharded[name]) for name in single)


def test_tied_embeddings_return_the_embedding_as_lm_head(qwen2_dir):
    assert "lm_head.weight" not in load_file(str(qwen2_dir / "model.safetensors"))
    state = load_state_dict(qwen2_dir)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]


def test_qwen2_attention_biases_are_loaded(qwen2_dir):
    state = load_state_dict(qwen2_dir)
    assert state["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert state["model.layers.1.self_attn.k_proj.bias"].shape == (32,)
    assert "model.layers.0.self_attn.o_proj.bias" not in state


def test_missing_shard_error_names_the_shard(sharded_dir, tmp_path):
    ckpt = Path(shutil.copytree(sharded_dir, tmp_path / "ckpt"))
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_state_dict(ckpt)


def test_truncated_file_error_names_the_file(llama_copy):
    path = llama_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated or corrupt"):
        load_state_dict(llama_copy)


def test_garbage_header_error_names_the_file(llama_copy):
    (llama_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_state_dict(llama_copy)


def test_shape_mismatch_error_names_tensor_and_both_shapes(llama_copy):
    path = llama_copy / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(120, 64)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_state_dict(llama_copy)
    assert str(err.value) == ("model.layers.0.mlp.up_proj.weight: expected shape (128, 64), "
                              "found (120, 64) in model.safetensors")


def test_missing_tensor_error_names_the_tensor(llama_copy):
    path = llama_copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.post_attention_layernorm\.weight"):
        load_state_dict(llama_copy)


def test_tensor_listed_in_index_but_absent_from_shard_is_named(sharded_dir, tmp_path):
    ckpt = Path(shutil.copytree(sharded_dir, tmp_path / "ckpt"))
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    real_shard = index["weight_map"]["model.norm.weight"]
    other_shard = next(f for f in sorted(set(index["weight_map"].values())) if f != real_shard)
    index["weight_map"]["model.norm.weight"] = other_shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        load_state_dict(ckpt)


def test_unknown_extra_tensor_is_ignored_with_a_warning(llama_copy):
    path = llama_copy / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # known harmless
    tensors["vision_tower.proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with capture_logs() as logs:
        state = load_state_dict(llama_copy)
    assert "vision_tower.proj.weight" not in state
    warned = [e["tensor"] for e in logs if e["event"] == "checkpoint_unused_tensor"]
    assert warned == ["vision_tower.proj.weight"]


def test_missing_config_json_raises_checkpoint_error(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_state_dict(llama_copy)


def test_directory_without_safetensors_files_raises(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_state_dict(llama_copy)

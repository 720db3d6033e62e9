"""Loading a broken checkpoint fails with the executor's domain error, and the message
names what is wrong (the architecture, the file, the tensor, the config key)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from services.executor.engine import LLMEngine
from services.executor.engine_config import EngineConfig
from services.executor.errors import CheckpointError, UnsupportedModelError
from weft import LLM
from weft.tiny_model import make_tiny_checkpoint

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pristine"), preset="tiny", arch="llama")


@pytest.fixture
def checkpoint(pristine, tmp_path) -> Path:
    """A private copy of the tiny checkpoint for one test to break."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


@pytest.fixture(params=["LLMEngine", "LLM"])
def load(request):
    if request.param == "LLMEngine":
        return lambda path: LLMEngine(path, EngineConfig(num_kv_blocks=8))
    return lambda path: LLM(path, num_kv_blocks=8)


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_the_pristine_checkpoint_loads(checkpoint, load):
    load(checkpoint)  # guards the tests below: they fail for the reason they break


def test_unknown_architecture_is_unsupported_and_named(checkpoint, load):
    _edit_config(checkpoint, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load(checkpoint)


def test_unknown_model_type_without_architectures_is_unsupported_and_named(checkpoint, load):
    _edit_config(checkpoint, architectures=None, model_type="falcon")
    with pytest.raises(UnsupportedModelError, match="falcon"):
        load(checkpoint)


def test_missing_config_json_is_a_checkpoint_error_naming_it(checkpoint, load):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load(checkpoint)


def test_config_json_that_is_not_json_is_a_checkpoint_error_naming_it(checkpoint, load):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        load(checkpoint)


def test_missing_safetensors_file_is_a_checkpoint_error_naming_it(checkpoint, load):
    (checkpoint / WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match=WEIGHTS):
        load(checkpoint)


def test_missing_shard_listed_in_the_index_is_named(pristine, tmp_path, load):
    sharded = make_tiny_checkpoint(tmp_path / "sharded", preset="tiny", arch="llama", max_shard_bytes=100_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=shards[-1].name):
        load(sharded)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x07not a safetensors file" * 8)


def _broken_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8] = ord("X")  # the JSON header starts at byte 8 with '{'
    path.write_bytes(bytes(data))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("corrupt", [_truncate, _garbage, _broken_header, _empty])
def test_corrupt_safetensors_file_is_a_checkpoint_error_naming_it(checkpoint, load, corrupt):
    corrupt(checkpoint / WEIGHTS)
    with pytest.raises(CheckpointError, match=f"{WEIGHTS}.*(truncated|corrupt)"):
        load(checkpoint)


def test_tensor_with_the_wrong_shape_is_named_with_both_shapes(checkpoint, load):
    tensors = load_file(str(checkpoint / WEIGHTS))
    name = "model.layers.1.self_attn.k_proj.weight"
    expected = tuple(tensors[name].shape)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(checkpoint / WEIGHTS))
    found = (expected[0], expected[1] - 1)
    with pytest.raises(CheckpointError) as err:
        load(checkpoint)
    message = str(err.value)
    assert name in message and str(expected) in message and str(found) in message


def test_config_that_disagrees_with_the_weights_is_named(checkpoint, load):
    _edit_config(checkpoint, vocab_size=2048)
    with pytest.raises(CheckpointError, match=r"\(2048, 64\)"):
        load(checkpoint)


def test_missing_tensor_is_named(checkpoint, load):
    tensors = load_file(str(checkpoint / WEIGHTS))
    del tensors["model.norm.weight"]
    save_file(tensors, str(checkpoint / WEIGHTS))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        load(checkpoint)


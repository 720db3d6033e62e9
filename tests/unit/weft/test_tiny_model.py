"""Tiny checkpoints: real Hugging Face format, deterministic, and a usable random model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.executor.model.checkpoint import load_state_dict
from services.shared.tokenizer import Tokenizer
from weft.cli import main
from weft.testing.tiny_model import make_tiny_checkpoint, num_parameters

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "qwen2", "mistral"]
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {arch: make_tiny_checkpoint(tmp_path_factory.mktemp(arch), "tiny", arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    return {arch: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for arch, path in checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_weights_equal_to_ours(checkpoints, hf_models, arch):
    ours = load_state_dict(checkpoints[arch])
    theirs = hf_models[arch].state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_tokenizer_loads_with_chat_template(checkpoints, arch):
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[arch])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_of_the_random_model_is_not_one_repeated_token(checkpoints, hf_models, arch):
    tokenizer = Tokenizer.from_dir(checkpoints[arch])
    prompt = torch.tensor([tokenizer.encode("The engine reads a request")])
    out = hf_models[arch].generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
    new_ids = out[0, prompt.shape[1]:].tolist()
    assert len(new_ids) == 24 and len(set(new_ids)) >= 4


def test_same_arguments_write_byte_identical_files(checkpoints, tmp_path):
    again = make_tiny_checkpoint(tmp_path, "tiny", "llama")
    for name in FILES:
        assert (again / name).read_bytes() == (checkpoints["llama"] / name).read_bytes(), name


def test_another_seed_changes_weights_but_not_tokenizer(checkpoints, tmp_path):
    other = make_tiny_checkpoint(tmp_path, "tiny", "llama", seed=1)
    assert (other / "model.safetensors").read_bytes() != (checkpoints["llama"] / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (checkpoints["llama"] / "tokenizer.json").read_bytes()


def test_qwen2_model_vocab_is_larger_than_its_tokenizer(checkpoints):
    config = json.loads((checkpoints["qwen2"] / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["qwen2"])
    assert config["vocab_size"] > len(tokenizer)
    assert config["tie_word_embeddings"] is True


def test_llama_tokenizer_covers_the_whole_tiny_model_vocab(checkpoints):
    assert Tokenizer.from_dir(checkpoints["llama"]).vocab_size == 1024


def test_llama3_rope_scaling_option_is_written_and_loads(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path, "tiny", "llama", rope_scaling="llama3")
    config = transformers.AutoConfig.from_pretrained(ckpt)
    assert config.rope_parameters["rope_type"] == "llama3"


def test_bench_preset_has_about_55m_parameters():
    assert 50e6 < num_parameters("bench") < 60e6


def test_cli_make_tiny_writes_a_loadable_checkpoint(tmp_path, capsys):
    assert main(["model", "make-tiny", str(tmp_path / "ck"), "--arch", "mistral", "--seed", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["model_type"] == "mistral"


def test_cli_help_documents_every_make_tiny_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["model", "make-tiny", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ["--preset", "--arch", "--seed", "--rope-scaling", "--dtype", "--max-shard-bytes"]:
        assert flag in help_text

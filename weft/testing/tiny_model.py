"""Write small random-weight checkpoints in exact Hugging Face format, for tests and
benchmarks that need a real model directory without downloading one.

``make_tiny_checkpoint(dir, preset, arch, seed)`` writes config.json,
generation_config.json, model.safetensors (or shards + index), tokenizer.json,
tokenizer_config.json and special_tokens_map.json; the result loads with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``. Same
arguments give byte-identical files.

Weight scales are chosen so greedy decoding of a random model yields varied tokens:
projections are scaled by 1/sqrt(fan_in) (unit-variance outputs), and the projections
that write into the residual stream (o_proj, down_proj) by a further gain, so the
context, not the current token's embedding, decides the next token. With the usual
N(0, 0.02) init the residual stream is just the current token's embedding and greedy
decoding repeats one token; with tied embeddings (qwen2) the pull towards the current
token is strongest, hence the larger gain there (measured: 16 tied, 4 untied).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from services.executor.model.checkpoint import INDEX_FILE, SINGLE_FILE, expected_tensor_shapes
from services.executor.model.config import ModelConfig
from weft.testing import tiny_tokenizer as tt
from weft.testing.presets import ARCHS, DTYPE_NAMES, PRESETS, ROPE_SCALINGS, Arch, Preset, RopeScaling

__all__ = ["ARCHS", "DTYPES", "PRESETS", "ROPE_SCALINGS", "Arch", "Preset", "RopeScaling", "make_tiny_checkpoint",
           "model_config_dict", "num_parameters", "random_weights"]  # the presets: weft/testing/presets.py

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}

# Qwen ships an embedding matrix with more rows than its tokenizer has ids (padded for
# GPU-friendly shapes); the tiny qwen2 checkpoint keeps at least this many spare rows.
QWEN2_SPARE_VOCAB_ROWS = 64


def make_tiny_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    arch: Arch = "llama",
    seed: int = 0,
    *,
    rope_scaling: RopeScaling = "none",
    max_shard_bytes: int | None = None,
    dtype: str = "float32",
) -> Path:
    """Write a deterministic random-weight checkpoint to ``out_dir`` (created if absent;
    existing checkpoint files are overwritten) and return its path.

    ``max_shard_bytes`` splits the weights into ``model-0000i-of-0000n.safetensors``
    shards of at most that size (one tensor larger than it gets a shard of its own)
    plus ``model.safetensors.index.json``. Raises ValueError on an unknown option."""
    config_dict = model_config_dict(preset, arch, rope_scaling=rope_scaling, dtype=dtype)
    config = ModelConfig.from_dict(config_dict)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), out / INDEX_FILE]:
        stale.unlink(missing_ok=True)  # a previous, differently sharded run

    tensors = random_weights(config, seed, DTYPES[dtype])
    if max_shard_bytes is None:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    else:
        _save_sharded(tensors, out, max_shard_bytes)

    add_bos = arch != "qwen2"  # Qwen2 has no BOS; the others prepend one, like Llama.
    tokenizer = tt.build_tokenizer(_tokenizer_vocab_cap(config), add_bos=add_bos)
    gen = {"bos_token_id": config_dict["bos_token_id"], "do_sample": False,
           "eos_token_id": config_dict["eos_token_id"], "pad_token_id": tokenizer.token_to_id(tt.ENDOFTEXT)}
    files = {
        "config.json": tt.dumps(config_dict),
        "generation_config.json": tt.dumps(gen),
        "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        "tokenizer_config.json": tt.dumps(tt.tokenizer_config(add_bos, config.max_position_embeddings)),
        "special_tokens_map.json": tt.dumps(tt.special_tokens_map(add_bos)),
    }
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    return out


def model_config_dict(
    preset: str = "tiny", arch: Arch = "llama", *, rope_scaling: RopeScaling = "none", dtype: str = "float32"
) -> dict[str, Any]:
    """config.json contents for a preset, in the classic (transformers 4.x) spelling
    that every transformers version reads."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    if rope_scaling not in ROPE_SCALINGS:
        raise ValueError(f"unknown rope scaling {rope_scaling!r}; choose from {', '.join(ROPE_SCALINGS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    p = PRESETS[preset]
    im_end, endoftext = tt.SPECIAL_TOKENS.index(tt.IM_END), tt.SPECIAL_TOKENS.index(tt.ENDOFTEXT)
    d: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "mistral": "MistralForCausalLM"}[arch]],
        "model_type": arch,
        "attention_dropout": 0.0,
        "bos_token_id": None if arch == "qwen2" else endoftext,
        "eos_token_id": [im_end, endoftext],
        "head_dim": p.hidden_size // p.num_attention_heads,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
        "num_attention_heads": p.num_attention_heads,
        "num_hidden_layers": p.num_hidden_layers,
        "num_key_value_heads": p.num_key_value_heads,
        "rms_norm_eps": 1e-6 if arch == "qwen2" else 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0 if arch == "llama" else 1000000.0,
        "tie_word_embeddings": arch == "qwen2",
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": p.vocab_size,
    }
    if arch == "llama":
        d.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "qwen2":
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.num_hidden_layers)
    else:
        d.update(sliding_window=None)
    if rope_scaling == "linear":
        d["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    elif rope_scaling == "llama3":
        # original length well below max positions, so the tiny head_dim's frequencies
        # fall in all three llama3 bands (kept, blended, divided by factor).
        d["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0,
                             "original_max_position_embeddings": p.max_position_embeddings // 4}
    return d


def num_parameters(preset: str, arch: Arch = "llama") -> int:
    """Parameter count of a preset (tied embeddings counted once); writes nothing."""
    config = ModelConfig.from_dict(model_config_dict(preset, arch))
    return sum(math.prod(shape) for shape in expected_tensor_shapes(config).values())


def random_weights(config: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random tensors for every weight the config implies, by HF name.

    Tensors are drawn in sorted name order from one generator, so the values depend
    only on (config, seed)."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(expected_tensor_shapes(config).items()):
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        scale = _scale(name, shape, config.tie_word_embeddings)
        tensors[name] = (values * scale + _offset(name)).to(dtype).contiguous()
    return tensors


def _scale(name: str, shape: tuple[int, ...], tied: bool) -> float:
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return 0.1  # norms: 1 + small noise
    if name.endswith(".bias"):
        return 0.1
    if name == "model.embed_tokens.weight":
        return 1.0
    # Linear weights [out, in]: unit-variance outputs for unit-variance inputs.
    scale = 1.0 / math.sqrt(shape[1])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        scale *= 16.0 if tied else 4.0  # residual gain, see the module docstring
    return scale


def _offset(name: str) -> float:
    return 1.0 if name.endswith("norm.weight") else 0.0


def _tokenizer_vocab_cap(config: ModelConfig) -> int:
    if config.architecture == "qwen2":
        return config.vocab_size - QWEN2_SPARE_VOCAB_ROWS
    return config.vocab_size


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    """Greedy packing in name order; writes shards and the HF index file."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name in sorted(tensors):
        size = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensors[name]
        shard_bytes += size
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(tt.dumps(index), encoding="utf-8")

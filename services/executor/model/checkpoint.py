"""Load a Hugging Face safetensors checkpoint into a flat ``{name: tensor}`` dict.

The result uses Hugging Face's weight names and is complete: every tensor the config
implies is present with exactly the expected shape, or loading fails with a
CheckpointError naming the file and the tensor. Nothing here knows about modules.

Layout on disk, either of:
    model.safetensors                              one file
    model.safetensors.index.json                   {"weight_map": {name: shard file}}
    model-00001-of-0000N.safetensors ...           the shards it names
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import structlog
import torch
from safetensors import SafetensorError, safe_open

from services.executor.errors import CheckpointError
from services.executor.model.config import ModelConfig, require_readable

log = structlog.get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Tensors some exporters save that carry no information we need.
_HARMLESS_EXTRA = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, by Hugging Face name, with its shape.

    ``lm_head.weight`` is absent when the embeddings are tied (it is the embedding)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        # nn.Linear stores weight as [out_features, in_features].
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        if config.attention_output_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def load_state_dict(
    model_dir: str | Path, config: ModelConfig | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Read, validate and convert every weight of the checkpoint in ``model_dir``.

    ``config`` defaults to ``ModelConfig.from_dir(model_dir)``. Tensors are cast to
    ``dtype``. With tied embeddings ``lm_head.weight`` is the embedding tensor itself
    (same storage). Unknown extra tensors are skipped with a
    ``checkpoint_unused_tensor`` warning. Raises CheckpointError."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    require_readable(model_dir)  # else every file in it would look missing
    if config is None:
        config = ModelConfig.from_dir(model_dir)
    expected = expected_tensor_shapes(config)
    files = _tensor_files(model_dir)

    state: dict[str, torch.Tensor] = {}
    for file_name, listed_names in files.items():
        path = model_dir / file_name
        # safetensors reports a file it may not open as "No such file or directory".
        require_readable(path)
        try:
            with safe_open(str(path), framework="pt") as reader:
                names_in_file = set(reader.keys())
                for name in listed_names if listed_names is not None else sorted(names_in_file):
                    if name not in names_in_file:
                        raise CheckpointError(
                            f"{name}: listed in {INDEX_FILE} under {file_name}, but not found in {file_name}"
                        )
                    if name not in expected:
                        _skip_extra(name, file_name, config)
                        continue
                    found = tuple(reader.get_slice(name).get_shape())
                    if found != expected[name]:
                        raise CheckpointError(
                            f"{name}: expected shape {expected[name]}, found {found} in {file_name}"
                        )
                    state[name] = reader.get_tensor(name).to(dtype)
        except SafetensorError as exc:
            raise CheckpointError(f"{file_name} in {model_dir} is truncated or corrupt: {exc}") from exc
        except OSError as exc:
            raise CheckpointError(f"{file_name} in {model_dir} cannot be read: {exc}") from exc

    missing = [name for name in expected if name not in state]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"missing tensor(s) in {model_dir}: {shown}")
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _tensor_files(model_dir: Path) -> dict[str, list[str] | None]:
    """Map each safetensors file to the tensor names to read from it (None: all)."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        require_readable(index_path)
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{INDEX_FILE} in {model_dir} is unreadable or lacks 'weight_map': {exc}") from exc
        by_file: dict[str, list[str] | None] = {}
        for name, file_name in sorted(weight_map.items()):
            by_file.setdefault(file_name, []).append(name)  # type: ignore[union-attr]
        for file_name in by_file:
            if not (model_dir / file_name).is_file():
                raise CheckpointError(f"shard {file_name} listed in {INDEX_FILE} is missing from {model_dir}")
        return by_file
    if (model_dir / SINGLE_FILE).is_file():
        return {SINGLE_FILE: None}
    present = sorted(p.name for p in model_dir.glob("*.safetensors"))
    raise CheckpointError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}"
        + (f" (found {', '.join(present)})" if present else " (no safetensors files at all)")
    )


def _skip_extra(name: str, file_name: str, config: ModelConfig) -> None:
    # A tied checkpoint may still store lm_head.weight; transformers ignores it too.
    if _HARMLESS_EXTRA.fullmatch(name) or (config.tie_word_embeddings and name == "lm_head.weight"):
        return
    log.warning("checkpoint_unused_tensor", tensor=name, file=file_name)

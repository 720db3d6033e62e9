"""The shape and numerics of a Llama-family checkpoint, read from its ``config.json``.

``ModelConfig`` is the executor's only view of ``config.json``: the model code, the
checkpoint loader and the RoPE tables read it, never the raw dict. Parsing accepts both
spellings transformers has used over the years:

- classic: top-level ``rope_theta`` plus ``rope_scaling = {"type" | "rope_type": ..}``;
- transformers >= 5: ``rope_parameters = {"rope_type": .., "rope_theta": .., ..}``.

Defaults for absent optional keys are the ones transformers' config classes use, so a
checkpoint means the same thing here as in ``AutoModelForCausalLM``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from services.executor.errors import CheckpointError, ModelLoadError, UnsupportedModelError
from services.mesh.file_access import unreadable_reason

Architecture = Literal["llama", "qwen2", "mistral"]

# HF class name in ``architectures[0]`` -> our architecture name.
ARCHITECTURE_CLASSES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURE_CLASSES)

# RoPE variants whose inverse frequencies ``rope.py`` computes. "default" is stored as
# ``rope_scaling=None``; the others keep their parameters in ``rope_scaling``.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
_ROPE_PARAMETER_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# transformers' per-family default for keys a config.json may omit.
_DEFAULT_MAX_POSITIONS: dict[str, int] = {"llama": 2048, "qwen2": 32768, "mistral": 4096 * 32}
_DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class ModelConfig:
    """Immutable, validated description of a decoder-only Llama-family model.

    ``rope_scaling`` is ``None`` for plain RoPE, else a dict with ``rope_type``
    ("linear" | "llama3") and exactly that type's parameters; treat it as read-only.
    ``attention_bias`` means q/k/v projections carry a bias; ``attention_output_bias``
    additionally puts one on o_proj (Llama's ``attention_bias`` covers all four, Qwen2's
    built-in bias covers only q/k/v). ``sliding_window`` is ``None`` for full attention.
    """

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    model_type: str
    attention_output_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURE_CLASSES.values():
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim",
                    "max_position_embeddings"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelLoadError(f"config key {key!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelLoadError(
                f"config key 'num_attention_heads' ({self.num_attention_heads}) must be a "
                f"multiple of 'num_key_value_heads' ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            # RoPE rotates pairs of dimensions.
            raise ModelLoadError(f"config key 'head_dim' must be even, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ModelLoadError(f"config key 'rms_norm_eps' must be positive, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ModelLoadError(f"config key 'rope_theta' must be positive, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES or rope_type == "default":
                raise UnsupportedModelError(
                    f"rope type {rope_type!r} is not supported; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelLoadError(f"config key 'sliding_window' must be positive, got {self.sliding_window}")
        for token_id in (*self.eos_token_ids, *([self.bos_token_id] if self.bos_token_id is not None else [])):
            if not 0 <= token_id < self.vocab_size:
                raise ModelLoadError(f"special token id {token_id} is outside vocab_size {self.vocab_size}")

    def __hash__(self) -> int:
        # The generated hash would fail on the rope_scaling dict; hash its items instead.
        scaling = tuple(sorted(self.rope_scaling.items())) if self.rope_scaling else None
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rope_scaling")
        return hash((fields, scaling))

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) from a
        checkpoint directory. A missing or unparsable config.json is a CheckpointError."""
        model_dir = Path(path)
        require_readable(model_dir)
        config = _read_json(model_dir / "config.json", required=True)
        generation = _read_json(model_dir / "generation_config.json", required=False)
        return cls.from_dict(config, generation_config=generation)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None) -> ModelConfig:
        """Build from a parsed config.json dict; ``generation_config`` (parsed
        generation_config.json) contributes extra eos ids. Raises ModelLoadError naming
        the offending key, UnsupportedModelError for unimplemented settings."""
        architecture = _architecture(d)
        hidden_size = _int(d, "hidden_size")
        num_attention_heads = _int(d, "num_attention_heads")
        if d.get("head_dim") is None:
            if hidden_size % num_attention_heads != 0:
                raise ModelLoadError(
                    f"config key 'hidden_size' ({hidden_size}) is not divisible by "
                    f"'num_attention_heads' ({num_attention_heads}) and 'head_dim' is absent"
                )
            head_dim = hidden_size // num_attention_heads
        else:
            head_dim = _int(d, "head_dim")
        _reject_unsupported_features(d, architecture)
        max_position_embeddings = _int(d, "max_position_embeddings",
                                       default=_DEFAULT_MAX_POSITIONS[architecture])
        rope_theta, rope_scaling = _rope(d, max_position_embeddings)
        if architecture == "qwen2":
            # Qwen2 hard-codes q/k/v biases (no o_proj bias) and has no config key for it.
            attention_bias, attention_output_bias = True, False
        elif architecture == "llama":
            attention_bias = attention_output_bias = _bool(d, "attention_bias", default=False)
        else:
            attention_bias = attention_output_bias = False
        eos_token_ids = _token_ids(d, "eos_token_id") + _token_ids(generation_config or {}, "eos_token_id")
        bos = d.get("bos_token_id")
        if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
            raise ModelLoadError(f"config key 'bos_token_id' must be an integer or null, got {bos!r}")
        return cls(
            architecture=architecture,
            vocab_size=_int(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_int(d, "intermediate_size"),
            num_hidden_layers=_int(d, "num_hidden_layers"),
            num_attention_heads=num_attention_heads,
            num_key_value_heads=_int(d, "num_key_value_heads", default=num_attention_heads),
            head_dim=head_dim,
            rms_norm_eps=_float(d, "rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=_bool(d, "tie_word_embeddings", default=False),
            attention_bias=attention_bias,
            attention_output_bias=attention_output_bias,
            bos_token_id=bos,
            # dict.fromkeys de-duplicates while keeping config.json's order first.
            eos_token_ids=tuple(dict.fromkeys(eos_token_ids)),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            model_type=str(d.get("model_type", architecture)),
            sliding_window=_sliding_window(d, architecture),
        )


def require_readable(path: Path) -> None:
    """Raise CheckpointError saying "permission denied" (mode, owner, our uid) when this
    process may not read ``path`` (services/mesh/file_access.py says why this is checked)."""
    reason = unreadable_reason(path)
    if reason is not None:
        raise CheckpointError(reason)


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path.name} not found in {path.parent}")
        return None
    require_readable(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except PermissionError as exc:  # lost a race with a chmod: still not a JSON problem
        raise CheckpointError(f"{path.name} in {path.parent} cannot be read: permission denied ({exc})") from exc
    except OSError as exc:
        raise CheckpointError(f"{path.name} in {path.parent} cannot be read: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path.name} in {path.parent} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path.name} in {path.parent} must hold a JSON object")
    return value


def _architecture(d: Mapping[str, Any]) -> Architecture:
    architectures = d.get("architectures") or []
    if architectures:
        name = architectures[0]
        if name in ARCHITECTURE_CLASSES:
            return ARCHITECTURE_CLASSES[name]
    else:
        # No architectures list: fall back to model_type ("llama" -> LlamaForCausalLM, ...).
        name = d.get("model_type")
        if name in ARCHITECTURE_CLASSES.values():
            return name  # type: ignore[return-value]
        if name is None:
            raise ModelLoadError("config key 'architectures' (or 'model_type') is missing")
    raise UnsupportedModelError(
        f"architecture {name!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _reject_unsupported_features(d: Mapping[str, Any], architecture: str) -> None:
    """Settings that change the math in ways the executor does not implement."""
    hidden_act = d.get("hidden_act", d.get("hidden_activation", "silu"))
    if hidden_act != "silu":
        raise UnsupportedModelError(f"config key 'hidden_act'={hidden_act!r} is not supported; only 'silu'")
    if d.get("mlp_bias"):
        raise UnsupportedModelError("config key 'mlp_bias'=true is not supported")
    partial = d.get("partial_rotary_factor", (d.get("rope_parameters") or {}).get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"config key 'partial_rotary_factor'={partial!r} is not supported")
    if architecture == "qwen2" and d.get("use_sliding_window"):
        # Qwen2 slides only layers >= max_window_layers: a per-layer mask we do not build.
        raise UnsupportedModelError("config key 'use_sliding_window'=true is not supported for qwen2")


def _sliding_window(d: Mapping[str, Any], architecture: str) -> int | None:
    if architecture != "mistral":
        return None
    # MistralConfig defaults to 4096 when the key is absent; an explicit null disables it.
    if "sliding_window" not in d:
        return 4096
    if d["sliding_window"] is None:
        return None
    return _int(d, "sliding_window")


def _rope(d: Mapping[str, Any], max_position_embeddings: int) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, normalised rope_scaling) from either config spelling."""
    params = d.get("rope_parameters")
    where = "rope_parameters"
    if params is None:
        params = d.get("rope_scaling")
        where = "rope_scaling"
    if params is not None and not isinstance(params, Mapping):
        raise ModelLoadError(f"config key {where!r} must be an object, got {params!r}")
    params = dict(params or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError(f"per-layer-type {where!r} is not supported")
    theta_raw = params.get("rope_theta", d.get("rope_theta", _DEFAULT_ROPE_THETA))
    rope_theta = _float({"rope_theta": theta_raw}, "rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return rope_theta, None
    if rope_type == "llama3":
        # transformers falls back to max_position_embeddings for llama3's pretraining length.
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    scaling: dict[str, Any] = {"rope_type": rope_type}
    for key in _ROPE_PARAMETER_KEYS[rope_type]:
        if key not in params:
            raise ModelLoadError(f"config key '{where}.{key}' is missing for rope type {rope_type!r}")
        if key == "original_max_position_embeddings":
            scaling[key] = _int(params, key)
        else:
            scaling[key] = _float(params, key)
    if scaling.get("factor", 1.0) <= 0:
        raise ModelLoadError(f"config key '{where}.factor' must be positive")
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ModelLoadError(f"config key '{where}.high_freq_factor' must exceed low_freq_factor")
    return rope_theta, scaling


def _int(d: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = d.get(key, default)
    if value is None:
        raise ModelLoadError(f"config key {key!r} is missing")
    # JSON writers sometimes emit 4096.0; accept integral floats, reject bools.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"config key {key!r} must be an integer, got {value!r}")
    return value


def _float(d: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = d.get(key, default)
    if value is None:
        raise ModelLoadError(f"config key {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"config key {key!r} must be a number, got {value!r}")
    return float(value)


def _bool(d: Mapping[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise ModelLoadError(f"config key {key!r} must be true or false, got {value!r}")
    return value


def _token_ids(d: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = d.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(f"config key {key!r} must be an integer or a list of integers")
    return tuple(values)

"""Import a GGUF file as a Hugging Face checkpoint directory that Weft and transformers load.

    FILE.gguf ──▶ DIR/config.json              (from the llama.* metadata)
                  DIR/model.safetensors        (every tensor dequantized to float32)
                  DIR/tokenizer.json           (gguf_tokenizer.py, from tokenizer.ggml.*)
                  DIR/tokenizer_config.json    (special tokens + chat template)
                  DIR/generation_config.json   (bos / eos / pad ids)

NOTE: llama.cpp's converter stores the rows of Q and K permuted per head (it interleaves
the two rotary halves for its RoPE kernel); ``unpermute`` undoes it:

    HF row order per head:   [x0 x1 … x(d/2-1) | y0 y1 … y(d/2-1)]     (rotate_half)
    GGUF row order per head: [x0 y0 x1 y1 … ]                           (pairs)
    GGUF → HF: reshape(heads, d/2, 2, cols) → swap axes 1, 2 → reshape(heads·d, cols)

K is permuted with the number of KV heads. Dequantization is the ``gguf`` package's (the
format's reference implementation); the types in ``SUPPORTED_TYPES`` are the ones tested.
Tied embeddings: no ``output.weight`` tensor means ``tie_word_embeddings``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from weft.models.gguf_layout import check_layout
from weft.models.gguf_tokenizer import GgufImportError, build_tokenizer_json, special_token_names

__all__ = ["GgufImportError", "SUPPORTED_ARCHITECTURES", "SUPPORTED_TYPES", "import_gguf", "unpermute"]

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(name: str) -> str:
    """GGUF tensor name → Hugging Face Llama name; raises naming an unknown tensor."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _LAYER_NAME.fullmatch(name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
    raise GgufImportError(f"tensor {name!r} has no Llama counterpart (a feature this importer does not support)")


def unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row permutation (see the module NOTE). Pure."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise GgufImportError(f"cannot un-permute {rows} rows over {num_heads} heads")
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def dequantize(tensor: Any) -> np.ndarray:
    """One reader tensor as float32 in Hugging Face (out, in) order."""
    import gguf

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GgufImportError(f"tensor {tensor.name!r} has type {kind}, not supported (supported: "
                              f"{', '.join(SUPPORTED_TYPES)})")
    return np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


# What each metadata value read here must be (keys under "<arch>." by their suffix). A value
# of another type (a string for embedding_length, ints for merges) was a TypeError or
# AttributeError traceback, or a checkpoint with a context length of -5.
_POSITIVE_INTS = ("embedding_length", "attention.head_count", "attention.head_count_kv", "attention.key_length",
                  "feed_forward_length", "block_count", "context_length", "vocab_size")
_KINDS = {**dict.fromkeys(_POSITIVE_INTS, "a positive integer"),
          **dict.fromkeys(("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor"),
                          "a positive number"),
          **dict.fromkeys(("tokenizer.ggml.tokens", "tokenizer.ggml.merges"), "an array of strings"),
          "tokenizer.ggml.token_type": "an array of integers",
          **dict.fromkeys((f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "unknown", "padding")),
                          "a token id (an integer >= 0)"),
          **dict.fromkeys(("general.architecture", "general.basename", "tokenizer.ggml.model", "tokenizer.ggml.pre",
                           "tokenizer.chat_template", "rope.scaling.type"), "a string")}
_CHECKS = {
    "a positive integer": lambda v: _is_int(v) and v > 0,
    "a positive number": lambda v: (_is_int(v) or isinstance(v, float)) and 0 < v < float("inf"),
    "an array of strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "an array of integers": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    "a token id (an integer >= 0)": lambda v: _is_int(v) and v >= 0,
    "a string": lambda v: isinstance(v, str),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value, checked against ``_KINDS``; ``default`` when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    kind = _KINDS.get(key) or _KINDS.get(key.split(".", 1)[-1])
    if kind is not None and not _CHECKS[kind](value):
        shown = repr(value) if len(repr(value)) < 60 else repr(value)[:57] + "..."
        raise GgufImportError(f"metadata key {key} is {shown}, expected {kind}")
    return value


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32
    (9.999999747378752e-06 → 1e-05, as the original config.json wrote it)."""
    return float(str(np.float32(value)))


def hf_config(reader: Any) -> dict[str, Any]:
    """config.json from the GGUF metadata; raises naming an unsupported architecture."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GgufImportError(f"general.architecture {arch!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)})")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise GgufImportError(f"metadata key {arch}.{key} is missing")
        return value

    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise GgufImportError(f"{arch}.rope.scaling.type {scaling!r} is not supported (supported: none, linear)")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    return config


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name the config implies → its (out, in) shape."""
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    per_layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                 "mlp.down_proj.weight": (h, inter)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def check_shapes(config: dict[str, Any], reader: Any) -> None:
    """Refuse, before dequantizing anything, a GGUF whose tensors do not match its own
    metadata (a layer missing or extra, a head count or vocab_size that disagrees): such a
    checkpoint would be written, cached, and fail only when a server loads it."""
    expected = expected_shapes(config)
    found = {hf_tensor_name(t.name): (t.name, tuple(int(d) for d in reversed(t.shape.tolist())))
             for t in reader.tensors}
    for name, (gguf_name, shape) in found.items():
        if name not in expected:
            raise GgufImportError(f"tensor {gguf_name!r} is beyond the metadata's model "
                                  f"({config['num_hidden_layers']} layers)")
        if shape != expected[name]:
            raise GgufImportError(f"tensor {gguf_name!r} has shape {list(shape)}, the metadata implies "
                                  f"{list(expected[name])} (hidden, heads, head_dim, vocab_size disagree)")
    missing = [n for n in expected if n not in found]
    if missing:
        raise GgufImportError(f"the GGUF lacks {len(missing)} tensor(s) its metadata implies, e.g. {missing[0]!r}")
    tokens = len(_field(reader, "tokenizer.ggml.tokens") or [])
    if tokens > config["vocab_size"]:
        raise GgufImportError(f"tokenizer.ggml.tokens has {tokens} tokens, more than vocab_size "
                              f"{config['vocab_size']}")


def tokenizer_files(reader: Any, chat_template: str | None) -> dict[str, dict[str, Any]]:
    """tokenizer.json, tokenizer_config.json and generation_config.json contents."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise GgufImportError("the GGUF carries no vocabulary (tokenizer.ggml.tokens)")
    types = _field(reader, "tokenizer.ggml.token_type") or []
    ids = {key: _field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "unknown", "padding")}
    special = special_token_names(tokens, {"bos": ids["bos"], "eos": ids["eos"], "unk": ids["unknown"],
                                           "pad": ids["padding"]})  # first: it checks the ids are in range
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and ids["bos"] is not None
    tokenizer = build_tokenizer_json(_field(reader, "tokenizer.ggml.model", ""), _field(reader, "tokenizer.ggml.pre",
                                     "default"), tokens, _field(reader, "tokenizer.ggml.merges") or [], types,
                                     bos_id=ids["bos"] if add_bos else None)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length", 2048)),
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                 for t in tokenizer["added_tokens"]},
        **special,
    }
    if chat_template:
        config["chat_template"] = chat_template
    generation = {k: v for k, v in (("bos_token_id", ids["bos"]), ("eos_token_id", ids["eos"]),
                                    ("pad_token_id", ids["padding"])) if v is not None}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config, "generation_config.json": generation}


def _chat_template(reader: Any) -> str | None:
    """The GGUF's template, or a tools-aware replacement for a known model
    (weft/models/chat_templates.py)."""
    template = _field(reader, "tokenizer.chat_template")
    try:
        from weft.models.chat_templates import tools_template_for
    except ImportError:  # pragma: no cover - shipped together
        return template
    return tools_template_for(str(_field(reader, "general.basename", "")), template) or template


def _readable_by_all(staging: Path) -> None:
    """mkdtemp makes 0700; a checkpoint is read by other users' processes (containers)."""
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    for f in staging.iterdir():
        f.chmod(0o666 & ~umask)


def _check_loads(staging: Path) -> None:
    """Load the written tokenizer the way the router will: merges naming tokens the
    vocabulary lacks, or a chat template jinja cannot compile, are refused here, not cached
    and found only when ``weft up`` exits during startup."""
    import jinja2

    from services.shared.tokenizer import Tokenizer

    try:
        Tokenizer.from_dir(staging)
    except (ValueError, jinja2.TemplateError) as exc:
        raise GgufImportError(f"the GGUF's tokenizer.ggml.* / tokenizer.chat_template do not make a loadable "
                              f"tokenizer: {exc}") from None


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Write the checkpoint of ``gguf_path`` into ``out_dir`` (created; replaced whole,
    atomically, so a crash never leaves half a checkpoint). Returns ``out_dir``. Raises
    ``GgufImportError`` naming an unsupported architecture, tensor or tensor type, and
    ``FileNotFoundError`` / ``ValueError`` for a missing or malformed file."""
    import gguf
    from safetensors import SafetensorError
    from safetensors.numpy import save_file
    from tqdm import tqdm

    path, out = Path(gguf_path), Path(out_dir).expanduser().absolute()  # absolute: "." has no name
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / "config.json").is_file())):
        # "replaced whole" is for an old checkpoint: `import-gguf x.gguf .` emptied the working directory
        raise FileExistsError(f"{out} exists and is not a checkpoint directory (no config.json); not replacing it: "
                              "name a new or empty directory")
    try:
        check_layout(path)  # before the reader: it trusts the header's counts (gguf_layout.py)
        reader = gguf.GGUFReader(path)
    except GgufImportError as exc:
        raise GgufImportError(f"{path} is not a readable GGUF file: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError / struct errors / IndexError on garbage
        raise GgufImportError(f"{path} is not a readable GGUF file: {exc}") from exc
    config = hf_config(reader)
    check_shapes(config, reader)
    files = tokenizer_files(reader, _chat_template(reader))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc=f"importing {path.name}", unit="tensor", disable=not progress):
        name = hf_tensor_name(tensor.name)
        weight = dequantize(tensor)
        if name.endswith("q_proj.weight"):
            weight = unpermute(weight, heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute(weight, kv_heads)
        tensors[name] = weight
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - tensors.keys()
    if missing:
        raise GgufImportError(f"the GGUF lacks tensor(s) {sorted(missing)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        try:
            save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt", "source": path.name})
        except SafetensorError as exc:  # not an OSError: a full disk was a traceback
            raise OSError(f"could not write the weights into {out.parent}: {exc}") from exc
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, content in files.items():
            (staging / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
        _check_loads(staging)
        _readable_by_all(staging)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out

"""Write small GGUF files the way llama.cpp's converter does, from a tiny Hugging Face
checkpoint: Q/K rows permuted per head, tensors quantized with the ``gguf`` package."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:-1])]}.weight"


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (what the importer undoes)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ckpt: Path, out: Path, qtype: Callable[[str, np.ndarray], str] = lambda name, w: "F32", *,
               arch: str = "llama", pre: str = "smollm", tokenizer_model: str = "gpt2", add_bos: bool | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF of ``ckpt`` whose tensor ``name`` is stored as ``qtype(name, weight)``."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((ckpt / "config.json").read_text())
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    weights = load_file(str(ckpt / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_vocab_size(config["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    for t in tok["added_tokens"]:
        if t["id"] >= len(vocab):
            vocab.append((t["content"], t["id"]))
    tokens = [t for t, _ in vocab]
    special = {t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(tokens.index(tok_config["bos_token"]) if tok_config.get("bos_token") else 1)
    w.add_eos_token_id(tokens.index(tok_config["eos_token"]))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if tok_config.get("chat_template"):
        w.add_chat_template(tok_config["chat_template"])
    for name, weight in weights.items():
        weight = weight.astype(np.float32)
        if name.endswith("q_proj.weight"):
            weight = permute(weight, heads)
        elif name.endswith("k_proj.weight"):
            weight = permute(weight, kv_heads)
        kind = gguf.GGMLQuantizationType[qtype(name, weight)]
        if kind is gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), weight)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(weight, kind), raw_dtype=kind)
    for name, weight in (extra_tensors or {}).items():
        w.add_tensor(name, weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

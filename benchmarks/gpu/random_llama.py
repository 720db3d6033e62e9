"""A random-weight Hugging Face Llama checkpoint for the GPU end-to-end benchmark
(bench_e2e.py): the shape (``LlamaShape``: the ~0.85 B ``BENCH_1B``, the tiny preset's
``SMOKE``) and ``write_checkpoint``, which writes config.json + model.safetensors with the
tokenizer files of a tiny checkpoint of matching vocabulary, or reuses a directory that
already holds the same config."""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face LlamaForCausalLM weight names and shapes (untied head)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,),
                  "lm_head.weight": (self.vocab_size, h)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                p + "mlp.up_proj.weight": (self.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, self.intermediate_size),
            })
        return shapes

    def num_parameters(self) -> int:
        total = 0
        for shape in self.tensor_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


BENCH_1B = LlamaShape(2048, 16, 32, 8, 5632, 32000)
SMOKE = LlamaShape(64, 2, 4, 2, 128, 1024)  # the tiny preset's shape


def write_checkpoint(model_dir: Path, shape: LlamaShape, dtype_name: str, seed: int) -> None:
    """config.json + model.safetensors in HF Llama format, tokenizer files from a tiny checkpoint."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from weft.testing.tiny_model import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tiny_dir:
        # The "bench" preset's tokenizer has 32000 ids, the "tiny" one 1024: match the vocab.
        preset = "bench" if shape.vocab_size >= 32000 else "tiny"
        make_tiny_checkpoint(tiny_dir, preset=preset, dtype="bfloat16")
        tiny_config = json.loads((Path(tiny_dir) / "config.json").read_text())
        config = dict(tiny_config)  # same spelling as the project's own checkpoints
        config.update({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": shape.hidden_size, "num_hidden_layers": shape.num_hidden_layers,
            "num_attention_heads": shape.num_attention_heads,
            "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
            "intermediate_size": shape.intermediate_size, "vocab_size": shape.vocab_size,
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "hidden_act": "silu", "torch_dtype": dtype_name,
        })
        config_text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        weights = model_dir / "model.safetensors"
        if (model_dir / "config.json").exists() and weights.exists() \
                and (model_dir / "config.json").read_text() == config_text:
            print(f"reusing checkpoint in {model_dir}", file=sys.stderr)
            return
        model_dir.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (Path(tiny_dir) / name).exists():
                shutil.copy(Path(tiny_dir) / name, model_dir / name)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shp in tqdm(sorted(shape.tensor_shapes().items()), desc="random weights", unit="tensor"):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shp, dtype=dtype)
            continue
        # Unit-variance activations: embeddings N(0, 1), linears N(0, 1 / fan_in).
        std = 1.0 if name == "model.embed_tokens.weight" else shp[1] ** -0.5
        values = torch.randn(shp, generator=gen, device=device, dtype=torch.float32) * std
        tensors[name] = values.to(dtype).cpu().contiguous()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(config_text)  # last: marks a complete checkpoint

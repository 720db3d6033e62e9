"""``weft.LLM``: offline batch generation in-process, shaped like vLLM's ``LLM``."""
from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence as Seq
from dataclasses import dataclass, fields
from pathlib import Path

from tqdm.auto import tqdm

from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.engine.sampling_params import SamplingParams
from services.shared.detokenizer import IncrementalDetokenizer
from services.shared.tokenizer import Tokenizer
from weft.models.sources import resolve_model


@dataclass(frozen=True)
class RequestOutput:
    """One finished request: generated ids and text, why it stopped, what the cache saved."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int
    logprobs: list[float] | None = None


class LLM:
    """Load a model and generate from it.

    ``model``: a Hugging Face checkpoint directory, a ``.gguf`` file or a named model
    (``"smollm2-135m-instruct"``); the last two are imported / pulled into the model cache
    (``cache_dir``, default ``$WEFT_CACHE_DIR`` else ``~/.cache/weft``) the first time only
    (``weft/models/sources.py``). ``model_dir`` is the directory actually loaded.
    ``engine_options`` are ``EngineConfig`` fields (``device``, ``dtype``,
    ``attention_backend``, ``block_size``, ``num_kv_blocks``, ``max_num_seqs``, ...).
    """

    def __init__(self, model: str | Path, *, cache_dir: str | Path | None = None, **engine_options) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(known)}")
        model = resolve_model(model, Path(cache_dir) if cache_dir is not None else None)
        self.model_dir = model
        self.engine = LLMEngine(model, EngineConfig(**engine_options))
        self.tokenizer = Tokenizer.from_dir(model)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Seq[str] | Seq[int] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) and return outputs in prompt order.
        ``use_tqdm``: a progress bar; None shows it when stderr is a terminal."""
        if use_tqdm is None:
            use_tqdm = sys.stderr.isatty()
        batch = self._normalise(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(batch) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(batch):
            raise ValueError(f"got {len(params)} sampling params for {len(batch)} prompts")
        request_ids = [f"llm-{next(self._ids)}" for _ in batch]
        for rid, ids, p in zip(request_ids, batch, params):
            self.engine.add_request(rid, ids, p)
        tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
        logprobs: dict[str, list[float]] = {rid: [] for rid in request_ids}
        finals = {}
        bar = tqdm(total=len(batch), desc="generate", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished_requests:
            for out in self.engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                logprobs[out.request_id].extend(out.new_logprobs)
                if out.finished:
                    finals[out.request_id] = out
                    bar.update(1)
        bar.close()
        results = []
        for rid, ids, p in zip(request_ids, batch, params):
            out = finals[rid]
            detok = IncrementalDetokenizer(self.tokenizer)
            text = detok.push(tokens[rid]) + detok.flush()
            results.append(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=ids,
                    token_ids=tokens[rid],
                    text=text,
                    finish_reason=out.finish_reason.value,
                    num_cached_tokens=out.num_cached_tokens,
                    logprobs=logprobs[rid] if p.logprobs else None,
                )
            )
        return results

    def _normalise(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str):
            return [self.tokenizer.encode(prompts)]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]

"""Weft: an LLM inference engine for AI-agent workloads.

    from weft import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.0))

Names are imported lazily so that ``weft.v1`` (generated protos) and the CLI load
without pulling in torch.
"""
from __future__ import annotations

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "SamplingParams":
        from services.executor.engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("LLM", "RequestOutput"):
        from services.executor.process_env import apply_executor_env

        apply_executor_env()  # the executor's OpenMP / huge-page settings, if torch is not loaded yet
        from weft import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'weft' has no attribute {name!r}")

"""Weft: an LLM inference engine for AI-agent workloads.

    from weft import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.0))
"""
from services.executor.sampling_params import SamplingParams
from weft.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

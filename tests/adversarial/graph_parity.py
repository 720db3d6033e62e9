"""Shared by the CUDA-graph attack files (test_cuda_graph_attacks.py,
test_cuda_graph_run_attacks.py): a tiny checkpoint, an engine config on the interpreted
Triton back end, and a driver that runs one schedule of adds and aborts through an engine,
eager or with graphs captured by ``eager_capture``, recording everything it streams."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.executor.engine.config import EngineConfig
from services.executor.engine.cuda_graphs import eager_capture
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import FinishReason, SessionOptions
from weft.testing.tiny_model import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1024  # the "tiny" preset's


def tiny_checkpoint(tmp_path_factory) -> Path:
    """The "tiny" preset's checkpoint in a fresh temp dir (a module-scoped fixture's body)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("graph-attacks") / "tiny", preset="tiny", arch="llama")


def config(**extra) -> EngineConfig:
    options = dict(attention_backend="triton", device="cpu", block_size=16, max_model_len=128, num_kv_blocks=48,
                   max_num_seqs=8, max_prefill_chunk=64, max_num_batched_tokens=128)
    options.update(extra)
    return EngineConfig(**options)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 37 + 13 * i) % (VOCAB - 10) + 5 for i in range(n)]


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


class Trace:
    """What a graphs-on engine did, step by step: each execute's decode rows, prefill
    chunks, widest block list, whether every decode row sampled, whether it replayed,
    and whether a replayed row had evicted tokens (KV compression)."""

    def __init__(self, engine: LLMEngine) -> None:
        runner = self.runner = engine.runner
        self.steps: list[dict] = []
        self.replay_sizes: list[int] = []
        real_execute, graphs = runner.execute, runner.graphs
        real_run = graphs.run

        def run(tokens, seq_lens, tables):
            self.replay_sizes.append(tokens.shape[1])
            return real_run(tokens, seq_lens, tables)

        def execute(plan):
            before = graphs.num_replays
            items = plan.decodes + plan.prefills
            step = dict(decodes=len(plan.decodes), prefills=len(plan.prefills),
                        blocks=max(len(s.seq.blocks) for s in items) if items else 0,
                        all_sample=all(d.samples for d in plan.decodes),
                        evicted=any(d.seq.num_evicted_tokens for d in plan.decodes))
            result = real_execute(plan)
            step["replayed"] = graphs.num_replays > before
            self.steps.append(step)
            return result

        graphs.run = run  # instance attributes: the runner calls these
        runner.execute = execute

    @property
    def replayed(self) -> list[dict]:
        return [s for s in self.steps if s["replayed"]]

    @property
    def eager_decode_only(self) -> list[dict]:
        return [s for s in self.steps if s["decodes"] and not s["prefills"] and not s["replayed"]]


def graphed(engine: LLMEngine, max_batch: int | None = None, width: int | None = None) -> Trace:
    c = engine.config
    engine.runner.capture_decode_graphs(max_batch or c.max_num_seqs,
                                        width or -(-engine.max_model_len // c.block_size), capture=eager_capture)
    return Trace(engine)


def drive(engine: LLMEngine, schedule: dict[int, list[tuple]], hooks: dict | None = None,
           max_steps: int = 200) -> dict[str, dict]:
    """Step ``engine`` until it is idle and no action is left. ``schedule``: step index ->
    actions run before that step, ``("add", rid, prompt, params[, session])`` or
    ``("abort", rid)``; ``hooks``: step index -> f(engine), run before that step."""
    hooks = hooks or {}
    got: dict[str, dict] = {}
    last = max(list(schedule) + list(hooks))
    for step in range(max_steps):
        for action in schedule.get(step, ()):
            if action[0] == "add":
                rid, prompt, params, *session = action[1:]
                engine.add_request(rid, prompt, params, session=session[0] if session else SessionOptions())
                got[rid] = dict(tokens=[], logprobs=[], top=[], prompt=[], prompt_top=[], finish=None,
                                entropy=None, cached=None)
            else:
                assert engine.abort_request(action[1]), f"{action[1]} was not running at step {step}"
                got[action[1]]["finish"] = FinishReason.ABORT
        if step in hooks:
            hooks[step](engine)
        if step > last and not engine.has_unfinished_requests:
            return got
        for out in engine.step():
            r = got[out.request_id]
            r["tokens"] += out.new_token_ids
            r["logprobs"] += out.new_logprobs
            r["top"] += out.new_top_logprobs
            r["prompt"] += out.prompt_logprobs
            r["prompt_top"] += out.prompt_top_logprobs
            if out.finished:
                r["finish"], r["entropy"], r["cached"] = out.finish_reason, out.mean_entropy, out.num_cached_tokens
    raise AssertionError(f"not idle after {max_steps} steps")


def assert_same(got: dict[str, dict], want: dict[str, dict]) -> None:
    assert got.keys() == want.keys()
    for rid, w in want.items():
        g = got[rid]
        assert g["tokens"] == w["tokens"], f"{rid}: tokens differ"
        assert g["finish"] == w["finish"], f"{rid}: finish reason differs"
        torch.testing.assert_close(g["logprobs"], w["logprobs"], atol=1e-4, rtol=1e-4, msg=f"{rid}: logprobs")
        torch.testing.assert_close(g["prompt"], w["prompt"], atol=1e-4, rtol=1e-4, msg=f"{rid}: prompt logprobs")
        for key in ("top", "prompt_top"):
            assert [[t for t, _ in alt] for alt in g[key]] == [[t for t, _ in alt] for alt in w[key]], \
                f"{rid}: {key} logprob ids differ"
            torch.testing.assert_close([[v for _, v in alt] for alt in g[key]],
                                       [[v for _, v in alt] for alt in w[key]], atol=1e-4, rtol=1e-4)
        if w["entropy"] is not None:
            assert g["entropy"] == pytest.approx(w["entropy"], abs=1e-4), f"{rid}: entropy"


def both(tiny, schedule, hooks=None, capture=None, **options) -> tuple[dict, dict, LLMEngine, Trace]:
    """(graphs-on results, eager results, the graphs engine, its trace)."""
    want = drive(LLMEngine(tiny, config(**options)), schedule)
    engine = LLMEngine(tiny, config(**options))
    trace = graphed(engine, **(capture or {}))
    got = drive(engine, schedule, hooks)
    return got, want, engine, trace


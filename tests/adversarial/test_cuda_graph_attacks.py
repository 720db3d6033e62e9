"""Decode steps replayed from CUDA graphs (services/executor/engine/cuda_graphs.py), attacked
as a hostile client and an unlucky operator would.

No GPU is needed: each engine here captures with ``eager_capture``, which re-runs the
captured step on every replay into the same output tensor, so the static-buffer
bookkeeping (padding to a bucket, stale rows, output slices, the fall-back to eager steps)
runs on CPU with the Triton kernels interpreted. Every engine-level test drives two
engines through the same schedule, one eager and one with graphs, and asks for the same
tokens, finish reasons, logprobs, top logprobs and entropies:

- sampled, penalised, biased, stop-token and entropy-tracked rows mixed in one batch whose
  size is not a bucket, shrinking as rows finish;
- requests arriving and aborted between decode steps (padded replays after larger ones),
  a 1-token prompt and a prefix hit leaving 1 token, both scheduled as decode rows of a
  replayed step; a padding row whose stale slot lies in a block since cached for another
  prompt (a later prefix hit reads it);
- rows wider than the captured tables and steps with more rows than the largest bucket
  (eager), then replays again;
- preemption and recompute in a tiny pool, KV compression (oldest policy) with evicted
  tokens, an int8 KV cache;
- graphs captured while requests run; a prefill trickling in one token a step beside
  decodes (a decode row that does not sample: never replayed); a row reaching
  max_model_len; a capture failing half way (the engine stays eager).

Then ``DecodeGraphs.run`` misused directly, the ``cuda_graphs`` option on a CPU engine and
the executor's ``--cuda-graphs`` flag.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.executor.config import DESCRIPTION, ExecutorConfig
from services.executor.engine.config import EngineConfig
from services.executor.engine.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs, eager_capture
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
from services.executor.engine.sequence import FinishReason, SessionOptions
from services.mesh import mesh_auth
from services.mesh.env_config import load_config
from weft import LLM
from weft.testing.tiny_model import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1024  # the "tiny" preset's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("graph-attacks") / "tiny", preset="tiny", arch="llama")


def _config(**extra) -> EngineConfig:
    options = dict(attention_backend="triton", device="cpu", block_size=16, max_model_len=128, num_kv_blocks=48,
                   max_num_seqs=8, max_prefill_chunk=64, max_num_batched_tokens=128)
    options.update(extra)
    return EngineConfig(**options)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 37 + 13 * i) % (VOCAB - 10) + 5 for i in range(n)]


def _greedy(max_tokens: int, **extra) -> SamplingParams:
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


def _graphed(engine: LLMEngine, max_batch: int | None = None, width: int | None = None) -> Trace:
    c = engine.config
    engine.runner.capture_decode_graphs(max_batch or c.max_num_seqs,
                                        width or -(-engine.max_model_len // c.block_size), capture=eager_capture)
    return Trace(engine)


def _drive(engine: LLMEngine, schedule: dict[int, list[tuple]], hooks: dict | None = None,
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


def _assert_same(got: dict[str, dict], want: dict[str, dict]) -> None:
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


def _both(tiny, schedule, hooks=None, capture=None, **options) -> tuple[dict, dict, LLMEngine, Trace]:
    """(graphs-on results, eager results, the graphs engine, its trace)."""
    want = _drive(LLMEngine(tiny, _config(**options)), schedule)
    engine = LLMEngine(tiny, _config(**options))
    trace = _graphed(engine, **(capture or {}))
    got = _drive(engine, schedule, hooks)
    return got, want, engine, trace


# -- engine-level parity -------------------------------------------------------------------

def test_a_batch_mixing_greedy_sampled_penalised_and_stopping_rows_matches_eager(tiny):
    """8 rows (bucket 8), shrinking to 7, 6, ... as rows stop: seeded temperature / top-p /
    top-k / min-p draws, logprobs with alternatives, penalties, a logit bias (one on a
    token outside the vocabulary: ignored), a forced stop token after min_tokens, a row
    tracking entropy, a regex-constrained row."""
    rows = [
        _greedy(8),
        _greedy(7, logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, logprobs=True, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.3, top_k=20, min_p=0.05, seed=5, top_logprobs=2, ignore_eos=True),
        _greedy(8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7,
                logit_bias={3: 5.0, 9: -100.0, VOCAB + 50: 40.0}, logprobs=True),
        _greedy(8, logit_bias={7: 100.0}, stop_token_ids=(7,), min_tokens=3),
        _greedy(5),
        SamplingParams(max_tokens=8, temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{2,4}-[a-z]{1,3}")),
    ]
    schedule = {0: [("add", f"r{i}", _prompt(4 + 3 * i, i), p) for i, p in enumerate(rows)]}
    schedule[0][6] = schedule[0][6] + (SessionOptions(track_entropy=True),)

    got, want, engine, trace = _both(tiny, schedule)

    _assert_same(got, want)
    assert got["r5"]["tokens"] == [7, 7, 7] and got["r5"]["finish"] is FinishReason.STOP
    assert got["r6"]["entropy"] > 0
    assert got["r7"]["finish"] is FinishReason.STOP  # the grammar ended it
    assert len(trace.replayed) >= 5  # every step after the first prefill batch
    assert 7 in trace.replay_sizes and any(n not in engine.runner.graphs.buckets for n in trace.replay_sizes)


def test_requests_arriving_and_aborted_between_replays_match_eager(tiny):
    """The batch grows 3 -> 5, loses two rows to aborts, gains a 1-token prompt and a
    prefix hit that leaves 1 token (both scheduled as decode rows of a replayed step),
    shrinks as rows finish, then grows again."""
    a = _prompt(17, 1)
    schedule = {
        0: [("add", "a", a, _greedy(10)),
            ("add", "b", _prompt(5, 2), SamplingParams(max_tokens=9, temperature=0.7, seed=3, ignore_eos=True)),
            ("add", "c", _prompt(9, 3), _greedy(3, logprobs=True))],
        3: [("add", "d", _prompt(6, 4), _greedy(8)), ("add", "e", _prompt(20, 5), _greedy(6)),
            ("add", "f", _prompt(3, 6), _greedy(7, top_logprobs=2))],
        5: [("abort", "b"), ("add", "g", [42], SamplingParams(max_tokens=6, temperature=1.0, seed=9,
                                                                 ignore_eos=True))],
        6: [("abort", "d"), ("add", "h", a[:16] + [999], _greedy(5, logprobs=True))],
        11: [("add", "i", [77], _greedy(3)), ("add", "j", [78], _greedy(2)), ("add", "k", [79], _greedy(2))],
    }

    got, want, engine, trace = _both(tiny, schedule)

    _assert_same(got, want)
    assert got["b"]["finish"] is FinishReason.ABORT and got["d"]["finish"] is FinishReason.ABORT
    assert got["h"]["tokens"] and got["g"]["tokens"]
    sizes = trace.replay_sizes
    # a padded replay after a larger one, then a larger one again
    assert any(sizes[i] > sizes[j] < sizes[k] for i in range(len(sizes))
               for j in range(i + 1, len(sizes)) for k in range(j + 1, len(sizes)))


def test_a_padding_row_never_rewrites_a_freed_slot_that_a_later_prefix_hit_reads(tiny):
    """A 4-row replay, then D (row 3) is aborted and its block handed to E's prompt, which
    is cached when E finishes; the next replay has 3 rows in bucket 4, so static row 3
    still holds D's slot. Were it not padded, that replay would rewrite E's cached KV, and
    F, hitting all of E's blocks, would read the damage (its logprobs would differ)."""
    e = _prompt(64, 9)
    schedule = {0: [("add", c, _prompt(3, i), _greedy(4)) for i, c in enumerate("ABC")]
                + [("add", "D", _prompt(3, 5), _greedy(10))],
                2: [("abort", "D"), ("add", "E", e, _greedy(1))],
                4: [("add", "F", e + [1, 2, 3, 4, 5], _greedy(3, logprobs=True))]}
    blocks = {}
    hooks = {1: lambda eng: blocks.setdefault("D", eng.requests["D"].blocks[0].block_id),
             5: lambda eng: blocks.setdefault("F", [b.block_id for b in eng.requests["F"].blocks[:4]])}

    got, want, engine, trace = _both(tiny, schedule, hooks=hooks, num_kv_blocks=7, max_num_seqs=4)

    _assert_same(got, want)
    assert trace.replay_sizes[:2] == [4, 3]  # step 1: A B C D; step 3: A B C, padded to 4
    assert got["F"]["cached"] == 64 and blocks["D"] in blocks["F"]  # F read the block D's row pointed at


def test_rows_wider_than_the_captured_tables_or_past_the_largest_bucket_run_eagerly(tiny):
    """Graphs for up to 2 rows of up to 2 blocks (32 tokens): 3-row steps and a row that
    grows to a third block run eagerly, the others replay, and a request sent afterwards
    replays again; all with the eager engine's tokens."""
    schedule = {0: [("add", "long", _prompt(28, 1), _greedy(8, logprobs=True)),
                    ("add", "short", _prompt(5, 2), _greedy(3)),
                    ("add", "mid", _prompt(6, 3), SamplingParams(max_tokens=5, temperature=0.9, seed=4,
                                                                  ignore_eos=True))],
                9: [("add", "after", _prompt(7, 4), _greedy(3))]}

    got, want, engine, trace = _both(tiny, schedule, capture=dict(max_batch=2, width=2), max_num_seqs=4)

    _assert_same(got, want)
    assert engine.runner.graphs.buckets == (1, 2)
    eager = trace.eager_decode_only
    assert any(s["decodes"] == 3 for s in eager)  # more rows than the largest bucket
    assert any(s["decodes"] <= 2 and s["blocks"] == 3 for s in eager)  # wider than the captured tables
    assert all(s["decodes"] <= 2 and s["blocks"] <= 2 for s in trace.replayed)
    assert trace.steps[-1]["replayed"]  # "after" alone: graphs again after eager steps


def test_preemption_and_recompute_in_a_tiny_pool_match_eager(tiny):
    """7 blocks for 4 sequences that each grow to 2: a sequence is preempted, recomputed
    once others finish, and decodes again from replays."""
    schedule = {0: [("add", f"p{i}", _prompt(12, 10 + i), _greedy(10)) for i in range(3)]
                + [("add", "p3", _prompt(12, 13), SamplingParams(max_tokens=10, temperature=0.8, seed=2,
                                                                  logprobs=True, ignore_eos=True))]}

    got, want, engine, trace = _both(tiny, schedule, num_kv_blocks=7, max_num_seqs=4)

    _assert_same(got, want)
    assert engine.num_preemptions > 0
    assert all(len(r["tokens"]) == 10 for r in got.values())
    assert len(trace.replayed) >= 5


def test_kv_compression_by_the_oldest_policy_matches_eager(tiny):
    """Budget 2 blocks (no sink, 1 recent): the 40-token prompt loses a block after its
    prefill and more while it decodes; replayed rows attend over caches with evicted
    tokens (cache index = position - evicted)."""
    schedule = {0: [("add", "long", _prompt(40, 1), _greedy(14, logprobs=True)),
                    ("add", "short", _prompt(20, 2), SamplingParams(max_tokens=14, temperature=0.9, seed=6,
                                                                     top_logprobs=2, ignore_eos=True))]}

    got, want, engine, trace = _both(tiny, schedule, kv_compress_budget_blocks=2, kv_compress_sink_blocks=0,
                                     kv_compress_recent_blocks=1, kv_compress_policy="oldest")

    _assert_same(got, want)
    assert engine.num_compressed_blocks >= 2
    assert any(s["evicted"] for s in trace.replayed)


def test_a_row_reaching_max_model_len_replays_at_the_full_captured_width(tiny):
    """max_model_len 40 is not a multiple of the block size: the engine's width is 3 blocks
    and the last one is never full; a row runs up to the context limit (LENGTH) in
    replays that use every column of the static tables."""
    schedule = {0: [("add", "edge", _prompt(30, 1), _greedy(20, logprobs=True)),
                    ("add", "tiny", _prompt(2, 2), _greedy(4))]}

    got, want, engine, trace = _both(tiny, schedule, max_model_len=40)

    _assert_same(got, want)
    assert engine.runner.graphs.max_blocks_per_seq == 3
    assert got["edge"]["finish"] is FinishReason.LENGTH and len(got["edge"]["tokens"]) == 10
    assert any(s["blocks"] == 3 for s in trace.replayed)


def test_an_int8_kv_cache_with_sampled_and_logprob_rows_matches_eager(tiny):
    schedule = {0: [("add", "x", _prompt(9, 1), _greedy(5, logprobs=True, top_logprobs=2)),
                    ("add", "y", _prompt(18, 2), SamplingParams(max_tokens=4, temperature=0.7, top_p=0.8, seed=1,
                                                                 logprobs=True, ignore_eos=True)),
                    ("add", "z", _prompt(3, 3), _greedy(3, frequency_penalty=1.0))]}

    got, want, engine, trace = _both(tiny, schedule, kv_cache_dtype="int8")

    _assert_same(got, want)
    assert 3 in trace.replay_sizes  # bucket 4, one padding row


def test_graphs_captured_while_requests_run_write_no_kv_and_keep_their_tokens(tiny):
    """An operator turning graphs on mid-generation (twice): capturing runs every bucket's
    step over padding rows only, so the running sequences' KV is untouched, and their
    next steps replay with the eager engine's tokens."""
    schedule = {0: [("add", f"m{i}", _prompt(6 + 5 * i, 20 + i), _greedy(7)) for i in range(3)]}
    want = _drive(LLMEngine(tiny, _config()), schedule)
    engine = LLMEngine(tiny, _config())
    traces = []

    def capture(engine: LLMEngine) -> None:
        before = [c.clone() for c in engine.runner.kv_caches]
        traces.append(_graphed(engine))
        traces.append(_graphed(engine))  # a second capture replaces the first
        for old, new in zip(before, engine.runner.kv_caches):
            assert torch.equal(old, new)

    got = _drive(engine, schedule, hooks={3: capture})

    _assert_same(got, want)
    assert not traces[0].replayed and len(traces[1].replayed) >= 3


def test_a_prefill_trickling_one_token_a_step_beside_decodes_is_never_replayed(tiny):
    """A budget of 4 tokens and 3 running rows leave 1 token a step for a new prompt: its
    chunks are 1-token decode rows that do not sample, so those steps must run eagerly;
    its last chunk samples and replays with the others (its prompt logprobs, recorded by
    the eager chunks, are whole). The first step (three 1-token prompts, all decode rows)
    replays."""
    schedule = {0: [("add", f"s{i}", [100 + i], _greedy(12)) for i in range(3)],
                2: [("add", "late", _prompt(8, 7), _greedy(3, logprobs=True, prompt_logprobs=2))]}

    got, want, engine, trace = _both(tiny, schedule, max_num_batched_tokens=4, max_prefill_chunk=4, max_num_seqs=4)

    _assert_same(got, want)
    assert trace.steps[0]["replayed"] and trace.steps[0]["decodes"] == 3
    trickling = [s for s in trace.steps if not s["all_sample"]]
    assert len(trickling) == 7 and not any(s["replayed"] for s in trickling)
    assert 4 in trace.replay_sizes
    assert len(got["late"]["prompt"]) == 7 and all(len(alt) == 2 for alt in got["late"]["prompt_top"])


# -- DecodeGraphs.run misused ---------------------------------------------------------------

@pytest.fixture(scope="module")
def small_graphs(tiny):
    """Graphs of buckets (1, 2) over tables 2 blocks wide, on an engine's caches."""
    engine = LLMEngine(tiny, _config(num_kv_blocks=16))
    graphs = DecodeGraphs(engine.runner.model, engine.runner.kv_caches, max_batch=2, max_blocks_per_seq=2)
    graphs.capture(eager_capture)
    return graphs


def _rows(n: int, block0: int = 1):
    """n decode rows at position 3 of 2-block tables (blocks block0 + 2i, block0 + 2i + 1)."""
    tables = torch.tensor([[block0 + 2 * i, block0 + 2 * i + 1] for i in range(n)], dtype=torch.int32)
    tokens = torch.tensor([[5 + i for i in range(n)], [3] * n, [(block0 + 2 * i) * 16 + 3 for i in range(n)]])
    return tokens, torch.full((n,), 4, dtype=torch.int32), tables


def _clear(graphs: DecodeGraphs) -> None:
    for cache in graphs.kv_caches:
        cache.zero_()


def test_run_refuses_more_rows_than_its_largest_bucket_by_name(small_graphs):
    """``covers`` keeps the runner from asking, but a caller that does must be told why
    (a ValueError naming the largest bucket), not get ``IndexError: tuple index out of
    range`` from the bucket lookup."""
    with pytest.raises(ValueError, match="bucket"):
        small_graphs.run(*_rows(3))


def test_run_refuses_tables_wider_than_it_captured_by_name(small_graphs):
    """A ValueError naming the captured width, not torch's size-mismatch RuntimeError from
    the copy into the static [B, W] tables (which names neither)."""
    tokens, seq_lens, tables = _rows(1)
    with pytest.raises(ValueError, match="blocks|wide|width"):
        small_graphs.run(tokens, seq_lens, torch.cat([tables, tables], dim=1))


@pytest.mark.parametrize("bad", ["seq_lens", "tables", "tokens"])
def test_run_refuses_inputs_whose_rows_do_not_match(small_graphs, bad):
    """``copy_`` into the static buffers broadcasts: unchecked, a one-row ``seq_lens`` or
    ``tables`` is silently repeated over every row (each row attends over row 0's blocks
    and length), and a one-row ``tokens`` ([1, n]) is copied into the ids, the positions
    AND the slots (each row's KV is written at the slot numbered by its token id, in
    another sequence's block). The shapes must be checked before anything is copied."""
    tokens, seq_lens, tables = _rows(2)
    args = dict(tokens=tokens, seq_lens=seq_lens, tables=tables)
    args[bad] = args[bad][:1]
    _clear(small_graphs)
    with pytest.raises(ValueError):
        small_graphs.run(**args)
    for cache in small_graphs.kv_caches:  # refused before anything was written
        assert not cache.any()


def test_run_before_capture_says_it_was_not_captured(tiny):
    """A RuntimeError saying nothing was captured, not ``KeyError: 1`` (the bucket's
    missing graph)."""
    engine = LLMEngine(tiny, _config(num_kv_blocks=16))
    graphs = DecodeGraphs(engine.runner.model, engine.runner.kv_caches, max_batch=2, max_blocks_per_seq=2)
    with pytest.raises(RuntimeError, match="captur"):
        graphs.run(*_rows(1))


def test_a_refused_run_leaves_no_live_slot_for_the_next_replay(small_graphs):
    """Whatever the error, a run that fails after copying some rows must not leave a real
    slot in the static buffers that the next (smaller) replay writes KV to."""
    tokens, seq_lens, tables = _rows(2)
    with pytest.raises(Exception):  # noqa: B017 - any error: only what it leaves behind matters here
        small_graphs.run(tokens, seq_lens, torch.cat([tables, tables], dim=1))
    _clear(small_graphs)
    small_graphs.run(*_rows(1, block0=9))
    row1_block = int(tables[1, 0])
    for cache in small_graphs.kv_caches:
        assert not cache[:, row1_block].any()  # the refused call's second row wrote nothing
        assert cache[:, 9, 3].any()  # the real row did


def test_an_empty_run_returns_no_rows_and_writes_no_kv(small_graphs):
    small_graphs.run(*_rows(2))  # rows 0 and 1 of the static buffers now hold real slots
    _clear(small_graphs)
    out = small_graphs.run(torch.zeros((3, 0), dtype=torch.int64), torch.zeros(0, dtype=torch.int32),
                           torch.zeros((0, 2), dtype=torch.int32))
    assert out.shape == (0, VOCAB)
    for cache in small_graphs.kv_caches:
        assert not cache.any()


def test_buckets_stop_at_max_graph_batch_and_larger_steps_are_not_covered(tiny):
    """An operator's max_num_seqs of 1000: buckets up to MAX_GRAPH_BATCH only (a stand-in
    capture that runs nothing: 35 interpreted forwards would take minutes)."""
    engine = LLMEngine(tiny, _config(num_kv_blocks=16))
    graphs = DecodeGraphs(engine.runner.model, engine.runner.kv_caches, max_batch=1000, max_blocks_per_seq=4)
    assert graphs.buckets[-1] == MAX_GRAPH_BATCH and graphs._tokens.shape == (3, MAX_GRAPH_BATCH)
    graphs.capture(lambda step: (lambda: None, torch.zeros((MAX_GRAPH_BATCH, VOCAB))))
    assert graphs.covers(MAX_GRAPH_BATCH, 4) and graphs.covers(3, 1)
    assert not graphs.covers(MAX_GRAPH_BATCH + 1, 1) and not graphs.covers(5, 5)


# -- the operator's switch -------------------------------------------------------------------

@pytest.mark.parametrize("options", [
    dict(),  # the CPU default: the torch back end
    dict(attention_backend="triton", kv_cache_dtype="int8"),
    dict(attention_backend="triton", kv_compress_budget_blocks=4, kv_compress_recent_blocks=2),
], ids=["torch", "triton-int8", "triton-attention-compression"])
def test_cuda_graphs_on_a_cpu_engine_captures_nothing_and_still_generates(tiny, options):
    llm = LLM(tiny, cuda_graphs=True, device="cpu", num_kv_blocks=16, max_num_seqs=2, **options)
    assert llm.engine.runner.graphs is None
    out = llm.generate([_prompt(5, 1)], _greedy(2), use_tqdm=False)
    assert len(out[0].token_ids) == 2


def test_a_capture_failing_half_way_leaves_the_engine_eager_and_correct(tiny, monkeypatch):
    """An unlucky GPU: the largest bucket captures, the next one fails (out of memory).
    The engine must log it and stay eager: no half-captured graphs left on the runner.
    (The engine only tries on CUDA: its device check is shown "cuda" for the call, the
    capture itself runs on CPU through ``eager_capture``.)"""
    schedule = {0: [("add", "q", _prompt(5, 1), _greedy(3)), ("add", "w", _prompt(7, 2), _greedy(3))]}
    want = _drive(LLMEngine(tiny, _config(max_num_seqs=4)), schedule)
    engine = LLMEngine(tiny, _config(max_num_seqs=4))
    captured = []

    def flaky(step):
        if captured:
            raise RuntimeError("CUDA error: out of memory")
        captured.append(step)
        return eager_capture(step)

    real_capture = engine.runner.capture_decode_graphs

    def capture_on_cpu(max_batch, width, capture=None):
        monkeypatch.setattr(engine.model, "device", torch.device("cpu"))
        return real_capture(max_batch, width, capture=flaky)

    monkeypatch.setattr(engine.runner, "capture_decode_graphs", capture_on_cpu)
    monkeypatch.setattr(engine.model, "device", torch.device("cuda"))
    engine._capture_decode_graphs(track_block_scores=False)

    assert len(captured) == 1 and engine.runner.graphs is None
    assert engine.model.device.type == "cpu"
    _assert_same(_drive(engine, schedule), want)


def test_the_executor_flag_and_env_turn_cuda_graphs_on(tiny, monkeypatch):
    monkeypatch.setattr(mesh_auth, "_current", mesh_auth._current)  # load_config configures it: restored after
    help_text = subprocess.run([sys.executable, "-m", "services.executor", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120, check=True).stdout
    assert "--cuda-graphs" in help_text and "--no-cuda-graphs" in help_text
    argv = ["--model-dir", str(tiny)]
    assert not load_config(ExecutorConfig, "executor", DESCRIPTION, argv, environ={}).engine_config.cuda_graphs
    assert load_config(ExecutorConfig, "executor", DESCRIPTION, argv + ["--cuda-graphs"],
                       environ={}).engine_config.cuda_graphs
    assert load_config(ExecutorConfig, "executor", DESCRIPTION, argv,
                       environ={"WEFT_EXECUTOR_CUDA_GRAPHS": "on"}).engine_config.cuda_graphs
    with pytest.raises(SystemExit):
        load_config(ExecutorConfig, "executor", DESCRIPTION, argv, environ={"WEFT_EXECUTOR_CUDA_GRAPHS": "maybe"})

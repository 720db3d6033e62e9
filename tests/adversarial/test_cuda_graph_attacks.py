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

``DecodeGraphs.run`` misused directly, the ``cuda_graphs`` option on a CPU engine and the
executor's ``--cuda-graphs`` flag: test_cuda_graph_run_attacks.py. Shared helpers:
graph_parity.py.
"""
from __future__ import annotations

import pytest
import torch

from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
from services.executor.engine.sequence import FinishReason, SessionOptions
from tests.adversarial.graph_parity import (
    VOCAB, assert_same, both, config, drive, graphed, greedy, prompt, tiny_checkpoint)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


# -- engine-level parity -------------------------------------------------------------------

def test_a_batch_mixing_greedy_sampled_penalised_and_stopping_rows_matches_eager(tiny):
    """8 rows (bucket 8), shrinking to 7, 6, ... as rows stop: seeded temperature / top-p /
    top-k / min-p draws, logprobs with alternatives, penalties, a logit bias (one on a
    token outside the vocabulary: ignored), a forced stop token after min_tokens, a row
    tracking entropy, a regex-constrained row."""
    rows = [
        greedy(8),
        greedy(7, logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, logprobs=True, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.3, top_k=20, min_p=0.05, seed=5, top_logprobs=2, ignore_eos=True),
        greedy(8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7,
                logit_bias={3: 5.0, 9: -100.0, VOCAB + 50: 40.0}, logprobs=True),
        greedy(8, logit_bias={7: 100.0}, stop_token_ids=(7,), min_tokens=3),
        greedy(5),
        SamplingParams(max_tokens=8, temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{2,4}-[a-z]{1,3}")),
    ]
    schedule = {0: [("add", f"r{i}", prompt(4 + 3 * i, i), p) for i, p in enumerate(rows)]}
    schedule[0][6] = schedule[0][6] + (SessionOptions(track_entropy=True),)

    got, want, engine, trace = both(tiny, schedule)

    assert_same(got, want)
    assert got["r5"]["tokens"] == [7, 7, 7] and got["r5"]["finish"] is FinishReason.STOP
    assert got["r6"]["entropy"] > 0
    assert got["r7"]["finish"] is FinishReason.STOP  # the grammar ended it
    assert len(trace.replayed) >= 5  # every step after the first prefill batch
    assert 7 in trace.replay_sizes and any(n not in engine.runner.graphs.buckets for n in trace.replay_sizes)


def test_requests_arriving_and_aborted_between_replays_match_eager(tiny):
    """The batch grows 3 -> 5, loses two rows to aborts, gains a 1-token prompt and a
    prefix hit that leaves 1 token (both scheduled as decode rows of a replayed step),
    shrinks as rows finish, then grows again."""
    a = prompt(17, 1)
    schedule = {
        0: [("add", "a", a, greedy(10)),
            ("add", "b", prompt(5, 2), SamplingParams(max_tokens=9, temperature=0.7, seed=3, ignore_eos=True)),
            ("add", "c", prompt(9, 3), greedy(3, logprobs=True))],
        3: [("add", "d", prompt(6, 4), greedy(8)), ("add", "e", prompt(20, 5), greedy(6)),
            ("add", "f", prompt(3, 6), greedy(7, top_logprobs=2))],
        5: [("abort", "b"), ("add", "g", [42], SamplingParams(max_tokens=6, temperature=1.0, seed=9,
                                                                 ignore_eos=True))],
        6: [("abort", "d"), ("add", "h", a[:16] + [999], greedy(5, logprobs=True))],
        11: [("add", "i", [77], greedy(3)), ("add", "j", [78], greedy(2)), ("add", "k", [79], greedy(2))],
    }

    got, want, engine, trace = both(tiny, schedule)

    assert_same(got, want)
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
    e = prompt(64, 9)
    schedule = {0: [("add", c, prompt(3, i), greedy(4)) for i, c in enumerate("ABC")]
                + [("add", "D", prompt(3, 5), greedy(10))],
                2: [("abort", "D"), ("add", "E", e, greedy(1))],
                4: [("add", "F", e + [1, 2, 3, 4, 5], greedy(3, logprobs=True))]}
    blocks = {}
    hooks = {1: lambda eng: blocks.setdefault("D", eng.requests["D"].blocks[0].block_id),
             5: lambda eng: blocks.setdefault("F", [b.block_id for b in eng.requests["F"].blocks[:4]])}

    got, want, engine, trace = both(tiny, schedule, hooks=hooks, num_kv_blocks=7, max_num_seqs=4)

    assert_same(got, want)
    assert trace.replay_sizes[:2] == [4, 3]  # step 1: A B C D; step 3: A B C, padded to 4
    assert got["F"]["cached"] == 64 and blocks["D"] in blocks["F"]  # F read the block D's row pointed at


def test_rows_wider_than_the_captured_tables_or_past_the_largest_bucket_run_eagerly(tiny):
    """Graphs for up to 2 rows of up to 2 blocks (32 tokens): 3-row steps and a row that
    grows to a third block run eagerly, the others replay, and a request sent afterwards
    replays again; all with the eager engine's tokens."""
    schedule = {0: [("add", "long", prompt(28, 1), greedy(8, logprobs=True)),
                    ("add", "short", prompt(5, 2), greedy(3)),
                    ("add", "mid", prompt(6, 3), SamplingParams(max_tokens=5, temperature=0.9, seed=4,
                                                                  ignore_eos=True))],
                9: [("add", "after", prompt(7, 4), greedy(3))]}

    got, want, engine, trace = both(tiny, schedule, capture=dict(max_batch=2, width=2), max_num_seqs=4)

    assert_same(got, want)
    assert engine.runner.graphs.buckets == (1, 2)
    eager = trace.eager_decode_only
    assert any(s["decodes"] == 3 for s in eager)  # more rows than the largest bucket
    assert any(s["decodes"] <= 2 and s["blocks"] == 3 for s in eager)  # wider than the captured tables
    assert all(s["decodes"] <= 2 and s["blocks"] <= 2 for s in trace.replayed)
    assert trace.steps[-1]["replayed"]  # "after" alone: graphs again after eager steps


def test_preemption_and_recompute_in_a_tiny_pool_match_eager(tiny):
    """7 blocks for 4 sequences that each grow to 2: a sequence is preempted, recomputed
    once others finish, and decodes again from replays."""
    schedule = {0: [("add", f"p{i}", prompt(12, 10 + i), greedy(10)) for i in range(3)]
                + [("add", "p3", prompt(12, 13), SamplingParams(max_tokens=10, temperature=0.8, seed=2,
                                                                  logprobs=True, ignore_eos=True))]}

    got, want, engine, trace = both(tiny, schedule, num_kv_blocks=7, max_num_seqs=4)

    assert_same(got, want)
    assert engine.num_preemptions > 0
    assert all(len(r["tokens"]) == 10 for r in got.values())
    assert len(trace.replayed) >= 5


def test_kv_compression_by_the_oldest_policy_matches_eager(tiny):
    """Budget 2 blocks (no sink, 1 recent): the 40-token prompt loses a block after its
    prefill and more while it decodes; replayed rows attend over caches with evicted
    tokens (cache index = position - evicted)."""
    schedule = {0: [("add", "long", prompt(40, 1), greedy(14, logprobs=True)),
                    ("add", "short", prompt(20, 2), SamplingParams(max_tokens=14, temperature=0.9, seed=6,
                                                                     top_logprobs=2, ignore_eos=True))]}

    got, want, engine, trace = both(tiny, schedule, kv_compress_budget_blocks=2, kv_compress_sink_blocks=0,
                                     kv_compress_recent_blocks=1, kv_compress_policy="oldest")

    assert_same(got, want)
    assert engine.num_compressed_blocks >= 2
    assert any(s["evicted"] for s in trace.replayed)


def test_a_row_reaching_max_model_len_replays_at_the_full_captured_width(tiny):
    """max_model_len 40 is not a multiple of the block size: the engine's width is 3 blocks
    and the last one is never full; a row runs up to the context limit (LENGTH) in
    replays that use every column of the static tables."""
    schedule = {0: [("add", "edge", prompt(30, 1), greedy(20, logprobs=True)),
                    ("add", "tiny", prompt(2, 2), greedy(4))]}

    got, want, engine, trace = both(tiny, schedule, max_model_len=40)

    assert_same(got, want)
    assert engine.runner.graphs.max_blocks_per_seq == 3
    assert got["edge"]["finish"] is FinishReason.LENGTH and len(got["edge"]["tokens"]) == 10
    assert any(s["blocks"] == 3 for s in trace.replayed)


def test_an_int8_kv_cache_with_sampled_and_logprob_rows_matches_eager(tiny):
    schedule = {0: [("add", "x", prompt(9, 1), greedy(5, logprobs=True, top_logprobs=2)),
                    ("add", "y", prompt(18, 2), SamplingParams(max_tokens=4, temperature=0.7, top_p=0.8, seed=1,
                                                                 logprobs=True, ignore_eos=True)),
                    ("add", "z", prompt(3, 3), greedy(3, frequency_penalty=1.0))]}

    got, want, engine, trace = both(tiny, schedule, kv_cache_dtype="int8")

    assert_same(got, want)
    assert 3 in trace.replay_sizes  # bucket 4, one padding row


def test_graphs_captured_while_requests_run_write_no_kv_and_keep_their_tokens(tiny):
    """An operator turning graphs on mid-generation (twice): capturing runs every bucket's
    step over padding rows only, so the running sequences' KV is untouched, and their
    next steps replay with the eager engine's tokens."""
    schedule = {0: [("add", f"m{i}", prompt(6 + 5 * i, 20 + i), greedy(7)) for i in range(3)]}
    want = drive(LLMEngine(tiny, config()), schedule)
    engine = LLMEngine(tiny, config())
    traces = []

    def capture(engine: LLMEngine) -> None:
        before = [c.clone() for c in engine.runner.kv_caches]
        traces.append(graphed(engine))
        traces.append(graphed(engine))  # a second capture replaces the first
        for old, new in zip(before, engine.runner.kv_caches):
            assert torch.equal(old, new)

    got = drive(engine, schedule, hooks={3: capture})

    assert_same(got, want)
    assert not traces[0].replayed and len(traces[1].replayed) >= 3


def test_a_prefill_trickling_one_token_a_step_beside_decodes_is_never_replayed(tiny):
    """A budget of 4 tokens and 3 running rows leave 1 token a step for a new prompt: its
    chunks are 1-token decode rows that do not sample, so those steps must run eagerly;
    its last chunk samples and replays with the others (its prompt logprobs, recorded by
    the eager chunks, are whole). The first step (three 1-token prompts, all decode rows)
    replays."""
    schedule = {0: [("add", f"s{i}", [100 + i], greedy(12)) for i in range(3)],
                2: [("add", "late", prompt(8, 7), greedy(3, logprobs=True, prompt_logprobs=2))]}

    got, want, engine, trace = both(tiny, schedule, max_num_batched_tokens=4, max_prefill_chunk=4, max_num_seqs=4)

    assert_same(got, want)
    assert trace.steps[0]["replayed"] and trace.steps[0]["decodes"] == 3
    trickling = [s for s in trace.steps if not s["all_sample"]]
    assert len(trickling) == 7 and not any(s["replayed"] for s in trickling)
    assert 4 in trace.replay_sizes
    assert len(got["late"]["prompt"]) == 7 and all(len(alt) == 2 for alt in got["late"]["prompt_top"])

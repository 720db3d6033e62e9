"""The persistent batch (engine/input_batch.py): every step's inputs equal the ones a fresh
build from the sequences gives, through prefix hits, chunked prefills, preemption and KV
compression; steady-state decode steps reuse the same buffers and append block-table
entries only as blocks are added; a plain greedy batch never builds the sampler's
per-row lists."""
from __future__ import annotations

import random

import pytest
import torch

from services.executor.engine import model_runner
from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.input_batch import InputBatch
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import Sequence
from services.executor.engine.step_plan import ScheduledSeq, StepPlan
from services.executor.kv.block_pool import Block
from weft.testing.tiny_model import make_tiny_checkpoint

MAX_STEPS = 2000  # a loop past it is a hang, not slowness
VOCAB = 1024
BS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


def _reference(plan: StepPlan, bs: int) -> dict:
    """The step's inputs built from scratch from the sequences (what the runner did
    before the persistent batch): per-token lists and each row's owned block ids."""
    ids, pos, slots = [], [], []
    for item in plan.decodes + plan.prefills:
        seq, n = item.seq, item.num_new_tokens
        start, ev, blocks = seq.num_computed_tokens, seq.num_evicted_tokens, seq.block_ids()
        ids += seq.all_token_ids[start:start + n]
        pos += range(start, start + n)
        slots += [blocks[i // bs] * bs + i % bs for i in range(start - ev, start + n - ev)]
    return dict(ids=ids, pos=pos, slots=slots,
                decode_lens=[s.seq.num_cached_kv_tokens + 1 for s in plan.decodes],
                ctx_lens=[s.seq.num_cached_kv_tokens for s in plan.prefills],
                q_lens=[s.num_new_tokens for s in plan.prefills],
                decode_tables=[s.seq.block_ids() for s in plan.decodes],
                prefill_tables=[s.seq.block_ids() for s in plan.prefills])


def _assert_matches(inputs, ref: dict) -> None:
    meta = inputs.meta
    assert inputs.input_ids.tolist() == ref["ids"]
    assert inputs.positions.tolist() == ref["pos"]
    assert meta.slot_mapping.tolist() == ref["slots"]
    assert meta.decode_seq_lens.tolist() == ref["decode_lens"] == list(meta.decode_seq_lens_host)
    assert list(meta.prefill_context_lens_host) == meta.prefill_context_lens.tolist() == ref["ctx_lens"]
    assert list(meta.prefill_query_lens_host) == ref["q_lens"]
    starts = [0]
    for q in ref["q_lens"]:
        starts.append(starts[-1] + q)
    assert meta.prefill_query_start_loc.tolist() == starts
    assert meta.prefill_seq_lens.tolist() == [c + q for c, q in zip(ref["ctx_lens"], ref["q_lens"])]
    # entries past a row's own blocks are padding: only the owned prefix must match
    for table, rows in ((meta.decode_block_tables, ref["decode_tables"]), (meta.prefill_block_tables, ref["prefill_tables"])):
        assert table.shape[0] == len(rows)
        for got, want in zip(table.tolist(), rows):
            assert got[:len(want)] == want


def _checked_engine(checkpoint, steps: list[int], **options) -> LLMEngine:
    engine = LLMEngine(checkpoint, EngineConfig(block_size=BS, **options))
    runner = engine.runner
    inner = runner._prepare

    def prepare(plan):
        inputs = inner(plan)
        _assert_matches(inputs, _reference(plan, BS))
        steps.append(len(plan.decodes) + len(plan.prefills))
        return inputs

    runner._prepare = prepare
    return engine


def _drive(engine: LLMEngine, rng: random.Random, num_requests: int, prompt_lens: tuple[int, int]) -> None:
    shared = [rng.randrange(VOCAB) for _ in range(12)]  # a common prefix: prefix-cache hits
    pending = [(f"r{i}", (shared if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(*prompt_lens))])
               for i in range(num_requests)]
    for _ in range(MAX_STEPS):
        if pending and rng.random() < 0.3:  # arrivals between steps: rows join mid-flight
            rid, prompt = pending.pop()
            engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randint(4, 40), temperature=0.0,
                                                           ignore_eos=True))
        if not pending and not engine.has_unfinished_requests:
            return
        engine.step()
    raise AssertionError(f"engine still busy after {MAX_STEPS} steps")


@pytest.mark.parametrize("seed", [0, 1])
def test_inputs_equal_a_fresh_build_through_prefix_hits_chunks_and_preemption(checkpoint, seed):
    steps: list[int] = []
    # a small pool and short chunks: preemptions, recomputes and chunked prefills happen
    engine = _checked_engine(checkpoint, steps, num_kv_blocks=40, max_prefill_chunk=8, max_num_batched_tokens=24)
    _drive(engine, random.Random(seed), num_requests=14, prompt_lens=(1, 30))
    assert engine.num_preemptions > 0 and len(steps) > 50


def test_inputs_equal_a_fresh_build_under_kv_compression(checkpoint):
    steps: list[int] = []
    engine = _checked_engine(checkpoint, steps, num_kv_blocks=128, kv_compress_budget_blocks=5,
                             kv_compress_sink_blocks=1, kv_compress_recent_blocks=2)
    _drive(engine, random.Random(2), num_requests=8, prompt_lens=(20, 40))
    assert engine.num_compressed_blocks > 0


def _seq(rid: str, num_tokens: int, blocks: list[Block]) -> Sequence:
    seq = Sequence(rid, list(range(1, num_tokens + 1)), SamplingParams())
    seq.num_computed_tokens = num_tokens - 1
    seq.blocks = blocks
    return seq


def test_steady_state_decode_steps_reuse_buffers_and_append_only_new_blocks():
    batch = InputBatch(BS, torch.device("cpu"), num_blocks=64)
    a, b = _seq("a", 6, [Block(3), Block(9)]), _seq("b", 3, [Block(5)])
    first = batch.prepare(StepPlan([ScheduledSeq(a, 1), ScheduledSeq(b, 1)], [], []))
    table_ptr, ids_ptr = first.meta.decode_block_tables.data_ptr(), first.input_ids.data_ptr()
    for s in (a, b):  # the step's result: one token each
        s.num_computed_tokens += 1
        s.all_token_ids.append(7)
    b.blocks.append(Block(11))  # b grows into a second block: appended to the same list
    b.num_computed_tokens, b.all_token_ids = 4, b.all_token_ids + [8]
    second = batch.prepare(StepPlan([ScheduledSeq(a, 1), ScheduledSeq(b, 1)], [], []))
    assert second.meta.decode_block_tables.data_ptr() == table_ptr  # a view, not a rebuild
    assert second.input_ids.data_ptr() == ids_ptr
    assert second.meta.decode_block_tables[:, :2].tolist() == [[3, 9], [5, 11]]
    assert second.meta.slot_mapping.tolist() == [9 * BS + 2, 11 * BS + 0]
    assert second.sample_rows == slice(0, 2)


def test_a_replaced_block_list_rewrites_the_row_and_unscheduled_rows_are_freed():
    batch = InputBatch(BS, torch.device("cpu"), num_blocks=64)
    a, b = _seq("a", 6, [Block(3), Block(9)]), _seq("b", 3, [Block(5)])
    batch.prepare(StepPlan([ScheduledSeq(a, 1), ScheduledSeq(b, 1)], [], []))
    # compression dropped block 3 (a new list, as the KV manager assigns) and a block was
    # added since: the same length as before, different entries
    a.blocks = [Block(9), Block(12)]
    a.num_evicted_tokens = BS
    a.num_computed_tokens, a.all_token_ids = 8, list(range(1, 10))
    out = batch.prepare(StepPlan([ScheduledSeq(a, 1)], [], []))  # b finished
    assert out.meta.decode_block_tables[0, :2].tolist() == [9, 12]
    assert out.meta.slot_mapping.tolist() == [12 * BS + 0]  # cache index 8 - 4 evicted
    assert batch.num_rows_in_use() == 1


def test_rows_out_of_order_are_gathered_in_step_order():
    batch = InputBatch(BS, torch.device("cpu"), num_blocks=64)
    a, b, c = _seq("a", 2, [Block(1)]), _seq("b", 2, [Block(2)]), _seq("c", 2, [Block(3)])
    batch.prepare(StepPlan([ScheduledSeq(s, 1) for s in (a, b, c)], [], []))
    out = batch.prepare(StepPlan([ScheduledSeq(c, 1), ScheduledSeq(a, 1)], [], []))  # b gone, order changed
    assert out.meta.decode_block_tables[:, 0].tolist() == [3, 1]
    assert out.meta.slot_mapping.tolist() == [3 * BS + 1, 1 * BS + 1]


def test_a_plain_greedy_batch_never_calls_the_per_row_sampler(checkpoint, monkeypatch):
    engine = LLMEngine(checkpoint, EngineConfig(block_size=BS))

    def per_row_sample(*args, **kwargs):
        raise AssertionError("a plain greedy batch went through the per-row sampler")

    monkeypatch.setattr(model_runner, "sample", per_row_sample)
    for i in range(3):
        engine.add_request(f"g{i}", [5 + i, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests:
        engine.step()
    # a row that asks for logprobs does need it
    engine.add_request("lp", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, logprobs=True))
    with pytest.raises(AssertionError, match="per-row sampler"):
        engine.step()

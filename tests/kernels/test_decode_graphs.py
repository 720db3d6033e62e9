"""Decode steps replayed from CUDA graphs (services/executor/engine/cuda_graphs.py).

On a GPU the graphs are real (``torch.cuda.CUDAGraph``); everywhere the same bookkeeping
(static buffers, padding to a bucket, stale rows, output slices) runs through
``eager_capture``, which re-runs the captured step on each replay, with the Triton kernels
interpreted on CPU. Both must give the eager engine's greedy tokens.
"""
from __future__ import annotations

import pytest
import torch

from services.executor.engine.cuda_graphs import DecodeGraphs, eager_capture, graph_buckets
from weft import LLM, SamplingParams
from weft.testing.tiny_model import make_tiny_checkpoint

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# four prompts, two crossing a block boundary while they decode; max_tokens differ so the
# batch shrinks 4 -> 3 -> 2 -> 1 (buckets 4, 4 padded, 2, 1), and the last prompt is
# sent again afterwards: a prefix-cache hit on blocks the graphs wrote
PROMPTS = [[5, 9, 200, 31, 7], list(range(40, 54)), list(range(100, 130)), [11, 12, 13]]
MAX_TOKENS = [7, 5, 3, 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", preset="tiny", arch="llama")


def _options(**extra):
    return dict(attention_backend="triton", block_size=16, num_kv_blocks=32, max_num_seqs=4,
                max_prefill_chunk=64, max_num_batched_tokens=64, device=DEVICE, **extra)


def _generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    again = llm.generate([PROMPTS[2] + [1, 2]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
    return [list(o.token_ids) for o in first + again]


def test_buckets_are_1_2_4_then_multiples_of_8_up_to_the_limit():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(4) == (1, 2, 4)
    assert graph_buckets(6) == (1, 2, 4, 6)
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert graph_buckets(64)[-3:] == (48, 56, 64)
    with pytest.raises(ValueError, match="max_batch"):
        graph_buckets(0)


# int8 on CPU is covered with sampled rows by tests/adversarial/test_cuda_graph_attacks.py
# (interpreted int8 kernels are slow); on a GPU both caches run here with real graphs.
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"] if CUDA else ["auto"])
def test_replayed_decode_steps_give_the_eager_engines_tokens(tiny, kv_cache_dtype):
    eager = _generate(LLM(tiny, kv_cache_dtype=kv_cache_dtype, **_options()))
    llm = LLM(tiny, cuda_graphs=True, kv_cache_dtype=kv_cache_dtype, **_options())
    runner = llm.engine.runner
    if not CUDA:  # no GPU: the same bookkeeping, each replay re-running the step eagerly
        assert runner.graphs is None
        runner.capture_decode_graphs(4, llm.engine.max_model_len // 16 + 1, capture=eager_capture)
    assert runner.graphs is not None and runner.graphs.buckets == (1, 2, 4)

    got = _generate(llm)

    assert got == eager
    # every decode-only step replayed: 6 steps after the first prefill batch, 3 more after the second
    assert runner.graphs.num_replays >= 8


def test_an_engine_captures_no_graphs_unless_asked(tiny):
    assert LLM(tiny, **_options()).engine.runner.graphs is None


def test_a_padding_row_writes_no_kv_where_a_larger_step_left_its_slot(tiny):
    """A bucket-4 replay of 3 rows must not re-run row 3 of an earlier 4-row step: that
    row's slot may since belong to another sequence."""
    llm = LLM(tiny, **_options())
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, max_batch=4, max_blocks_per_seq=2)
    graphs.capture(eager_capture if not CUDA else None)
    tables = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]], dtype=torch.int32)
    ids_pos_slots = torch.tensor([[5, 6, 7, 8], [3, 3, 3, 3], [16 + 3, 48 + 3, 80 + 3, 112 + 3]])
    graphs.run(ids_pos_slots, torch.tensor([4, 4, 4, 4], dtype=torch.int32), tables)
    row3_slot = (slice(None), 7, 3)  # block 7, offset 3: [2 (k, v), kvh, d] per layer
    for cache in runner.kv_caches:
        cache[row3_slot] = 0  # another sequence's block now: cleared to see any write
    graphs.run(ids_pos_slots[:, :3] + torch.tensor([[0], [1], [1]]), torch.tensor([5, 5, 5], dtype=torch.int32),
               tables[:3])
    for cache in runner.kv_caches:
        assert not cache[row3_slot].any()
    assert graphs.num_replays == 2


def test_steps_the_graphs_do_not_cover_run_eagerly(tiny):
    """Past the largest bucket, or wider than the captured tables, a step runs eagerly."""
    llm = LLM(tiny, **_options())
    graphs = DecodeGraphs(llm.engine.runner.model, llm.engine.runner.kv_caches, max_batch=2, max_blocks_per_seq=3)
    assert not graphs.covers(1, 1)  # nothing captured yet
    graphs.capture(eager_capture if not CUDA else None)
    assert graphs.covers(1, 3) and graphs.covers(2, 1)
    assert not graphs.covers(3, 1) and not graphs.covers(1, 4) and not graphs.covers(0, 1)


def test_graphs_refuse_the_torch_back_end_and_attention_mass_tracking(tiny):
    llm = LLM(tiny, **{**_options(), "attention_backend": "torch", "device": "cpu"})
    with pytest.raises(ValueError, match="triton attention back end"):
        llm.engine.runner.capture_decode_graphs(4, 4, capture=eager_capture)
    compressing = LLM(tiny, cuda_graphs=True, kv_compress_budget_blocks=4, kv_compress_recent_blocks=2,
                      **_options())
    assert compressing.engine.runner.graphs is None  # never captured when scores are tracked
    with pytest.raises(ValueError, match="attention mass"):
        compressing.engine.runner.capture_decode_graphs(4, 4, capture=eager_capture)

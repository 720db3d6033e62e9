"""``DecodeGraphs.run`` misused directly (services/executor/engine/cuda_graphs.py), and the
operator's switch: the ``cuda_graphs`` option on a CPU engine, a capture failing half way,
the executor's ``--cuda-graphs`` flag. Engine-level parity attacks:
test_cuda_graph_attacks.py; shared helpers: graph_parity.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from services.executor.config import DESCRIPTION, ExecutorConfig
from services.executor.engine.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs, eager_capture
from services.executor.engine.engine import LLMEngine
from services.mesh import mesh_auth
from services.mesh.env_config import load_config
from tests.adversarial.graph_parity import (
    ROOT, VOCAB, assert_same, config, drive, greedy, prompt, tiny_checkpoint)
from weft import LLM


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


# -- DecodeGraphs.run misused ---------------------------------------------------------------

@pytest.fixture(scope="module")
def small_graphs(tiny):
    """Graphs of buckets (1, 2) over tables 2 blocks wide, on an engine's caches."""
    engine = LLMEngine(tiny, config(num_kv_blocks=16))
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
    engine = LLMEngine(tiny, config(num_kv_blocks=16))
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
    engine = LLMEngine(tiny, config(num_kv_blocks=16))
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
    out = llm.generate([prompt(5, 1)], greedy(2), use_tqdm=False)
    assert len(out[0].token_ids) == 2


def test_a_capture_failing_half_way_leaves_the_engine_eager_and_correct(tiny, monkeypatch):
    """An unlucky GPU: the largest bucket captures, the next one fails (out of memory).
    The engine must log it and stay eager: no half-captured graphs left on the runner.
    (The engine only tries on CUDA: its device check is shown "cuda" for the call, the
    capture itself runs on CPU through ``eager_capture``.)"""
    schedule = {0: [("add", "q", prompt(5, 1), greedy(3)), ("add", "w", prompt(7, 2), greedy(3))]}
    want = drive(LLMEngine(tiny, config(max_num_seqs=4)), schedule)
    engine = LLMEngine(tiny, config(max_num_seqs=4))
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
    engine._capture_decode_graphs()

    assert len(captured) == 1 and engine.runner.graphs is None
    assert engine.model.device.type == "cpu"
    assert_same(drive(engine, schedule), want)


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

"""The one-pass mixed steps through the engine (ModelRunner.native_decode_attention: the
decode rows' attention native, NativeDecoder.attend_rows) against the gathered ablation
(native_decode_attention and native_mixed_steps off), attacked: the same tokens, logprobs,
top logprobs and prompt logprobs for prefix-cache forks, block-multiple lengths, 1-token
rows beside 230-token rows, >64 decode rows with seeded and grammar-constrained rows at 1
and 2 threads, preemption + recompute with an abort, KV compression of the oldest blocks,
and model shapes with head_dim 64 / 128 and groups 1, 3, 5; the forks and the preemption /
compression cases also with every never-written cache slot holding NaN (keys) or inf
(values). A spy on ``attend_rows`` checks that each attacked case actually reached it. The
kernel called directly: test_native_decode_attention_attacks.py."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
from services.executor.engine.sequence import FinishReason
from services.executor.model.config import ModelConfig
from services.executor.model.native import library
from tests.adversarial.attention_shapes import BS, SHAPES, overrides, threads
from tests.adversarial.graph_parity import assert_same, drive, greedy, prompt
from weft.testing.tiny_model import make_tiny_checkpoint, random_weights

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")



@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("attend-rows") / "tiny", preset="tiny", arch="llama")


def _checkpoint(tmp_path_factory, shape: str) -> Path:
    """The tiny preset's checkpoint (tokenizer and all) with ``shape``'s attention."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"attend-rows-{shape}") / "m", preset="tiny", arch="llama")
    config_dict = {**json.loads((path / "config.json").read_text()), **overrides(*SHAPES[shape], 2)}
    (path / "config.json").write_text(json.dumps(config_dict))
    save_file(random_weights(ModelConfig.from_dict(config_dict), seed=9), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


ENGINE = dict(block_size=BS, max_model_len=512, num_kv_blocks=96, max_num_seqs=12, max_prefill_chunk=64,
              max_num_batched_tokens=96)


def _engine(path: Path, single: bool, poison: bool = False, **extra) -> tuple[LLMEngine, list[dict]]:
    """An engine on the torch back end: ``single`` (the default single pass, decode rows'
    attention native) or the gathered ablation; ``poison``: every cache slot starts as NaN
    (keys) / inf (values), so any slot read before it is written shows. Returns the engine
    and its spy's record: one dict per layer-0 native attention call."""
    e = LLMEngine(path, EngineConfig(**{**ENGINE, **extra}))
    runner = e.runner
    calls: list[dict] = []
    if single:
        assert runner.native is not None and runner.native_decode_attention
    runner.native_decode_attention = single
    runner.native_mixed_steps = False
    if poison:
        for cache in runner.kv_caches:
            cache[0].fill_(float("nan"))
            cache[1].fill_(float("inf"))
    if runner.native is not None:
        real_attend, real_forward = runner.native.attend_rows, e.model.forward
        first = runner.kv_caches[0].data_ptr()
        step = {"prefills": 0}

        def attend(cache, q, block_tables, seq_lens):
            out = real_attend(cache, q, block_tables, seq_lens)
            if cache.data_ptr() == first:
                calls.append(dict(lens=seq_lens.tolist(), tables=block_tables.clone(), prefills=step["prefills"],
                                  finite=bool(torch.isfinite(out).all()), stale_nan=bool(torch.isnan(cache[0]).any())))
            return out

        def forward(input_ids, positions, kv_caches, meta):
            step["prefills"] = meta.num_prefills
            return real_forward(input_ids, positions, kv_caches, meta)

        runner.native.attend_rows = attend
        e.model.forward = forward
    return e, calls


_REFERENCE: dict[str, dict] = {}


def _compare(key: str, path: Path, schedule, poison: bool = False, **extra) -> tuple[dict, list[dict], LLMEngine]:
    """Drive ``schedule`` through the gathered ablation (once per ``key``, clean cache) and
    the single pass; assert the same outputs. Returns the single pass's outputs, spy and engine."""
    if key not in _REFERENCE:
        _REFERENCE[key] = drive(_engine(path, single=False, **extra)[0], schedule)
    e, calls = _engine(path, single=True, poison=poison, **extra)
    got = drive(e, schedule)
    assert_same(got, _REFERENCE[key])
    assert calls and all(c["finite"] for c in calls)
    if poison:  # native attention ran beside unwritten (still poisoned) slots
        assert any(c["stale_nan"] for c in calls)
    return got, calls, e


def _shares_blocks(call: dict, min_shared: int) -> bool:
    """Two rows of the call read at least ``min_shared`` of the same blocks."""
    used = [set(call["tables"][r, :-(-n // BS)].tolist()) for r, n in enumerate(call["lens"])]
    return any(len(used[a] & used[b]) >= min_shared for a in range(len(used)) for b in range(a))


BASE = prompt(48, 40)  # three full blocks: the fork prompts' shared prefix
LONG = prompt(230, 1)
FORKS = {
    # a 230-token row (its decodes pass 240, a block multiple) and a 1-token prompt (a
    # decode row of length 1) in the first mixed steps
    0: [("add", "long", LONG, greedy(16, logprobs=True, top_logprobs=2)), ("add", "one", prompt(1, 2), greedy(8)),
        ("add", "base_a", BASE + prompt(4, 3), greedy(10))],
    # a fork of base_a over three full blocks; prompts whose first decode row holds 32 / 48
    2: [("add", "base_b", BASE + prompt(7, 4), greedy(10, logprobs=True))],
    3: [("add", "exact32", prompt(31, 5), greedy(6)), ("add", "exact48", prompt(47, 6), greedy(4))],
    # a 1-token row beside long's ~232-token decode row and a prefill's chunks (prompt
    # logprobs)
    6: [("add", "late_one", prompt(1, 7), greedy(4, logprobs=True)),
        ("add", "late_prefill", prompt(90, 8), greedy(3, prompt_logprobs=1))],
    # a fork of long over 14 full blocks: a 228-token row sharing them
    8: [("add", "fork_long", LONG[:224] + prompt(3, 9), SamplingParams(max_tokens=6, temperature=0.8, seed=4,
                                                                        logprobs=True, ignore_eos=True))],
    # chunks beside the fork and its parent decoding
    10: [("add", "late_prefill2", prompt(120, 10), greedy(2))],
}


@pytest.mark.parametrize("poison", [False, True], ids=["clean", "poisoned"])
def test_forks_block_multiples_and_uneven_rows_match_the_gathered_path(tiny, poison):
    got, calls, _ = _compare("forks", tiny, FORKS, poison=poison)
    assert got["base_b"]["cached"] == 48 and got["fork_long"]["cached"] == 224
    assert len(got["late_prefill"]["prompt"]) == 89
    mixed = [c for c in calls if c["prefills"]]
    assert any(1 in c["lens"] and max(c["lens"]) >= 200 for c in mixed), "no 1-token row beside a long one"
    assert any(n % BS == 0 for c in calls for n in c["lens"]), "no row of a block multiple"
    assert any(_shares_blocks(c, 3) for c in mixed), "no forks sharing full blocks in a mixed step"
    assert any(_shares_blocks(c, 14) for c in calls), "the long fork never attended beside its parent"


def test_more_than_64_decode_rows_with_seeded_and_grammar_rows_at_1_and_2threads(tiny):
    """66 requests: decode-only steps of more rows than the native step's 64 run in one pass
    with native attention (a 200-token row beside 1-3 token ones, seeded sampled rows, a
    regex-constrained row), at 1 and at 2 threads."""
    kinds = [lambda i: greedy(5),
             lambda i: SamplingParams(max_tokens=5, temperature=0.9, top_p=0.9, seed=i, logprobs=True,
                                      ignore_eos=True),
             lambda i: greedy(5, logprobs=True, top_logprobs=1)]
    adds = [("add", f"r{i}", prompt(1 + i % 3, i), kinds[i % 3](i)) for i in range(64)]
    adds.append(("add", "long", prompt(200, 77), greedy(5, logprobs=True)))
    adds.append(("add", "regex", prompt(6, 78),
                 SamplingParams(max_tokens=6, temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{2,3}-[a-z]{1,2}"))))
    schedule = {0: adds}
    extra = dict(max_num_seqs=72, num_kv_blocks=120, max_num_batched_tokens=400, max_prefill_chunk=256)
    runs = []
    for n in (1, 2):
        with threads(n):
            got, calls, _ = _compare("wide", tiny, schedule, **extra)
        wide = [c for c in calls if not c["prefills"] and len(c["lens"]) > 64]
        assert any(max(c["lens"]) >= 200 and min(c["lens"]) <= 3 for c in wide), "no >64-row decode step"
        runs.append(got)
    assert runs[0]["regex"]["tokens"] == runs[1]["regex"]["tokens"]


@pytest.mark.parametrize("extra", [
    dict(num_kv_blocks=9, max_model_len=128),
    dict(kv_compress_budget_blocks=3, kv_compress_sink_blocks=1, kv_compress_recent_blocks=1,
         kv_compress_policy="oldest"),
], ids=["preempt_and_abort", "compress_oldest"])
def test_preemption_aborts_and_oldest_compression_on_a_poisoned_cache(tiny, extra):
    """Recomputed sequences (blocks freed and taken again), an abort mid-prefill, and
    sequences whose middle blocks KV compression dropped, on a cache whose unwritten slots
    are NaN / inf: the same outputs as the gathered path on a clean cache."""
    a = prompt(20, 1)
    schedule = {0: [("add", "a", a, greedy(36)), ("add", "b", prompt(18, 2), greedy(36, logprobs=True)),
                    ("add", "one", prompt(1, 3), greedy(30))],
                2: [("add", "x", prompt(60, 4), greedy(4)), ("add", "c", prompt(40, 5), greedy(12))],
                3: [("abort", "x")],
                6: [("add", "y", a[:16] + prompt(10, 6), greedy(6))],
                14: [("add", "z", prompt(70, 7), SamplingParams(max_tokens=5, temperature=0.9, seed=2,
                                                                 prompt_logprobs=1, ignore_eos=True))]}
    key = "pressure-" + ("compress" if "kv_compress_policy" in extra else "preempt")
    got, calls, e = _compare(key, tiny, schedule, poison=True, max_prefill_chunk=24, max_num_batched_tokens=48,
                             **extra)
    assert got["x"]["finish"] is FinishReason.ABORT and len(got["z"]["prompt"]) == 69
    assert any(c["prefills"] for c in calls)
    if "kv_compress_policy" in extra:
        assert e.num_compressed_blocks > 0
    else:
        assert e.num_preemptions > 0


@pytest.mark.parametrize("shape", ["g1_d64", "g5_d64", "g3_d128"])
def test_model_shapes_through_the_engine(tmp_path_factory, shape):
    path = _checkpoint(tmp_path_factory, shape)
    a = prompt(40, 11)
    schedule = {0: [("add", "a", a, greedy(10, logprobs=True, top_logprobs=2)), ("add", "b", prompt(1, 12), greedy(8))],
                2: [("add", "c", prompt(70, 13), greedy(4, prompt_logprobs=1)),
                    ("add", "d", a[:32] + prompt(5, 14), SamplingParams(max_tokens=6, temperature=0.8, seed=3,
                                                                         logprobs=True, ignore_eos=True))]}
    got, calls, _ = _compare(f"shape-{shape}", path, schedule)
    assert got["d"]["cached"] == 32
    assert any(c["prefills"] and 1 in c["lens"] for c in calls)

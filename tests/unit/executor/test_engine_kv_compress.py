"""KV compression in the engine on a tiny random checkpoint (torch back end): a budget
that is never reached changes nothing, a small one bounds every sequence's blocks while
generation completes, compressed blocks never become prefix-cache hits, and
compression survives preemption by recompute."""
from __future__ import annotations

import pytest

import weft
from services.executor.kv.block_pool import BlockStored
from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.engine.sampling_params import SamplingParams
from weft.testing.tiny_model import make_tiny_checkpoint

MAX_STEPS = 600  # no test here needs more; a loop past it is a hang, not slowness
VOCAB = 1024
BS = 4  # small blocks: sequences span many of them
BUDGET = dict(kv_compress_budget_blocks=6, kv_compress_sink_blocks=1, kv_compress_recent_blocks=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


def _prompt(n: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % VOCAB for i in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _engine(checkpoint, **options) -> LLMEngine:
    options.setdefault("num_kv_blocks", 128)
    return LLMEngine(checkpoint, EngineConfig(block_size=BS, **options))


def _run(engine: LLMEngine, on_step=lambda e: None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests:
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        on_step(engine)
    raise AssertionError(f"engine still busy after {MAX_STEPS} steps")


def test_a_budget_never_reached_gives_the_uncompressed_greedy_output(checkpoint):
    prompts = [_prompt(10), _prompt(23, start=3), _prompt(5, start=99)]
    base = weft.LLM(checkpoint, block_size=BS, num_kv_blocks=128).generate(prompts, _greedy(30), use_tqdm=False)
    llm = weft.LLM(checkpoint, block_size=BS, num_kv_blocks=128, kv_compress_budget_blocks=64)
    got = llm.generate(prompts, _greedy(30), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in base]
    assert llm.engine.stats()["num_compressed_blocks"] == 0


def test_a_small_budget_bounds_blocks_and_keeps_the_tokens_before_the_first_eviction(checkpoint):
    # one prompt longer than the budget (prefilled whole in chunks, compressed after)
    prompts = {"short": _prompt(10), "mid": _prompt(18, start=5), "long": _prompt(37, start=77)}
    base = _engine(checkpoint, max_prefill_chunk=16)
    for rid, p in prompts.items():
        base.add_request(rid, p, _greedy(48))
    expected = _run(base)

    engine = _engine(checkpoint, max_prefill_chunk=16, **BUDGET)
    for rid, p in prompts.items():
        engine.add_request(rid, p, _greedy(48))
    clean: dict[str, int] = {}  # output tokens sampled before the request's first eviction

    def check(e: LLMEngine) -> None:
        seqs = list(e.requests.values())
        for seq in seqs:
            if seq.num_computed_tokens == seq.num_tokens - 1:  # done prefilling: compressed
                assert len(seq.blocks) <= BUDGET["kv_compress_budget_blocks"], seq.request_id
                assert seq.num_evicted_tokens % BS == 0
                assert len(seq.blocks) == -(-seq.num_cached_kv_tokens // BS)
                assert len(seq.block_scores) == len(seq.blocks)  # scores follow the kept blocks
            if seq.num_evicted_tokens and seq.request_id not in clean:
                clean[seq.request_id] = seq.num_output_tokens
        assert e.pool.num_blocks - e.pool.num_free_blocks == sum(len(s.blocks) for s in seqs)

    got = _run(engine, check)
    assert {rid: len(t) for rid, t in got.items()} == {rid: 48 for rid in prompts}
    assert set(clean) == set(prompts)  # every request was compressed
    assert clean["long"] == 1  # its prompt alone exceeds the budget: compressed right after prefill
    for rid, n in clean.items():
        assert got[rid][:n] == expected[rid][:n], rid
    assert engine.stats()["num_compressed_blocks"] > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_blocks_computed_after_an_eviction_are_not_prefix_cache_hits(checkpoint):
    engine = _engine(checkpoint, **BUDGET)
    prompt = _prompt(10)
    engine.add_request("a", prompt, _greedy(40))
    out_a = _run(engine)["a"]
    registered = sum(len(ev.block_hashes) for ev in engine.take_kv_events() if isinstance(ev, BlockStored))
    assert 0 < registered * BS < len(prompt) + len(out_a) - BS  # the tail was never registered

    engine.add_request("b", prompt + out_a, _greedy(1))
    outputs = [o for _ in range(MAX_STEPS) if engine.has_unfinished_requests for o in engine.step()]
    assert 0 < outputs[-1].num_cached_tokens <= registered * BS

    # control: without compression, replaying a finished request hits all its full blocks
    plain = _engine(checkpoint)
    plain.add_request("a", prompt, _greedy(40))
    plain_a = _run(plain)["a"]
    plain.add_request("b", prompt + plain_a, _greedy(1))
    outputs = [o for _ in range(MAX_STEPS) if plain.has_unfinished_requests for o in plain.step()]
    assert outputs[-1].num_cached_tokens > registered * BS


def test_compression_with_preemption_by_recompute_completes(checkpoint):
    # three sequences growing to the budget (6 blocks, 7 during a step) in a 14-block pool
    engine = _engine(checkpoint, num_kv_blocks=14, **BUDGET)
    for i in range(3):
        engine.add_request(f"r{i}", _prompt(10, start=3 + 11 * i), _greedy(40))

    def check(e: LLMEngine) -> None:
        for seq in e.scheduler.waiting:  # preempted: all blocks gone, so is compression state
            assert not seq.blocks and seq.num_evicted_tokens == 0 and seq.block_scores == []
        for seq in e.scheduler.running:
            if seq.num_computed_tokens == seq.num_tokens - 1:
                assert len(seq.blocks) <= BUDGET["kv_compress_budget_blocks"]

    got = _run(engine, check)
    assert {rid: len(t) for rid, t in got.items()} == {f"r{i}": 40 for i in range(3)}
    assert engine.num_preemptions > 0
    assert engine.stats()["num_compressed_blocks"] > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_compressed_sequence_preempted_after_outgrowing_the_pool_is_recomputed_to_the_end(checkpoint):
    # "a" (the preemption policy's victim) grows to 64 tokens = 16 blocks of context in a
    # 14-block pool, held in 6 by compression; "c" arriving then forces a preemption.
    engine = _engine(checkpoint, num_kv_blocks=14, max_prefill_chunk=8, preemption_policy="priority", **BUDGET)
    engine.add_request("b", _prompt(4, start=1), _greedy(120), priority=0.0)
    engine.add_request("a", _prompt(10), _greedy(100), priority=-10.0)
    tokens: dict[str, list[int]] = {}
    while engine.requests["a"].num_tokens < 64:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.add_request("c", _prompt(8, start=5), _greedy(20), priority=0.0)
    preempted_at: list[int] = []

    def check(e: LLMEngine) -> None:
        preempted_at.extend(s.num_tokens for s in e.scheduler.waiting if s.request_id == "a")

    for rid, more in _run(engine, check).items():
        tokens.setdefault(rid, []).extend(more)
    assert max(preempted_at) > engine.num_blocks * BS  # its recompute could not hold it uncompressed
    assert {rid: len(t) for rid, t in tokens.items()} == {"a": 100, "b": 120, "c": 20}
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_compression_runs_over_an_int8_cache(checkpoint):
    llm = weft.LLM(checkpoint, block_size=BS, num_kv_blocks=64, kv_cache_dtype="int8", max_prefill_chunk=16, **BUDGET)
    outs = llm.generate([_prompt(37), _prompt(3, start=5)], _greedy(40), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [40, 40]
    assert llm.engine.stats()["num_compressed_blocks"] > 0


@pytest.mark.parametrize("policy", ["oldest", "attention"])
def test_the_policy_flag_picks_which_middle_blocks_go(checkpoint, policy):
    """oldest (StreamingLLM) always drops the first middle block (sinks + a sliding window
    of the newest stay) and collects no scores; attention collects scores and, on this
    prompt, drops some later, less attended block instead at least once."""
    engine = _engine(checkpoint, kv_compress_policy=policy, **BUDGET)
    assert engine.runner.track_block_scores is (policy == "attention")
    dropped: list[int] = []  # table index of every block compression dropped
    drop = engine.kv.drop_blocks

    def recording_drop(seq, indices):
        dropped.extend(indices)
        return drop(seq, indices)
    engine.kv.drop_blocks = recording_drop
    engine.add_request("r", _prompt(9), _greedy(40))
    _run(engine)
    assert dropped, "the budget was never exceeded"
    first_middle = BUDGET["kv_compress_sink_blocks"]
    if policy == "oldest":
        assert set(dropped) == {first_middle}
    else:
        assert set(dropped) != {first_middle}

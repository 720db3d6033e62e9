"""The peer harness's pure logic: llama-batched-bench's jsonl, round ratios, targets."""
import pytest

from benchmarks.peers.llama_cpp import parse_batched_bench
from benchmarks.peers.table import TARGETS, Target, bandwidth_fractions, judge, model_table, target_rows

# Two lines as llama-batched-bench --output-format jsonl prints them, among its log lines.
BENCH_OUTPUT = """\
main: n_kv_max = 1024, n_batch = 2048, n_ubatch = 512
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 8, "pl": 1, "n_kv": 24, "t_pp": 0.007034, "speed_pp": 2274.666016, "t_tg": 0.025392, "speed_tg": 315.059875, "t": 0.032426, "speed": 740.146790}
llama_perf_context_print: load time = 12.00 ms
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 8, "pl": 2, "n_kv": 48, "t_pp": 0.009702, "speed_pp": 3298.289062, "t_tg": 0.031849, "speed_tg": 502.370544, "t": 0.041551, "speed": 1155.206787}
"""


def test_batched_bench_rows_are_keyed_by_batch_size_and_log_lines_are_skipped():
    rows = parse_batched_bench(BENCH_OUTPUT)
    assert sorted(rows) == [1, 2]
    assert rows[2].prefill_s == pytest.approx(0.009702)
    assert rows[2].decode_s == pytest.approx(0.031849)


def test_batched_bench_decode_rate_is_its_own_s_tg_and_output_rate_counts_no_prompt_tokens():
    rows = parse_batched_bench(BENCH_OUTPUT)
    assert rows[2].decode_tok_per_s == pytest.approx(502.370544, rel=1e-4)  # speed_tg
    assert rows[2].output_tok_per_s == pytest.approx(2 * 8 / 0.041551)  # not "speed", which counts pp too


def test_batched_bench_line_without_timings_is_refused():
    with pytest.raises(ValueError, match="t_tg"):
        parse_batched_bench('{"pl": 1, "pp": 16, "tg": 8, "t_pp": 0.1, "t": 0.2}')


def rates(weft_b1, llama_b1, hf_b1=(), weft_conc=(), llama_conc=()):
    out = {("weft", "batch-1", "decode"): list(weft_b1), ("llama.cpp", "batch-1", "decode"): list(llama_b1),
           ("weft", "concurrent", "total"): list(weft_conc), ("llama.cpp", "concurrent", "total"): list(llama_conc)}
    if hf_b1:
        out[("transformers", "batch-1", "decode")] = list(hf_b1)
    return out


def test_ratio_is_the_median_of_each_rounds_own_ratio_not_a_ratio_of_medians():
    # rounds: 100/50 = 2.0, 60/60 = 1.0, 90/100 = 0.9; ratio of medians would be 90/60 = 1.5
    headers, rows = model_table(rates([100, 60, 90], [50, 60, 100]), num_prompts=16, input_len=128, output_len=64)
    b1_decode = rows[1]
    assert b1_decode[0] == "batch-1, decode only"
    assert b1_decode[headers.index("weft / llama.cpp")] == "1.00× (0.90×–2.00×)"
    assert b1_decode[headers.index("transformers tok/s")] == "—"  # transformers skipped


def test_target_is_met_when_the_median_round_ratio_reaches_it():
    target = Target(("m",), "batch-1", "decode", "llama.cpp", 1.0)
    assert judge(target, rates([99, 101, 102], [100, 100, 100]), [])[1] is True
    assert judge(target, rates([99, 99, 120], [100, 100, 100]), [])[1] is False


def test_target_against_a_skipped_engine_is_not_judged():
    target = Target(("m",), "batch-1", "decode", "transformers", 2.0)
    assert judge(target, rates([100], [100]), []) == ([], None)


def test_bandwidth_target_uses_each_rounds_own_bandwidth():
    fractions = bandwidth_fractions([100.0, 200.0], 1e6, [2e8, 2e8])
    assert fractions == [0.5, 1.0]


def test_each_model_gets_only_its_own_issue_16_targets():
    r = rates([100] * 3, [100] * 3, hf_b1=[40] * 3, weft_conc=[300] * 3, llama_conc=[150] * 3)
    smollm2 = target_rows("smollm2", r, [0.5] * 3, 16)
    bench = target_rows("bench", r, [0.5] * 3, 16)
    assert [row[2] for row in smollm2] == ["**met**", "**met**", "**met**"]  # 1.0×, 2.5×, 2.0×
    assert any("bandwidth" in row[0] and row[2] == "**not met**" for row in bench)  # 50 % < 60 %
    assert not any("transformers" in row[0] for row in bench)
    assert len(smollm2) + len(bench) == sum(len(t.models) for t in TARGETS)

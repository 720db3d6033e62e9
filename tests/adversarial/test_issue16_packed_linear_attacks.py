"""Issue 16, attacks on the packed GEMM's Python side (886c3ca): model/linear.py's
PackedLinear given what a hostile caller gives (fp64 / bf16 weights, an fp16 bias, a bias on
a gate_up, a non-contiguous bias, wrong inputs, no input features, a weight changed after
packing: documented, not required), the WEFT_PACKED_GEMM switch, and the model: the native
multi-row step with packed copies on odd shapes against the torch forward, bitwise the same
for threads 1..3 and for a row alone among 7, a decode step of 7..49 rows bitwise equal per
row to the same rows of a 64-row step (across the few-row column blocks, 2ccad7f), and an
engine's greedy tokens the same with the packed GEMM on and off. The kernels themselves:
test_issue16_packed_gemm_attacks.py.
AVX2 builds without AVX-512 only (module skip elsewhere).

Found by the attack and fixed before this file was committed (the tests were strict xfails):
PackedLinear packed fp64 / bf16 weights and read an fp16 bias as fp32 (now ValueError naming
the tensor); silu_mul dropped a gate_up's bias (now torch's route); in_features 0 failed to
reshape (now torch's route, the bias); k = 0 in the exported kernels stored an
uninitialised accumulator buffer instead of the bias (panel_block zeroes it).
"""
from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.selector import backend_class
from services.executor.model.config import ModelConfig
from services.executor.model.linear import Linear, OneDnnLinear, PackedLinear, make_linear, packed_usable
from services.executor.model.llama import LlamaModel
from tests.adversarial.test_issue16_packed_gemm_attacks import LIB, SENT, _child, _pack, _pack_gu, pytestmark  # noqa: F401
from weft.testing.tiny_model import make_tiny_checkpoint, model_config_dict, random_weights


# ---- 5. PackedLinear and a hostile caller -----------------------------------------------

def _refuses_or_is_right(make, x, want) -> None:
    try:
        lin = make()
    except (ValueError, TypeError) as exc:  # a clear refusal is fine
        assert str(exc)
        return
    got = lin(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_an_fp64_weight_is_refused_or_served_correctly():
    gen = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(20, 12, generator=gen), torch.randn(20, generator=gen), torch.randn(5, 12, generator=gen)
    want = F.linear(x.double(), w.double(), b.double())
    _refuses_or_is_right(lambda: PackedLinear(w.double(), b, LIB), x, want)


def test_an_fp16_bias_is_refused_or_served_correctly():
    gen = torch.Generator().manual_seed(2)
    w, b, x = torch.randn(20, 12, generator=gen), torch.randn(20, generator=gen), torch.randn(5, 12, generator=gen)
    want = F.linear(x.double(), w.double(), b.half().double())
    _refuses_or_is_right(lambda: make_linear(w, b.half(), True, packed_lib=LIB), x, want)


BF16_SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from services.executor.model.native import library
    from services.executor.model.linear import PackedLinear
    lib = library.load()
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 64, generator=g).bfloat16()
    x = torch.randn(3, 64, generator=g)
    try:
        lin = PackedLinear(w, None, lib)
    except (ValueError, TypeError) as exc:
        print("REFUSED", exc)
    else:
        got = lin(x)
        want = F.linear(x.double(), w.double())
        print("RIGHT" if torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2) else "WRONG")
""")


def test_a_bf16_weight_is_refused_or_served_correctly_in_a_child():
    proc = _child(BF16_SCRIPT)
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-1500:]}"
    assert "REFUSED" in proc.stdout or "RIGHT" in proc.stdout, proc.stdout


def test_silu_mul_of_a_gate_up_with_a_bias_adds_the_bias():
    gen = torch.Generator().manual_seed(7)
    inter, k = 9, 16
    gu, b, x = torch.randn(2 * inter, k, generator=gen), torch.randn(2 * inter, generator=gen), torch.randn(4, k,
                                                                                                        generator=gen)
    want = Linear(gu, b).silu_mul(x)
    torch.testing.assert_close(PackedLinear(gu, b, LIB, gate_up=True).silu_mul(x), want, rtol=1e-5, atol=1e-5)


def test_no_columns_give_the_bias_and_a_zero_activation():
    gen = torch.Generator().manual_seed(8)
    n, R, inter = 32, 4, 16  # two panels: thread 1's worker stack keeps the previous call's acc
    b = torch.randn(n, generator=gen)
    bad = []
    for k in (5, 0, 5, 0):
        W, X = torch.randn(n, k, generator=gen), torch.randn(R, k, generator=gen) * 100
        Y = torch.full((R, n), SENT)
        P = _pack(W)
        LIB.weft_gemm_packed(P.data_ptr(), b.data_ptr(), X.data_ptr(), max(k, 1), Y.data_ptr(), n, n, k, R,
                             0, 2)
        if k == 0 and not torch.equal(Y, b.expand(R, n)):
            bad.append(("gemm", (Y != b).sum().item()))
        GU = torch.randn(2 * inter, k, generator=gen)
        A = torch.full((R, inter), SENT)
        Pg = _pack_gu(GU)
        LIB.weft_gate_up_packed(Pg.data_ptr(), X.data_ptr(), max(k, 1), A.data_ptr(), inter, inter, k, R, 2)
        if k == 0 and not torch.equal(A, torch.zeros(R, inter)):
            bad.append(("gate_up", (A != 0).sum().item()))
    assert not bad, bad


def test_a_packed_linear_with_no_input_features_gives_the_bias():
    b = torch.randn(20, generator=torch.Generator().manual_seed(12))
    lin = PackedLinear(torch.empty(20, 0), b, LIB)
    torch.testing.assert_close(lin(torch.empty(3, 0)), F.linear(torch.empty(3, 0), torch.empty(20, 0), b))


def test_a_non_contiguous_bias_and_a_non_contiguous_weight_are_served():
    gen = torch.Generator().manual_seed(9)
    wt = torch.randn(12, 40, generator=gen).t()  # [40, 12] view, not contiguous
    b = torch.randn(80, generator=gen)[::2]  # stride 2
    x = torch.randn(7, 12, generator=gen)
    lin = PackedLinear(wt, b, LIB)
    torch.testing.assert_close(lin(x), F.linear(x, wt, b), rtol=1e-5, atol=1e-5)


def test_wrong_inputs_raise_instead_of_reading_garbage():
    gen = torch.Generator().manual_seed(10)
    w, b = torch.randn(20, 12, generator=gen), torch.randn(20, generator=gen)
    lin, gu = PackedLinear(w, b, LIB), PackedLinear(torch.randn(20, 12, generator=gen), None, LIB, gate_up=True)
    for bad in (torch.randn(3, 8), torch.randn(2, 6), torch.randn(5, 13), torch.randn(4, 3, 8)):  # wrong width
        with pytest.raises(RuntimeError):
            lin(bad)
        with pytest.raises(RuntimeError):
            gu.silu_mul(bad)
    for x in (torch.randn(3, 12, dtype=torch.float64), torch.randn(3, 12).bfloat16(),
              torch.ones(3, 12, dtype=torch.int64)):
        for call in (lin, gu.silu_mul):
            try:
                got = call(x)
            except RuntimeError:
                continue  # torch's own dtype error, as the plain Linear gives
            want = Linear(w, b)(x.float()) if call is lin else Linear(gu.plain_weight).silu_mul(x.float())
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    # a 1-D input is one row
    x1 = torch.randn(12, generator=gen)
    torch.testing.assert_close(lin(x1), F.linear(x1, w, b), rtol=1e-5, atol=1e-5)
    assert gu.silu_mul(x1).shape == (10,)


def test_documented_a_weight_changed_after_packing_is_seen_by_the_plain_paths_only():
    """Documents (does not require): PackedLinear snapshots the weight at construction. The
    caller's tensor stays its plain_weight (the native steps of <= 6 rows and a gate_up's
    __call__ read it), so an in-place edit afterwards (a LoRA merge, a hot reload) changes
    those and not the packed products: the native step would then disagree with itself
    between 6 and 7 rows. Repack (build a new PackedLinear) after editing weights."""
    gen = torch.Generator().manual_seed(11)
    w, x = torch.randn(20, 12, generator=gen), torch.randn(3, 12, generator=gen)
    lin = PackedLinear(w, None, LIB)
    before = lin(x)
    w.mul_(2)
    assert lin.plain_weight.data_ptr() == w.data_ptr()
    assert torch.equal(lin(x), before)  # the packed copy did not follow
    torch.testing.assert_close(F.linear(x, lin.plain_weight), 2 * before, rtol=1e-5, atol=1e-5)


# ---- 6. the switch, the model and the native multi-row step -----------------------------

def test_weft_packed_gemm_spellings():
    for off in ("0", " off ", "FALSE", "No", "false\n"):
        assert not packed_usable(LIB, {"WEFT_PACKED_GEMM": off}), repr(off)
    for on in ("1", "", "yes", "2", "on"):
        assert packed_usable(LIB, {"WEFT_PACKED_GEMM": on}), repr(on)
    assert packed_usable(LIB, {}) and not packed_usable(None, {})


def _odd_model(monkeypatch, packed: bool, inter: int, seed: int = 4) -> LlamaModel:
    monkeypatch.setenv("WEFT_PACKED_GEMM", "1" if packed else "0")
    config = ModelConfig.from_dict({**model_config_dict("tiny", "llama"), "hidden_size": 72, "head_dim": 18,
                                    "intermediate_size": inter, "vocab_size": 1022})
    return LlamaModel(config, random_weights(config, seed=seed), backend_class("torch"), native_decode=True)


BS, NB = 4, 192  # 64 rows of 3..13 tokens need ~150 blocks


def _decode_inputs(model, R: int, gen):
    lens = [3 + (7 * r) % 11 for r in range(R)]
    width = max(-(-n // BS) for n in lens)
    perm = iter(torch.randperm(NB, generator=gen).tolist())
    table = torch.zeros((R, width), dtype=torch.int32)
    for r, n in enumerate(lens):
        table[r, :-(-n // BS)] = torch.tensor([next(perm) for _ in range(-(-n // BS))], dtype=torch.int32)
    slots = torch.tensor([int(table[r, (n - 1) // BS]) * BS + (n - 1) % BS for r, n in enumerate(lens)])
    positions = torch.tensor([n - 1 for n in lens])
    tokens = torch.randint(0, model.lm_head.out_features, (R,), generator=gen)
    caches = [torch.randn(2, NB, BS, model.num_kv_heads, model.head_dim, generator=gen)
              for _ in range(model.num_layers)]
    return tokens, positions, slots, table, lens, caches


def _native_rows(model, inputs, R: int | None = None):
    tokens, positions, slots, table, lens, caches = inputs
    R = R or len(lens)
    caches = [c.clone() for c in caches]
    dec = model.native_decoder(caches)
    out = dec.step_rows(tokens[:R].contiguous(), positions[:R].contiguous(), slots[:R].contiguous(),
                        table[:R].contiguous(), torch.tensor(lens[:R], dtype=torch.int32), tuple(lens[:R]))
    return out, caches, dec


@pytest.mark.parametrize("inter", [131, 5])
def test_native_rows_with_packed_copies_on_an_odd_intermediate(monkeypatch, inter):
    model = _odd_model(monkeypatch, True, inter)
    assert all(isinstance(getattr(lw, name), PackedLinear) for lw in model.layers
               for name in ("qkv", "o", "gate_up", "down"))
    threads = torch.get_num_threads()
    try:
        for R in (7, 13, 64):
            gen = torch.Generator().manual_seed(R + inter)
            inputs = _decode_inputs(model, R, gen)
            tokens, positions, slots, table, lens, caches = inputs
            ref_caches = [c.clone() for c in caches]
            expected = model.compute_logits(model.forward(tokens, positions, ref_caches,
                                                          AttentionMetadata.decode_only(slots, table, lens)))
            runs = []
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                logits, new_caches, dec = _native_rows(model, inputs)
                assert dec._struct.gate_up_p and dec._struct.lm_head_p  # the packed copies were handed over
                runs.append((logits, new_caches))
            torch.set_num_threads(threads)
            logits, new_caches = runs[0]
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"R={R}: {m}")
            for a, b in zip(new_caches, ref_caches):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            for t, (other, other_caches) in enumerate(runs[1:], start=2):
                assert torch.equal(other, logits), f"R={R}: threads={t} logits differ bitwise from threads=1"
                assert all(torch.equal(a, b) for a, b in zip(other_caches, new_caches))
            # a row's logits do not depend on the other rows of a wide (> 6 rows) step
            if R > 7:
                alone7, _, _ = _native_rows(model, inputs, R=7)
                assert torch.equal(alone7, logits[:7]), f"R={R}: the first 7 rows differ from a 7-row step"
    finally:
        torch.set_num_threads(threads)


def test_native_wide_step_packed_and_unpacked_agree(monkeypatch):
    on, off = _odd_model(monkeypatch, True, 131), _odd_model(monkeypatch, False, 131)
    assert isinstance(off.layers[0].gate_up, OneDnnLinear)
    gen = torch.Generator().manual_seed(21)
    inputs = _decode_inputs(on, 40, gen)
    a, ca, da = _native_rows(on, inputs)
    b, cb, db = _native_rows(off, inputs)
    assert da._struct.qkv_p and not db._struct.qkv_p
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for x, y in zip(ca, cb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _engine_greedy(path, monkeypatch, packed: str, prompts, sizes: list[int]) -> list[list[int]]:
    from services.executor.engine.config import EngineConfig
    from services.executor.engine.engine import LLMEngine
    from services.executor.engine.sampling_params import SamplingParams

    monkeypatch.setenv("WEFT_NATIVE_DECODE", "1")
    monkeypatch.setenv("WEFT_PACKED_GEMM", packed)
    engine = LLMEngine(path, EngineConfig(block_size=4, num_kv_blocks=128, enable_prefix_caching=True))
    assert engine.runner.native is not None
    assert isinstance(engine.model.layers[0].gate_up, PackedLinear) is (packed == "1")
    step_rows = engine.runner.native.step_rows
    monkeypatch.setattr(engine.runner.native, "step_rows", lambda ids, *a: sizes.append(ids.shape[0]) or
                        step_rows(ids, *a))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_engine_greedy_tokens_are_the_same_with_the_packed_gemm_on_and_off(monkeypatch, tmp_path):
    path = make_tiny_checkpoint(tmp_path / "ckpt", "tiny", "qwen2", seed=6)
    prefix = [5, 9, 200, 31, 7, 12, 90, 4]
    prompts = [prefix + [i] for i in range(9)] + [[44, 3, 900], [6] * 11, [17] * 3, list(range(40, 63))]
    sizes_on: list[int] = []
    on = _engine_greedy(path, monkeypatch, "1", prompts, sizes_on)
    off = _engine_greedy(path, monkeypatch, "0", prompts, [])
    assert on == off
    assert max(sizes_on) == len(prompts) and any(s >= 12 for s in sizes_on), sizes_on  # wide steps ran


def test_a_decode_steps_rows_have_the_bits_of_the_same_rows_in_a_wider_step(monkeypatch):
    model = _odd_model(monkeypatch, True, 131)
    inputs = _decode_inputs(model, 64, torch.Generator().manual_seed(64))
    wide, wide_caches, dec = _native_rows(model, inputs)
    assert dec._struct.qkv_p, "the packed copies were not handed to the native step"
    for R in (7, 8, 13, 47, 48, 49):
        logits, caches, _ = _native_rows(model, inputs, R=R)
        assert torch.equal(logits, wide[:R]), f"R={R}: rows differ from the 64-row step"

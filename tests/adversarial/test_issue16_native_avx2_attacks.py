"""Issue 16, attacks on the native decode step's AVX2 paths (b3fc119, 10fd0eb): the
register-tiled GEMM of decode_batch.c (6-row weight tiles as two 3-row halves, 4 activation
rows, 8-float chunks with a masked tail), SiLU through exp8, and llama_step.h's
attend_kv_heads (token slots looked up once, 8-token key blocks, exp8 softmax, the head's
output in registers 8 chunks at a time, a masked last chunk) which the batch-1 step
(decode.c) now calls per KV head. On an AVX2 machine without AVX-512 (the build uses
-march=native) these are the paths that run; elsewhere the same tests check whichever path
the CPU gets. Every case compares the native logits and the K/V slots written against the
torch forward pass, for the multi-row step and the batch-1 step of the same library:
head_dim around multiples of 8, hidden sizes with k % 8 in 1..7 and k < 8, intermediate and
vocab sizes off the 6-row tile, 1..70 rows, a few thousand tokens of context over block
sizes 1, 3 and 16 with scattered blocks, GQA groups 1..8, thread counts 1, 3 and 8, and
NaN / +-inf / huge values in the cache, the embeddings and the weights (a non-finite
result where torch has one, the torch result where torch is finite, and no leak into the
other rows of a register tile)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.selector import backend_class
from services.executor.model.config import ModelConfig
from services.executor.model.llama import LlamaModel
from services.executor.model.native import library
from weft.testing.tiny_model import model_config_dict, random_weights

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("WEFT_NATIVE_CC", "gcc")) is None or not library.native_enabled(),
    reason="needs gcc and WEFT_NATIVE_DECODE not 0")

NAN, INF = float("nan"), float("inf")


def _model(overrides: dict | None = None, seed: int = 1, gains: dict | None = None,
           edits: dict | None = None) -> LlamaModel:
    config = ModelConfig.from_dict({**model_config_dict("tiny", "llama"), "num_hidden_layers": 1,
                                    **(overrides or {})})
    weights = random_weights(config, seed=seed)
    for name, (index, value) in (edits or {}).items():
        weights[name] = weights[name].clone()
        weights[name][index] = value
    for name in weights:
        for suffix, gain in (gains or {}).items():
            if name.endswith(suffix):
                weights[name] = weights[name] * gain
    return LlamaModel(config, weights, backend_class("torch"), native_decode=True)



class Case:
    """R rows over one scattered block pool: each row owns its blocks (in random order
    over the pool), the table is wider than any row needs and its unused entries are
    garbage block ids (nothing may read them), the caches random."""

    def __init__(self, model: LlamaModel, bs: int, lens: list[int], seed: int = 0, spare: int = 3):
        gen = torch.Generator().manual_seed(seed)
        rows, width = len(lens), max(-(-n // bs) for n in lens) + 2
        need = sum(-(-n // bs) for n in lens)
        num_blocks = need + spare
        free = iter(torch.randperm(num_blocks, generator=gen).tolist())
        # past the widest row: ids far outside the pool (a read of one would fault or be garbage)
        table = torch.full((rows, width), 1 << 30, dtype=torch.int32)
        for r, n in enumerate(lens):
            own = -(-n // bs)
            table[r, :own] = torch.tensor([next(free) for _ in range(own)], dtype=torch.int32)
        # entries a row does not own, up to the widest row (torch gathers them, masked): a
        # spare block of random data no row owns (a read of one is a wrong answer, not a
        # fault; never poisoned, as torch's masked 0 * v would turn a NaN there into NaN)
        widest, pad = max(-(-n // bs) for n in lens), next(free)
        table[:, :widest][table[:, :widest] == 1 << 30] = pad
        self.model, self.bs, self.lens, self.table = model, bs, lens, table
        shape = (2, num_blocks, bs, model.num_kv_heads, model.head_dim)
        self.caches = [torch.randn(shape, generator=gen) for _ in range(model.num_layers)]
        self.slots = torch.tensor([int(table[r, (n - 1) // bs]) * bs + (n - 1) % bs for r, n in enumerate(lens)])
        self.positions = torch.tensor([n - 1 for n in lens])
        self.tokens = torch.randint(0, model.lm_head.out_features, (rows,), generator=gen)

    def torch_forward(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = [c.clone() for c in self.caches]
        with torch.no_grad():
            logits = self.model.compute_logits(self.model.forward(
                self.tokens, self.positions, caches, AttentionMetadata.decode_only(self.slots, self.table, self.lens)))
        return logits, caches

    def native_rows(self, threads: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = [c.clone() for c in self.caches]
        with _threads(threads):
            logits = self.model.native_decoder(caches).step_rows(
                self.tokens, self.positions, self.slots, self.table,
                torch.tensor(self.lens, dtype=torch.int32), tuple(self.lens))
        return logits, caches

    def native_steps(self, threads: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The batch-1 step, row after row (each writes its own slot, reads its own blocks)."""
        caches = [c.clone() for c in self.caches]
        decoder = self.model.native_decoder(caches)
        with _threads(threads):
            out = [decoder.step(int(self.tokens[r]), int(self.positions[r]), int(self.slots[r]),
                                self.table[r].contiguous(), n)[0] for r, n in enumerate(self.lens)]
        return torch.stack(out), caches


class _threads:
    def __init__(self, n: int | None):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self):
        if self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    for r in range(want.shape[0]):
        torch.testing.assert_close(got[r], want[r], rtol=tol, atol=tol, equal_nan=True,
                                   msg=lambda m: f"{what} row {r}: {m}")


def _check(case: Case, threads: int | None = None, tol: float = 1e-4, cache_tol: float = 1e-5,
           batch1: bool = True) -> None:
    want, want_caches = case.torch_forward()
    paths = {"rows": case.native_rows(threads)}
    if batch1:
        paths["batch-1"] = case.native_steps(threads)
    for name, (got, caches) in paths.items():
        _close(got, want, name, tol)
        for layer, (c, ref) in enumerate(zip(caches, want_caches)):
            torch.testing.assert_close(c, ref, rtol=cache_tol, atol=cache_tol, equal_nan=True,
                                       msg=lambda m: f"{name} cache layer {layer}: {m}")


# ---- shapes ---------------------------------------------------------------------------

# lengths around the 8-token key blocks: 1, inside, at and past a block, several blocks
LENS_8 = [1, 7, 8, 9, 16, 17, 40]


@pytest.mark.parametrize("head_dim", [2, 4, 6, 8, 10, 14, 16, 18, 30, 56, 62, 64, 66, 72, 120, 130, 136])
def test_head_dim_around_multiples_of_8(head_dim):
    # 2 KV heads of group 2: the masked chunk at every position of the 8-chunk register group
    model = _model({"head_dim": head_dim, "hidden_size": 40, "intermediate_size": 50, "vocab_size": 97})
    _check(Case(model, 4, LENS_8, seed=head_dim))


@pytest.mark.parametrize("hidden", [1, 2, 3, 5, 7, 9, 12, 15, 17, 23, 25, 31, 33, 47])
def test_hidden_with_every_tail(hidden):
    # k = hidden in qkv / gate_up / lm_head, k = q_dim = 4 * 6 = 24 in o, k = inter in down
    model = _model({"hidden_size": hidden, "head_dim": 6, "intermediate_size": hidden + 3, "vocab_size": 61})
    _check(Case(model, 3, [1, 5, 9, 13, 2], seed=hidden))


@pytest.mark.parametrize("inter", [1, 2, 3, 4, 5, 7, 11, 13, 19, 37])
@pytest.mark.parametrize("vocab", [3, 5, 7, 13, 1021])
def test_intermediate_and_vocab_off_the_6_row_tile(inter, vocab):
    model = _model({"hidden_size": 20, "head_dim": 10, "intermediate_size": inter, "vocab_size": vocab})
    _check(Case(model, 4, [3, 8, 11, 1, 6, 20, 4], seed=inter * 7 + vocab), batch1=False)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 13, 31, 63, 64, 65, 70])
def test_row_counts_and_tile_remainders(rows):
    model = _model({"hidden_size": 36, "head_dim": 10, "intermediate_size": 45, "vocab_size": 131})
    lens = [1 + (13 * r) % 29 for r in range(rows)]
    _check(Case(model, 4, lens, seed=rows), batch1=rows <= 7)


@pytest.mark.parametrize("bs", [1, 3, 16])
def test_thousands_of_tokens_over_scattered_blocks(bs):
    model = _model({"hidden_size": 32, "head_dim": 18, "intermediate_size": 40, "vocab_size": 67,
                    "max_position_embeddings": 4096})
    # one long row beside short ones; 3001 and 2999: partial 8-token blocks at the end
    _check(Case(model, bs, [3001, 1, 2999, 9], seed=bs), cache_tol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 4), (6, 2), (8, 2), (5, 1), (7, 1), (8, 1)])
def test_gqa_groups_1_to_8(heads, kv_heads):
    model = _model({"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 12,
                    "hidden_size": 30, "intermediate_size": 33, "vocab_size": 89})
    _check(Case(model, 4, [1, 6, 19, 33], seed=heads * 10 + kv_heads))


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_thread_counts(threads, rows):
    # rows < 2 * threads: one attention item per (row, KV head), each thread its own scratch
    model = _model({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 14, "hidden_size": 44,
                    "intermediate_size": 29, "vocab_size": 71})
    _check(Case(model, 3, [1 + (11 * r) % 47 for r in range(rows)], seed=rows), threads=threads)


def test_every_row_one_token_long():
    model = _model({"head_dim": 66, "hidden_size": 19, "intermediate_size": 23, "vocab_size": 37})
    _check(Case(model, 1, [1] * 11, seed=5))


# ---- extreme values -------------------------------------------------------------------

def _poison(case: Case, row: int, token: int, kv: int, head: int, value: float, dim: int | None = None) -> None:
    """Sets token `token` of row `row` (a context token, not the one being written) in
    K (kv 0) or V (kv 1) of every layer's cache, one dimension or the whole head."""
    bs = case.bs
    block = int(case.table[row, token // bs])
    for c in case.caches:
        vec = c[kv, block, token % bs, head]
        if dim is None:
            vec.fill_(value)
        else:
            vec[dim] = value


def _check_nonfinite(case: Case, threads: int | None = None) -> None:
    """Where torch's row is finite, the native row is the same; where torch's row holds a
    NaN / inf, the native row holds one too (never a finite, silently different answer);
    the rows torch keeps finite are untouched by the poisoned ones."""
    want, _ = case.torch_forward()
    for name, (got, _) in {"rows": case.native_rows(threads), "batch-1": case.native_steps(threads)}.items():
        for r in range(want.shape[0]):
            if torch.isfinite(want[r]).all():
                torch.testing.assert_close(got[r], want[r], rtol=1e-4, atol=1e-4,
                                           msg=lambda m: f"{name} row {r} (torch finite): {m}")
            else:
                assert not torch.isfinite(got[r]).all(), f"{name} row {r}: torch non-finite, native finite"


@pytest.mark.parametrize("value", [NAN, INF, -INF, 1e30, -1e30, 3e38])
@pytest.mark.parametrize("kv", [0, 1])
@pytest.mark.parametrize("token", [0, 7, 8, 21])  # the first, last and a middle 8-token key block, the tail
def test_non_finite_and_huge_cache_entries(value, kv, token):
    model = _model({"head_dim": 20, "hidden_size": 24, "intermediate_size": 26, "vocab_size": 53})
    case = Case(model, 4, [23, 23, 9, 30], seed=3)
    _poison(case, 0, token, kv, head=1, value=value, dim=17)  # the masked last chunk of head_dim 20
    _poison(case, 3, token, kv, head=0, value=value)
    if token < 9:
        _poison(case, 2, token, kv, head=1, value=value, dim=0)
    _check_nonfinite(case)


def test_huge_value_vector_beside_normal_tokens():
    # one token's value vector at 1e4 in every row: its softmax weight is ordinary, the
    # output is dominated by it, and every later op must still match torch within 1e-3
    model = _model({"head_dim": 16, "hidden_size": 24, "intermediate_size": 26, "vocab_size": 53})
    case = Case(model, 4, [20, 12], seed=9)
    want, _ = case.torch_forward()
    assert torch.isfinite(want).all()
    # a huge-negative score on one token per row: the clamp in exp8 must give ~0, not 1
    for row in (0, 1):
        for c in case.caches:
            block = int(case.table[row, 3 // case.bs])
            c[1, block, 3 % case.bs] = 1e4
    want, _ = case.torch_forward()
    for name, (got, _) in {"rows": case.native_rows(), "batch-1": case.native_steps()}.items():
        _close(got, want, name, tol=1e-3)


# where: (HF weight name, index set to the value); the tokens of Case(seed=11) are fixed
WEIGHT_EDITS = {
    "lm_head_row": ("lm_head.weight", (13, 5)),  # logit column 13: tile 2, row 1 of 6
    "gate_row_tail": ("model.layers.0.mlp.gate_proj.weight", (4, 20)),  # the masked tail column of k = 21
    "down_col_tail": ("model.layers.0.mlp.down_proj.weight", (2, 16)),  # the masked tail column of k = 17
    "up_row": ("model.layers.0.mlp.up_proj.weight", (16, 3)),  # the last intermediate row, a 5-row tile
}


@pytest.mark.parametrize("where", [*WEIGHT_EDITS, "embed_row"])
@pytest.mark.parametrize("value", [NAN, INF])
def test_non_finite_weights_stay_in_their_row_of_the_tile(where, value):
    shape = {"head_dim": 10, "hidden_size": 21, "intermediate_size": 17, "vocab_size": 29}
    probe = Case(_model(shape), 4, [3, 9, 1, 12, 7, 5], seed=11)
    others = {int(t) for i, t in enumerate(probe.tokens) if i != 1}
    row1_token = min(set(range(shape["vocab_size"])) - others)  # row 1's own token
    edit = {"model.embed_tokens.weight": (row1_token, value)} if where == "embed_row" else \
        {WEIGHT_EDITS[where][0]: (WEIGHT_EDITS[where][1], value)}
    model = _model(shape, edits=edit)
    case = Case(model, 4, [3, 9, 1, 12, 7, 5], seed=11)
    case.tokens[1] = row1_token
    want, _ = case.torch_forward()
    got, _ = case.native_rows()
    if where in ("lm_head_row", "embed_row"):  # one logit column / one row poisoned, the rest finite
        assert torch.isfinite(want).any()
    # (an MLP weight poisons every hidden dimension: torch's logits are all non-finite, and so
    # must the native ones be)
    for r in range(want.shape[0]):
        fin = torch.isfinite(want[r])
        assert torch.equal(torch.isfinite(got[r]), fin), f"row {r}: non-finite pattern differs"
        torch.testing.assert_close(got[r][fin], want[r][fin], rtol=1e-4, atol=1e-4, msg=lambda m: f"row {r}: {m}")


@pytest.mark.parametrize("gain", [40.0, 200.0, 2000.0])
def test_silu_far_out_of_exp8_range(gain):
    # gate values ~ +-gain: exp8 clamps its input to [-87.3, 88.3]
    model = _model({"head_dim": 8, "hidden_size": 16, "intermediate_size": 13, "vocab_size": 41},
                   gains={"mlp.gate_proj.weight": gain})
    case = Case(model, 4, [3, 9, 1, 12, 7], seed=2)
    want, _ = case.torch_forward()
    got, _ = case.native_rows()
    scale = want.abs().max().item()
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(1.0, scale))


def test_one_hot_softmax_over_thousands_of_tokens():
    # scores hundreds apart over 2000+ tokens: every vector-path token far below the max
    model = _model({"head_dim": 24, "hidden_size": 24, "intermediate_size": 20, "vocab_size": 43,
                    "max_position_embeddings": 4096},
                   gains={"self_attn.q_proj.weight": 15.0, "self_attn.k_proj.weight": 15.0})
    _check(Case(model, 16, [2047, 2049, 5], seed=4), tol=1e-4, cache_tol=1e-5)

"""Issue 16, attacks on the seventh pass's attention (72aabab, d9bd226):

* llama_step.h's AVX-512 ``attend_kv_heads`` (attention over the paged KV cache: each
  token's slot looked up once by ``token_slots``, keys in blocks of 16 tokens summed by
  ``reduce16``'s transpose-add tree, an ``exp16`` softmax, values token by token with the
  head's output in registers 8 chunks of 16 at a time, a masked last chunk), which the
  batch-1 step (decode.c, one call per KV head) and the multi-row step (decode_batch.c,
  ``#define attend_row attend_kv_heads``: one call per row, or per (row, KV head) when rows
  are few) now both call. d9bd226 moved the AVX2 version's slot lookup into the same
  ``token_slots``, so the kernel attacks below also run on the shim built for AVX2 without
  AVX-512 and for neither (``attend_head`` per query head) where the CPU runs AVX2.
(The MKL long-prefill route of the same pass: test_issue16_mkl_prefill_route.py.)

What is attacked, and what is expected (every case deterministic, no timing):

1. The kernel itself, through the ctypes shim of native_kernel_shim.py (``shim_attend``:
   decode_batch.c's ``attend_row``, compiled from the real sources with the library's
   flags, plus -mno-avx512f / -mno-avx2 -mno-fma for the other two versions), against a
   float64 reference: context lengths 1..70 and around 128 / 256 (every 16-token block
   position, the masked last block), block sizes 1, 2, 3, 5, 7, 16, 17 and 32 (a 16-token
   key block spanning many cache blocks or a fraction of one), head_dim 1..33, 47..49,
   64..136 and 144, 250, 256, 258 (the masked chunk at every lane, more than 8 chunks: a
   second and third register group of the value pass), GQA groups 1, 2, 3, 4, 5, 8 and
   every [g0, g1) KV-head range the two steps use. Everything the call does not own is NaN:
   the other KV heads of its tokens, the free slots of its last block, the blocks it does
   not own, the query heads outside its range; the outputs it does not own, its scratch
   past (g1 - g0) * group * seq_len scores and its slot scratch past seq_len are
   sentinels. A read of any of them is a NaN in the answer, a write one a changed
   sentinel.
2. Softmax extremes: a one-hot softmax at every token position of 1..33, 40 and 65 tokens
   (reduce16 pairing a score with the wrong token, a wrong slot or a lost masked block
   returns another token's value row), equal scores of +-1e37 (the uniform average, no
   overflow) and of 1e-30, exact integer scores spread far past exp16's clamp (the far
   tokens weigh ~1e-38, not 0, which must stay invisible for ordinary values); 1e30 left
   in the reused score scratch must never be taken for a row's maximum.
3. Non-finite cache entries: NaN / +-inf / +-1e30 in K, NaN / +-inf / +-3e38 in V, in one
   dimension or the whole head, at the first token, the last token of a 16-token block,
   the first of the next and the last token: the native output is non-finite exactly where the float64 reference
   is, equal to it elsewhere, and only the query heads of the poisoned KV head change.
4. Reads past either end (a subprocess, guard pages): the cache's last block (the row's
   last token in the pool's last slot, the last KV head, its V the last floats before a
   PROT_NONE page), the cache's first block right after one, the block table, the
   queries, the outputs, the score and slot scratch all at a page edge, for head_dim % 16
   in 1, 5, 15, 0 and context lengths 1, 15, 16, 17, 31, 33, 48.
(Both decode steps that call this kernel, against torch: test_issue16_avx512_attention_steps.py.)
"""
from __future__ import annotations

import ctypes
import platform
import textwrap
from pathlib import Path

import pytest
import torch

from services.executor.model.native import library
from services.executor.model.native.decoder import _ModelStruct
from tests.adversarial.native_kernel_shim import (  # noqa: F401  (fixtures)
    GUARD_PREAMBLE, INF, NAN, SENT, _build_shim, _declare_shim, _ptr, lib, run_guarded, shim_path)
from tests.adversarial.native_kernel_shim import pytestmark as native_only


# the shim built as the machine's own (-march=native) and, on an x86 CPU with AVX2 and FMA,
# as an AVX2 build without AVX-512 (the AVX2 attend_kv_heads, d9bd226's token_slots) and
# a portable one (attend_head per query head): the same attacks on every version
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


def _cpu_runs_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return platform.machine() in ("x86_64", "AMD64") and " avx2" in flags and " fma" in flags


@pytest.fixture(scope="module", params=list(ISA_FLAGS))
def attn_path(request, lib, tmp_path_factory):
    if not ISA_FLAGS[request.param]:
        return request.getfixturevalue("shim_path")
    if not _cpu_runs_avx2():
        pytest.skip("the AVX2 / portable builds of the shim need an x86 CPU with AVX2 and FMA")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(library, "FLAGS", (*library.FLAGS, *ISA_FLAGS[request.param]))
        return _build_shim(tmp_path_factory.mktemp(f"attn_shim_{request.param}"))


@pytest.fixture(scope="module")
def attn(attn_path):
    return _declare_shim(ctypes.CDLL(attn_path))


# ---- the kernel's operands ----------------------------------------------------------------

class Attn:
    """One ``attend_row`` call: the query heads of KV heads [g0, g1) of a row of ``seq_len``
    tokens over a pool of ``num_blocks`` blocks of ``bs`` slots. The row owns
    ceil(seq_len / bs) blocks in random order (``last_block``: the pool's last one is its
    last block); only its tokens' K/V of heads [g0, g1) and its query heads are data,
    everything else NaN."""

    def __init__(self, gen, *, d: int, kvh: int, group: int, bs: int, seq_len: int, g0: int = 0,
                 g1: int | None = None, spare: int = 2, last_block: bool = False, scale: float | None = None,
                 ints: bool = False):
        g1 = kvh if g1 is None else g1
        own = -(-seq_len // bs)
        self.d, self.kvh, self.group, self.bs, self.seq_len, self.g0, self.g1 = d, kvh, group, bs, seq_len, g0, g1
        self.nh, self.num_blocks = kvh * group, own + spare
        if last_block:  # the pool's last block is the row's last one, the others anywhere before it
            table = [*torch.randperm(self.num_blocks - 1, generator=gen)[:own - 1].tolist(), self.num_blocks - 1]
        else:
            table = torch.randperm(self.num_blocks, generator=gen)[:own].tolist()
        self.table = torch.tensor(table, dtype=torch.int32)
        self.slots = torch.tensor([int(self.table[t // bs]) * bs + t % bs for t in range(seq_len)])
        # (small integers: every score exact in fp32 whatever the summation order)
        data = (lambda *shape: torch.randint(-3, 4, shape, generator=gen).float()) if ints else \
            (lambda *shape: torch.randn(*shape, generator=gen))
        self.cache = torch.full((2, self.num_blocks * bs, kvh, d), NAN)
        self.cache[:, self.slots, g0:g1] = data(2, seq_len, g1 - g0, d)
        self.q = torch.full((self.nh, d), NAN)
        self.heads = slice(g0 * group, g1 * group)
        self.q[self.heads] = data((g1 - g0) * group, d)
        self.scale = d ** -0.5 if scale is None else scale

    @property
    def K(self) -> torch.Tensor:  # [num_blocks * bs, kvh, d] by slot, a view: edit to poison
        return self.cache[0]

    @property
    def V(self) -> torch.Tensor:
        return self.cache[1]

    def run(self, shim) -> torch.Tensor:
        """The kernel's output heads [nh, d]; asserts nothing outside them, past the score
        scratch or past the slot scratch was written."""
        m = _ModelStruct(head_dim=self.d, num_kv_heads=self.kvh, block_size=self.bs, num_blocks=self.num_blocks,
                         scale=self.scale)
        n_scores = (self.g1 - self.g0) * self.group * self.seq_len
        out = torch.full((self.nh * self.d + 16,), SENT)
        scores = torch.full((n_scores + 16,), SENT)
        # past seq_len the slot scratch holds a slot of a NaN block the row does not own: a
        # write there changes it, a read of it gives NaN (not a fault: that is the guard
        # pages' test)
        unowned = min(set(range(self.num_blocks)) - set(self.table.tolist())) * self.bs
        tok = torch.full((self.seq_len + 16,), unowned, dtype=torch.int64)
        cache, q, table = self.cache.contiguous(), self.q.contiguous(), self.table.contiguous()
        shim.shim_attend(ctypes.addressof(m), _ptr(cache), _ptr(q), _ptr(out), _ptr(scores), tok.data_ptr(),
                         self.g0, self.g1, self.group, table.data_ptr(), self.seq_len)
        where = self.where()
        assert (scores[n_scores:] == SENT).all(), f"{where}: written past the score scratch"
        assert (tok[self.seq_len:] == unowned).all(), f"{where}: written past the slot scratch"
        assert (out[self.nh * self.d:] == SENT).all(), f"{where}: written past the output"
        heads = out[:self.nh * self.d].view(self.nh, self.d)
        outside = torch.ones(self.nh, dtype=torch.bool)
        outside[self.heads] = False
        assert (heads[outside] == SENT).all(), f"{where}: wrote a query head outside [g0, g1)"
        return heads[self.heads]

    def reference(self) -> torch.Tensor:
        """float64: softmax(scale * q . K) @ V per query head of [g0, g1)."""
        heads = torch.arange(self.nh)[self.heads]
        K = self.cache[0, self.slots][:, heads // self.group].double()  # [seq_len, heads, d]
        V = self.cache[1, self.slots][:, heads // self.group].double()
        q = self.q[self.heads].double()
        s = torch.einsum("hd,thd->ht", q, K) * self.scale
        return torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), V)

    def where(self) -> str:
        return (f"d={self.d} kvh={self.kvh} group={self.group} bs={self.bs} seq_len={self.seq_len} "
                f"g=[{self.g0},{self.g1}) blocks={self.table.tolist()}")

    def check(self, shim, tol: float = 1e-5) -> None:
        got, want = self.run(shim), self.reference()
        assert torch.isfinite(got).all(), f"{self.where()}: a NaN the call does not own was read"
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=lambda m: f"{self.where()}: {m}")


# ---- 1. shapes, ownership ---------------------------------------------------------------

LENS = [*range(1, 71), 127, 128, 129, 255, 256, 257]
BLOCKS = [1, 2, 3, 5, 7, 16, 17, 32]
DIMS = [1, 2, 3, 5, 7, 8, 9, 13, 15, 16, 17, 31, 32, 33, 64, 127, 128, 129, 130, 144, 250, 258]


@native_only
def test_every_context_length_and_block_size(attn):
    # every 16-token block position (1..70: the masked last key block at each nt = 1..16)
    # over block sizes that cut a 16-token block anywhere; head_dim cycles through tails
    gen = torch.Generator().manual_seed(1)
    for i, seq_len in enumerate(LENS):
        for j, bs in enumerate(BLOCKS):
            d = DIMS[(i + 3 * j) % len(DIMS)]
            Attn(gen, d=d, kvh=2, group=2, bs=bs, seq_len=seq_len, last_block=(i + j) % 2 == 0).check(attn)


@native_only
def test_every_head_dim_tail_and_register_group(attn):
    # the masked chunk at every lane (d % 16 = 0..15) and more than 8 chunks (d > 128: the
    # value pass's second and third groups of up to 8 chunks, 250: the tail in the last
    # chunk of a full group, 258: a group of one masked chunk)
    gen = torch.Generator().manual_seed(2)
    for d in [*range(1, 34), 47, 48, 49, 64, 80, 96, 112, 120, 127, 128, 129, 130, 136, 144, 250, 256, 258]:
        for seq_len in (1, 16, 17, 33):
            Attn(gen, d=d, kvh=2, group=3, bs=16 if d % 2 else 5, seq_len=seq_len, last_block=d % 3 == 0).check(attn)


@native_only
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
def test_gqa_groups_and_every_kv_head_range(attn, group):
    # decode.c calls one KV head at a time, decode_batch.c all of a row's or one (row, KV
    # head) item: every [g0, g1) of 3 KV heads, the rest of the queries and cache NaN
    gen = torch.Generator().manual_seed(3 + group)
    for g0, g1 in ((0, 1), (1, 2), (2, 3), (0, 2), (1, 3), (0, 3)):
        for seq_len, d, bs in ((1, 64, 16), (15, 17, 3), (16, 64, 16), (17, 33, 1), (31, 16, 7), (33, 64, 32),
                               (64, 130, 16)):
            Attn(gen, d=d, kvh=3, group=group, bs=bs, seq_len=seq_len, g0=g0, g1=g1).check(attn)


@native_only
def test_garbage_in_the_reused_scratch_is_never_read(attn):
    # one scratch serves rows of every length in turn (a thread of decode_batch.c): before
    # each call the score scratch holds 1e30 (taken for a maximum, every real score
    # underflows and the softmax turns uniform) and the slot scratch a slot of a NaN block
    # the row does not own, past this call's seq_len as well as before it
    gen = torch.Generator().manual_seed(4)
    cases = [Attn(gen, d=20, kvh=2, group=2, bs=bs, seq_len=n) for n, bs in ((300, 16), (1, 16), (17, 3), (299, 5),
                                                                             (33, 16), (16, 1))]
    n = max(c.seq_len for c in cases) * 4
    scores, tok = torch.empty(n), torch.empty(n, dtype=torch.int64)
    for c in cases:
        spare = min(set(range(c.num_blocks)) - set(c.table.tolist()))
        scores.fill_(1e30)
        tok.fill_(spare * c.bs)
        m = _ModelStruct(head_dim=c.d, num_kv_heads=c.kvh, block_size=c.bs, num_blocks=c.num_blocks, scale=c.scale)
        out = torch.full((c.nh, c.d), SENT)
        attn.shim_attend(ctypes.addressof(m), _ptr(c.cache), _ptr(c.q), _ptr(out), _ptr(scores), tok.data_ptr(),
                         0, c.kvh, c.group, c.table.data_ptr(), c.seq_len)
        torch.testing.assert_close(out.double(), c.reference(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{c.where()}: {m}")


# ---- 2. softmax extremes ----------------------------------------------------------------

@native_only
def test_one_hot_softmax_picks_the_right_token_at_every_position(attn):
    # K[t*] all ones, every other key small, q all 1e3: a one-hot softmax, the output
    # V[t*]; a score paired with the wrong token (reduce16's lanes, the slot lookup, the
    # masked last block) returns another token's value row
    gen = torch.Generator().manual_seed(5)
    for seq_len in (*range(1, 34), 40, 65):
        for star in range(seq_len):
            c = Attn(gen, d=24, kvh=1, group=2, bs=(3, 16, 5)[seq_len % 3], seq_len=seq_len)
            K = c.K[c.slots, 0]
            K.mul_(0.01)
            K[star] = 1.0
            c.K[c.slots, 0] = K
            c.q[:] = 1e3
            got = c.run(attn)
            want = c.V[c.slots[star], 0].expand(2, -1)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"seq_len={seq_len} token={star}: {m}")


@native_only
@pytest.mark.parametrize("magnitude", [1e37, -1e37, 1e-30])
def test_equal_scores_of_any_magnitude_give_the_uniform_average(attn, magnitude):
    # every key the same: every score equal (+-1e37 after scale: e^(s - max) must be
    # computed as e^0, not overflow or underflow), the output the mean of the values
    gen = torch.Generator().manual_seed(6)
    for seq_len in (1, 15, 16, 17, 33, 100):
        c = Attn(gen, d=16, kvh=1, group=1, bs=7, seq_len=seq_len, scale=abs(magnitude))
        c.K[c.slots, 0] = torch.ones(16)
        c.q[:] = 1.0 / 16 * (1 if magnitude > 0 else -1)
        got = c.run(attn)
        want = c.V[c.slots, 0].double().mean(0, keepdim=True)
        assert torch.isfinite(got).all(), f"seq_len={seq_len}: {got}"
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"seq_len={seq_len}: {m}")


@native_only
def test_scores_far_past_the_exp_clamp(attn):
    # integer q and K and a power-of-two scale: every score exact in fp32, spread over
    # [-2 * 288 * scale, 0] around the max (up to ~37,000); from scale 1 up most tokens'
    # e^(s - max) underflow to 0 in float64 and clamp to ~1e-38 in exp16, which must not
    # show with ordinary values (the answer is the float64 one)
    gen = torch.Generator().manual_seed(7)
    for seq_len in (2, 16, 17, 40, 300):
        for scale in (2.0 ** -4, 1.0, 4.0, 64.0):
            Attn(gen, d=32, kvh=2, group=2, bs=16, seq_len=seq_len, scale=scale, ints=True).check(attn)


# ---- 3. non-finite cache entries ----------------------------------------------------------

# (a huge K is 1e30, not 3e38: q . K of 3e38 overflows fp32 where float64 does not, on
# torch's fp32 path as well)
POISON = [(0, NAN), (0, INF), (0, -INF), (0, 1e30), (0, -1e30), (1, NAN), (1, INF), (1, -INF), (1, 3e38), (1, -3e38)]


@native_only
@pytest.mark.parametrize("kv,value", POISON)
def test_non_finite_and_huge_cache_entries_stay_in_their_kv_head(attn, kv, value):
    # one dimension (the masked last chunk of head_dim 20) or the whole vector of KV head 1
    # at the first token, the last of a 16-token block, the first of the next, the last:
    # native non-finite exactly where float64 is, equal elsewhere; KV heads 0 and 2 exact
    gen = torch.Generator().manual_seed(8)
    for seq_len in (1, 16, 17, 33):
        for token in sorted({0, 15, 16, seq_len - 1} & set(range(seq_len))):
            for dim in (17, None):
                c = Attn(gen, d=20, kvh=3, group=2, bs=5, seq_len=seq_len)
                vec = c.cache[kv, c.slots[token], 1]
                if dim is None:
                    vec.fill_(value)
                else:
                    vec[dim] = value
                got, want = c.run(attn).double(), c.reference()
                where = f"{c.where()} kv={kv} token={token} dim={dim} value={value}"
                fin = torch.isfinite(want)
                assert torch.equal(torch.isfinite(got), fin), f"{where}: finite pattern {torch.isfinite(got)}"
                torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}")
                assert fin[[0, 1, 4, 5]].all(), f"{where}: the poison reached another KV head"


# ---- 4. no read past either end ---------------------------------------------------------

GUARD_SCRIPT = GUARD_PREAMBLE + textwrap.dedent("""
    from services.executor.model.native.decoder import _ModelStruct

    def guarded(values, at_end):
        # a copy of values (any dtype) ending right before a PROT_NONE page (at_end) or
        # starting right after one
        values = values.reshape(-1).contiguous()
        nbytes = values.numel() * values.element_size()
        pages = (nbytes + PAGE - 1) // PAGE + 1
        mm = mmap.mmap(-1, pages * PAGE)
        keep.append(mm)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        assert libc.mprotect(base + (pages - 1) * PAGE if at_end else base, PAGE, 0) == 0
        offset = (pages - 1) * PAGE - nbytes if at_end else PAGE
        t = torch.frombuffer(mm, dtype=values.dtype, count=values.numel(), offset=offset)
        t.copy_(values)
        return t

    g = torch.Generator().manual_seed(0)
    wrong, done = [], 0
    for at_end in (True, False):
        for d in (1, 5, 15, 16, 17, 33, 64, 130):
            for bs in (1, 3, 16):
                for seq_len in (1, 15, 16, 17, 31, 33, 48):
                    for kvh, group in ((1, 1), (2, 3)):
                        own = -(-seq_len // bs)
                        nb = own + 1
                        # at the end: the row's last block the pool's last (its last token in
                        # the pool's last slot when seq_len % bs == 0), the last KV head; at
                        # the start: its first block the pool's first, KV head 0
                        blocks = list(range(1, own)) + [nb - 1] if at_end else list(range(own))
                        g0 = kvh - 1 if at_end else 0
                        m = _ModelStruct(head_dim=d, num_kv_heads=kvh, block_size=bs, num_blocks=nb,
                                         scale=d ** -0.5)
                        cache = guarded(torch.randn(2, nb * bs, kvh, d, generator=g), at_end)
                        q = guarded(torch.randn(kvh * group, d, generator=g), at_end)
                        table = guarded(torch.tensor(blocks, dtype=torch.int32), at_end)
                        n_scores = group * seq_len
                        scores = guarded(torch.zeros(n_scores), at_end)
                        tok = guarded(torch.zeros(seq_len, dtype=torch.int64), at_end)
                        out = guarded(torch.zeros(kvh * group * d), at_end)
                        shim.shim_attend(ctypes.addressof(m), cache.data_ptr(), q.data_ptr(), out.data_ptr(),
                                         scores.data_ptr(), tok.data_ptr(), g0, g0 + 1, group, table.data_ptr(),
                                         seq_len)
                        c = cache.view(2, nb * bs, kvh, d)
                        slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(seq_len)])
                        K, V = c[0, slots, g0].double(), c[1, slots, g0].double()
                        qs = q.view(kvh * group, d)[g0 * group:(g0 + 1) * group].double()
                        want = torch.softmax(qs @ K.T * d ** -0.5, -1) @ V
                        got = out.view(kvh * group, d)[g0 * group:(g0 + 1) * group].double()
                        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                            wrong.append((at_end, d, bs, seq_len, kvh, group))
                        done += 1
    print("DONE", done, "WRONG", wrong)
""")


@native_only
def test_no_attention_read_past_the_pool_or_the_scratch(attn_path):
    # in a child: a masked tail load, a 16-token key block or the value pass that touched
    # one float past the pool's last slot (or before its first) kills it, not this run
    out = run_guarded(GUARD_SCRIPT, attn_path)
    assert "DONE 672 WRONG []" in out, out[-2000:]

"""Issue 16, the native multi-row decode step on a CPU without AVX-512 or AVX2 (an
aarch64 server, an older or emulated x86): decode_batch.c called ``_mm_prefetch``
outside its AVX guards, so the library failed to compile there and the batch-1 step,
which built before the multi-row step joined it, was lost with it (the executor fell
back to torch for every decode). Built here with the vector extensions turned off,
the library must compile, load and compute what the torch forward pass computes, on
the AVX2 path and on the plain-C path."""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import stat
from pathlib import Path

import pytest
import torch

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.selector import backend_class
from services.executor.model.config import ModelConfig
from services.executor.model.llama import LlamaModel
from services.executor.model.native import library
from services.executor.model.native.decoder import NativeDecoder
from weft.testing.tiny_model import model_config_dict, random_weights

COMPILER = os.environ.get("WEFT_NATIVE_CC", "gcc")
pytestmark = pytest.mark.skipif(
    shutil.which(COMPILER) is None or platform.machine() not in ("x86_64", "AMD64") or not library.native_enabled(),
    reason="needs gcc on x86-64 (the extensions are turned off with x86 flags) and WEFT_NATIVE_DECODE not 0")

BLOCK_SIZE = 4
NUM_BLOCKS = 64
# flags appended after -march=native: the last one wins, as on a CPU that lacks them
WITHOUT = {
    "avx2_only": ("-mno-avx512f",),
    "no_avx": ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-avx"),
}


def _compiler_without(directory: Path, flags: tuple[str, ...]) -> str:
    """A compiler command that builds as the real one does, minus the given extensions."""
    script = directory / "cc-without"
    script.write_text(f'#!/bin/sh\nexec {shutil.which(COMPILER)} "$@" {" ".join(flags)}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    # odd shapes: hidden 72 and head_dim 18 leave tails in every dot product
    config = ModelConfig.from_dict({**model_config_dict("tiny", "llama"), "hidden_size": 72, "head_dim": 18,
                                    "intermediate_size": 131, "vocab_size": 1022})
    return LlamaModel(config, random_weights(config, seed=4), backend_class("torch"), native_decode=True)


@pytest.mark.parametrize("variant", list(WITHOUT))
def test_library_builds_and_matches_torch_without_vector_extensions(model, variant, tmp_path):
    lib = library._declare(ctypes.CDLL(str(library.build(_compiler_without(tmp_path, WITHOUT[variant]), tmp_path))))
    gen = torch.Generator().manual_seed(2)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    caches_torch = [torch.randn(shape, generator=gen) for _ in range(model.num_layers)]
    caches_native = [c.clone() for c in caches_torch]
    lens = [3, 4, 5, 17, 40]  # inside, at the end of and just past a block; several blocks
    table = torch.randperm(NUM_BLOCKS, generator=gen)[:5 * 10].reshape(5, 10).to(torch.int32).contiguous()
    slots = torch.tensor([int(table[r, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                          for r, n in enumerate(lens)])
    positions = torch.tensor([n - 1 for n in lens])
    tokens = torch.randint(0, model.lm_head.out_features, (len(lens),), generator=gen)
    none = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=len(lens), decode_block_tables=table,
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32), num_prefills=0,
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32), prefill_context_lens=none,
        prefill_seq_lens=none, prefill_block_tables=torch.zeros((0, table.shape[1]), dtype=torch.int32),
        decode_seq_lens_host=tuple(lens))
    expected = model.compute_logits(model.forward(tokens, positions, caches_torch, meta))

    decoder = NativeDecoder(lib, model, caches_native)
    rows = decoder.step_rows(tokens, positions, slots, table, torch.tensor(lens, dtype=torch.int32), tuple(lens))
    torch.testing.assert_close(rows, expected, rtol=1e-4, atol=1e-4)
    for native, ref in zip(caches_native, caches_torch):
        torch.testing.assert_close(native, ref, rtol=1e-5, atol=1e-5)
    # the batch-1 step of the same library, over the cache the rows step just wrote
    one = decoder.step(int(tokens[0]), int(positions[0]), int(slots[0]), table[0].contiguous(), lens[0])
    torch.testing.assert_close(one[0], rows[0], rtol=1e-4, atol=1e-4)
    # the greedy argmax of the same library (argmax.c's plain-C loop), ties and NaN included
    logits = expected.clone()
    logits[1, [3, 700]] = 1e4
    assert decoder.argmax_rows(logits) == logits.argmax(-1).tolist()
    logits[2, 5] = float("nan")
    assert decoder.argmax_rows(logits) is None

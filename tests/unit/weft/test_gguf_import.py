"""weft model import-gguf, on small GGUF files written like llama.cpp's converter writes
them (tests/unit/weft/gguf_files.py). The real SmolLM2 file is checked against
transformers' own GGUF loader in tests/parity/test_gguf_smollm2.py."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.unit.weft.gguf_files import permute, write_gguf
from weft.models.gguf_import import GgufImportError, SUPPORTED_TYPES, dequantize, import_gguf, unpermute
from weft.testing.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def weights(path: Path) -> dict[str, np.ndarray]:
    return load_file(str(path / "model.safetensors"))


def test_an_f32_gguf_imports_to_exactly_the_weights_it_was_made_from(tiny, tmp_path):
    out = import_gguf(write_gguf(tiny, tmp_path / "m.gguf"), tmp_path / "out", progress=False)
    original, imported = weights(tiny), weights(out)
    assert imported.keys() == original.keys()
    assert all(np.array_equal(imported[k], original[k]) for k in original)  # Q/K un-permuted too
    config = json.loads((out / "config.json").read_text())
    want = json.loads((tiny / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size"):
        assert config[key] == want[key], key
    assert config["tie_word_embeddings"] is False


def test_unpermute_inverts_llama_cpps_permutation():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        assert np.array_equal(unpermute(permute(w, heads), heads), w)
    assert not np.array_equal(permute(w, 8), w)


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_a_quantized_tensor_dequantizes_as_the_format_defines(tiny, tmp_path, kind):
    """Every 2-D weight stored as ``kind``: the import equals the reference dequantization
    of what was stored (and so stays near the float weights)."""
    def qtype(name, w):
        return kind if w.ndim == 2 else "F32"

    out = import_gguf(write_gguf(tiny, tmp_path / "m.gguf", qtype), tmp_path / "out", progress=False)
    original, imported = weights(tiny), weights(out)
    q = gguf.GGMLQuantizationType[kind]
    for name, w in original.items():
        if w.ndim != 2:
            continue
        expected = gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), q), q)
        # Q/K: quantized in permuted row order; each row is quantized on its own, so
        # un-permuting after dequantizing gives the same rows.
        assert np.array_equal(imported[name], expected), name
        assert np.abs(imported[name] - w).max() <= 0.25 * np.abs(w).max() + 1e-6, name


def _tensor(kind: str, raw: np.ndarray, name: str = "blk.0.ffn_up.weight"):
    return SimpleNamespace(name=name, tensor_type=gguf.GGMLQuantizationType[kind], data=raw)


def test_q6_k_blocks_dequantize_to_the_known_answer():
    """One Q6_K block (256 values): ql[128], qh[64], int8 scales[16], f16 d; y = d·scale·(q − 32)."""
    block = np.zeros(210, dtype=np.uint8)
    block[192:208] = 1  # every scale 1
    block[208:210] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    assert np.array_equal(dequantize(_tensor("Q6_K", block.reshape(1, 210))), np.full((1, 256), -16.0, np.float32))


def test_q4_k_blocks_dequantize_to_the_known_answer():
    """One Q4_K block: f16 d, f16 dmin, 6-bit scales/mins[12], qs[128]; sub-block 0 uses
    scales[0] and the low nibbles of qs[0:32]: y = d·sc·q − dmin·m."""
    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.frombuffer(np.float16(2.0).tobytes(), dtype=np.uint8)  # d
    block[4] = 3  # sub-block 0: scale 3, min 0
    block[16:48] = 0x05  # low nibble 5 (sub-block 0), high nibble 0 (sub-block 1)
    expected = np.zeros((1, 256), np.float32)
    expected[0, :32] = 2.0 * 3 * 5
    assert np.array_equal(dequantize(_tensor("Q4_K", block.reshape(1, 144))), expected)


def test_an_unsupported_tensor_type_is_refused_naming_it_and_the_tensor():
    with pytest.raises(GgufImportError, match=r"blk\.0\.ffn_up\.weight.*Q5_K.*Q4_K"):
        dequantize(_tensor("Q5_K", np.zeros((1, 176), np.uint8)))
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"} <= set(SUPPORTED_TYPES)


def test_an_unsupported_architecture_is_refused_naming_it(tiny, tmp_path):
    with pytest.raises(GgufImportError, match="'falcon'"):
        import_gguf(write_gguf(tiny, tmp_path / "m.gguf", arch="falcon"), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_tensor_without_a_llama_counterpart_is_refused_naming_it(tiny, tmp_path):
    extra = {"blk.0.attn_qkv.weight": np.zeros((4, 4), np.float32)}
    with pytest.raises(GgufImportError, match=r"blk\.0\.attn_qkv\.weight"):
        import_gguf(write_gguf(tiny, tmp_path / "m.gguf", extra_tensors=extra), tmp_path / "out", progress=False)


@pytest.mark.parametrize(("field", "kwargs", "named"), [
    ("tokenizer.ggml.model", {"tokenizer_model": "llama"}, "'llama'"),
    ("tokenizer.ggml.pre", {"pre": "qwen2"}, "'qwen2'"),
])
def test_an_unsupported_tokenizer_is_refused_naming_it(tiny, tmp_path, field, kwargs, named):
    with pytest.raises(GgufImportError, match=f"{field}.*{named}"):
        import_gguf(write_gguf(tiny, tmp_path / "m.gguf", **kwargs), tmp_path / "out", progress=False)


def test_garbage_and_missing_files_are_clear_errors(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(GgufImportError, match="not a readable GGUF"):
        import_gguf(junk, tmp_path / "out", progress=False)
    with pytest.raises(FileNotFoundError):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out", progress=False)


def test_the_tokenizer_and_chat_template_come_from_the_gguf_vocabulary(tiny, tmp_path):
    from services.shared.tokenizer import Tokenizer

    out = import_gguf(write_gguf(tiny, tmp_path / "m.gguf"), tmp_path / "out", progress=False)
    tok = Tokenizer.from_dir(out)
    for text in ("Hello world", "digits 2024 split one by one", "naïve café 🙂", "<|im_start|>user\nhi<|im_end|>"):
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text if "im_start" in text \
            else tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_end|>") == [2]  # special tokens stay whole
    assert [tok.token_to_id(d) for d in "2024"] == list(tok.encode("2024"))  # smollm: one piece per digit
    assert tok.eos_token_ids[0] == 2
    original = json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"]
    assert tok.chat_template == original


def test_an_import_replaces_the_old_checkpoint_whole_and_a_failed_one_leaves_it(tiny, tmp_path):
    out = tmp_path / "out"
    import_gguf(write_gguf(tiny, tmp_path / "a.gguf"), out, progress=False)
    (out / "stale.txt").write_text("from an older import")
    import_gguf(tmp_path / "a.gguf", out, progress=False)
    assert not (out / "stale.txt").exists()
    with pytest.raises(GgufImportError):
        import_gguf(write_gguf(tiny, tmp_path / "b.gguf", arch="falcon"), out, progress=False)
    assert (out / "model.safetensors").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_the_ggufs_add_bos_token_decides_whether_encodings_start_with_bos(tiny, tmp_path, add_bos):
    import transformers

    from services.shared.tokenizer import Tokenizer

    out = import_gguf(write_gguf(tiny, tmp_path / "m.gguf", add_bos=add_bos), tmp_path / "out", progress=False)
    ids = list(Tokenizer.from_dir(out).encode("Hello there"))
    bos = json.loads((out / "generation_config.json").read_text())["bos_token_id"]
    assert (ids[0] == bos) is bool(add_bos)
    assert transformers.AutoTokenizer.from_pretrained(out).encode("Hello there") == ids

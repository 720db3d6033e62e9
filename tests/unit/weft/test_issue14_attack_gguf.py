"""Hostile and broken GGUF files (issue 14's attack): each is a GgufImportError naming the
problem, found before anything is dequantized or written, in time and memory bounded by
the file; the CLI exits 1 with one line, no traceback and no half-written directory."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from tests.unit.weft.gguf_files import write_gguf
from weft.models.gguf_import import GgufImportError, import_gguf
from weft.testing.tiny_model import make_tiny_checkpoint

_U32, _STR, _ARR = 4, 8, 9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _s(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def _header(tensors: int, kvs: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, kvs)


_ARCH = _s("general.architecture") + struct.pack("<I", _STR) + _s("llama")


@pytest.mark.parametrize(("data", "named"), [
    (_header(1 << 40, 1) + _ARCH, "tensor count 1099511627776"),
    (_header(0, 1 << 40) + _ARCH, "claims 1099511627776 entries"),
    (_header(0, 1) + struct.pack("<Q", 1 << 60) + b"general", "metadata key claims 1152921504606846976 bytes"),
    (_header(0, 1) + _s("general.architecture") + struct.pack("<IQ", _STR, 1 << 60) + b"llama",
     "general.architecture claims 1152921504606846976 bytes"),
    # 10^6 u32 claimed, 64 bytes present: the gguf reader looped a million times on empty
    # reads (with 10^9 it grew ~200 MB/s of RSS until killed)
    (_header(0, 2) + _ARCH + _s("tokenizer.ggml.token_type") + struct.pack("<IIQ", _ARR, _U32, 10**6) + bytes(64),
     "tokenizer.ggml.token_type claims 1000000 entries"),
    (_header(0, 1) + _s("x") + struct.pack("<I", 99) + bytes(16), "value type 99"),
], ids=["tensor_count_2e40", "kv_count_2e40", "key_length_2e60", "string_length_2e60", "array_1e6_u32",
        "unknown_value_type"])
def test_a_header_claiming_more_than_the_file_holds_is_refused_naming_the_field(tmp_path, data, named):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    with pytest.raises(GgufImportError, match=named):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_truncated_file_names_the_tensor_past_its_end(tiny, tmp_path):
    path = write_gguf(tiny, tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(GgufImportError, match=r"tensor '.*' ends at byte \d+, past the end of the file"):
        import_gguf(path, tmp_path / "out", progress=False)


@pytest.fixture(autouse=True)
def _keep_logging(monkeypatch):
    """The model commands reconfigure structlog onto this test's captured stderr, which
    later tests' cached loggers would then write to after it is closed: not here."""
    import weft.cli.model_cli

    monkeypatch.setattr(weft.cli.model_cli, "_quiet_logs", lambda: None)


def _write_patched(monkeypatch, tiny: Path, path: Path, method: str, change, **kwargs) -> Path:
    original = getattr(gguf.GGUFWriter, method)
    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, method, lambda self, value: original(self, change(value)))
        return write_gguf(tiny, path, **kwargs)


@pytest.mark.parametrize(("method", "change", "named"), [
    ("add_vocab_size", lambda n: n + 1000, r"'output.weight' has shape \[1024, 64\].*\[2024, 64\]"),
    ("add_head_count", lambda n: 0, "llama.attention.head_count is 0, expected a positive integer"),
    ("add_head_count", lambda n: 2 * n, r"'blk.0.attn_k.weight' has shape"),
    ("add_block_count", lambda n: n + 3, "lacks 27 tensor.*model.layers.2"),
    ("add_token_list", lambda tokens: tokens + ["extra"], "1025 tokens, more than vocab_size 1024"),
])
def test_metadata_that_disagrees_with_the_tensors_is_refused_before_writing(monkeypatch, tiny, tmp_path, method,
                                                                            change, named):
    if method == "add_token_list":  # token types must stay one per token
        original = gguf.GGUFWriter.add_token_types
        monkeypatch.setattr(gguf.GGUFWriter, "add_token_types", lambda self, t: original(self, list(t) + [1]))
    path = _write_patched(monkeypatch, tiny, tmp_path / "m.gguf", method, change)
    with pytest.raises(GgufImportError, match=named):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_bos_id_outside_the_vocabulary_with_add_bos_is_an_import_error(monkeypatch, tiny, tmp_path):
    path = _write_patched(monkeypatch, tiny, tmp_path / "m.gguf", "add_bos_token_id", lambda i: 10**6, add_bos=True)
    with pytest.raises(GgufImportError, match="bos_id 1000000 is outside the vocabulary"):
        import_gguf(path, tmp_path / "out", progress=False)


def test_the_cli_fails_in_one_line_without_a_traceback_or_leftovers(monkeypatch, tiny, tmp_path):
    path = _write_patched(monkeypatch, tiny, tmp_path / "m.gguf", "add_bos_token_id", lambda i: 10**6, add_bos=True)
    out = tmp_path / "out" / "ckpt"
    done = subprocess.run([sys.executable, "-m", "weft.cli", "model", "import-gguf", "--no-progress", str(path),
                           str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "bos_id 1000000 is outside the vocabulary" in done.stderr
    assert done.stdout == ""
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_a_full_disk_while_writing_the_weights_is_one_line_and_leaves_nothing(monkeypatch, tiny, tmp_path, capsys):
    """safetensors raises its own SafetensorError (not an OSError) on ENOSPC: `weft model
    import-gguf` and `weft up --model x.gguf` printed a traceback."""
    import safetensors.numpy
    from safetensors import SafetensorError

    from weft.cli import main

    path = write_gguf(tiny, tmp_path / "m.gguf")

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    out = tmp_path / "out" / "ckpt"
    with pytest.raises(OSError, match="No space left on device"):
        import_gguf(path, out, progress=False)
    assert list(out.parent.iterdir()) == []
    assert main(["model", "import-gguf", "--no-progress", str(path), str(out)]) == 1
    assert "weft model import-gguf failed: could not write the weights" in capsys.readouterr().err


@pytest.mark.parametrize(("method", "change", "named"), [
    ("add_token_merges", lambda merges: list(merges) + ["zzzq qqqz"], "Token `zzzq` out of vocabulary"),
    ("add_token_merges", lambda merges: ["abc"] + list(merges), "cannot be parsed"),
    ("add_chat_template", lambda template: "{% if %}", "Expected an expression"),
], ids=["merge_of_unknown_tokens", "merge_without_a_pair", "template_syntax_error"])
def test_a_vocabulary_or_template_the_router_cannot_load_is_refused_at_import(monkeypatch, tiny, tmp_path, method,
                                                                             change, named):
    """These imported, were cached, and `weft up` then failed with the router exiting during startup."""
    path = _write_patched(monkeypatch, tiny, tmp_path / "m.gguf", method, change)
    with pytest.raises(GgufImportError, match=f"do not make a loadable tokenizer: .*{named}"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("target", [".", "models"], ids=["working_directory", "a_directory_of_models"])
def test_an_existing_directory_that_is_no_checkpoint_is_not_replaced(tiny, tmp_path, monkeypatch, target):
    """`weft model import-gguf x.gguf .` deleted everything in the working directory, and
    `... models` a directory holding other models ("an existing one is replaced whole")."""
    path = write_gguf(tiny, tmp_path / "m.gguf")
    work = tmp_path / "work"
    precious = work / "models" / "other" / "weights.bin"
    precious.parent.mkdir(parents=True)
    precious.write_bytes(b"keep")
    (work / "notes.txt").write_text("keep")
    monkeypatch.chdir(work)
    with pytest.raises(FileExistsError, match="is not a checkpoint directory"):
        import_gguf(path, target, progress=False)
    assert precious.read_bytes() == b"keep" and (work / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in work.iterdir()) == ["models", "notes.txt"]
    assert sorted(p.name for p in (work / "models").iterdir()) == ["other"]


def test_an_empty_directory_or_an_old_checkpoint_is_still_the_target(tiny, tmp_path, monkeypatch):
    path = write_gguf(tiny, tmp_path / "m.gguf")
    (tmp_path / "empty").mkdir()
    assert (import_gguf(path, tmp_path / "empty", progress=False) / "config.json").is_file()
    monkeypatch.chdir(tmp_path / "empty")  # an old checkpoint, named "."
    (tmp_path / "empty" / "stale.txt").write_text("x")
    assert import_gguf(path, ".", progress=False) == tmp_path / "empty"
    assert not (tmp_path / "empty" / "stale.txt").exists() and (tmp_path / "empty" / "config.json").is_file()


@pytest.mark.parametrize(("method", "write", "named"), [
    ("add_embedding_length", lambda w, n: w.add_array("llama.embedding_length", [1, 2]),
     r"llama.embedding_length is \[1, 2\], expected a positive integer"),
    ("add_embedding_length", lambda w, n: w.add_string("llama.embedding_length", "abc"),
     "llama.embedding_length is 'abc', expected a positive integer"),
    ("add_bos_token_id", lambda w, n: w.add_string("tokenizer.ggml.bos_token_id", "x"),
     "tokenizer.ggml.bos_token_id is 'x', expected a token id"),
    ("add_token_merges", lambda w, m: w.add_array("tokenizer.ggml.merges", [1, 2]),
     r"tokenizer.ggml.merges is \[1, 2\], expected an array of strings"),
    ("add_chat_template", lambda w, t: w.add_array("tokenizer.chat_template", [1]),
     r"tokenizer.chat_template is \[1\], expected a string"),
    ("add_context_length", lambda w, n: w.add_int32("llama.context_length", -5),
     "llama.context_length is -5, expected a positive integer"),
], ids=["int_as_array", "int_as_string", "token_id_as_string", "merges_as_ints", "template_as_array",
        "negative_context"])
def test_a_metadata_value_of_the_wrong_type_is_refused_naming_the_key(monkeypatch, tiny, tmp_path, method, write,
                                                                      named):
    """These were TypeError / AttributeError tracebacks, a ValueError naming no key, or (a
    negative context length, a template that is an array) a checkpoint written and cached."""
    monkeypatch.setattr(gguf.GGUFWriter, method, write)
    path = write_gguf(tiny, tmp_path / "m.gguf")
    with pytest.raises(GgufImportError, match=f"metadata key {named}"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_an_array_longer_than_any_vocabulary_is_refused_before_the_reader_builds_it(tmp_path, monkeypatch):
    """The reader allocates ~700 bytes per array element: a 10 MB file holding an array of
    10^7 bytes took 7 GB of RSS and 89 s before failing. Here with the cap lowered, so the
    file is small; the real cap is checked against the largest vocabularies below."""
    import weft.models.gguf_layout as layout

    monkeypatch.setattr(layout, "MAX_ARRAY_ELEMENTS", 1000, raising=False)
    path = tmp_path / "big-array.gguf"
    path.write_bytes(_header(0, 2) + _ARCH + _s("x.junk") + struct.pack("<IIQ", _ARR, 0, 5000) + bytes(5000))
    with pytest.raises(GgufImportError, match="the array x.junk has 5000 entries.*more than this importer reads"):
        import_gguf(path, tmp_path / "out", progress=False)


def test_the_array_caps_admit_the_largest_real_vocabularies():
    import weft.models.gguf_layout as layout

    gemma_tokens = 262_144  # tokens, scores and types each; merges of the same order
    assert layout.MAX_ARRAY_ELEMENTS >= 4 * gemma_tokens and layout.MAX_TOTAL_ELEMENTS >= 4 * 2 * gemma_tokens


def test_more_tensors_than_any_model_has_are_refused_before_the_reader_builds_them(tmp_path):
    """70,000 32-byte tensor entries fit in 2 MB; the reader built an object for each (a
    100 MB file could hold 1.5 million) before anything looked at them."""
    entry = struct.pack("<QIQIQ", 0, 1, 8, 0, 0)  # name "", 1 dim of 8, F32, offset 0
    path = tmp_path / "many-tensors.gguf"
    path.write_bytes(_header(70_000, 1) + _ARCH + entry * 70_000 + bytes(64))
    with pytest.raises(GgufImportError, match="tensor count 70000 is more than this importer reads"):
        import_gguf(path, tmp_path / "out", progress=False)

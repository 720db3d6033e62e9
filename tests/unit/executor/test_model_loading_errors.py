"""Loading a broken checkpoint fails with the executor's domain error, and the message
names what is wrong (the architecture, the file, the tensor, the config key)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.errors import CheckpointError, UnsupportedModelError
from weft import LLM
from weft.testing.tiny_model import make_tiny_checkpoint

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pristine"), preset="tiny", arch="llama")


@pytest.fixture
def checkpoint(pristine, tmp_path) -> Path:
    """A private copy of the tiny checkpoint for one test to break."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


@pytest.fixture(params=["LLMEngine", "LLM"])
def load(request):
    if request.param == "LLMEngine":
        return lambda path: LLMEngine(path, EngineConfig(num_kv_blocks=8))
    return lambda path: LLM(path, num_kv_blocks=8)


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_the_pristine_checkpoint_loads(checkpoint, load):
    load(checkpoint)  # guards the tests below: they fail for the reason they break


def test_unknown_architecture_is_unsupported_and_named(checkpoint, load):
    _edit_config(checkpoint, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load(checkpoint)


def test_unknown_model_type_without_architectures_is_unsupported_and_named(checkpoint, load):
    _edit_config(checkpoint, architectures=None, model_type="falcon")
    with pytest.raises(UnsupportedModelError, match="falcon"):
        load(checkpoint)


def test_missing_config_json_is_a_checkpoint_error_naming_it(checkpoint, load):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load(checkpoint)


def test_config_json_that_is_not_json_is_a_checkpoint_error_naming_it(checkpoint, load):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        load(checkpoint)


def test_missing_safetensors_file_is_a_checkpoint_error_naming_it(checkpoint, load):
    (checkpoint / WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match=WEIGHTS):
        load(checkpoint)


def test_missing_shard_listed_in_the_index_is_named(pristine, tmp_path, load):
    sharded = make_tiny_checkpoint(tmp_path / "sharded", preset="tiny", arch="llama", max_shard_bytes=100_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=shards[-1].name):
        load(sharded)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x07not a safetensors file" * 8)


def _broken_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8] = ord("X")  # the JSON header starts at byte 8 with '{'
    path.write_bytes(bytes(data))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("corrupt", [_truncate, _garbage, _broken_header, _empty])
def test_corrupt_safetensors_file_is_a_checkpoint_error_naming_it(checkpoint, load, corrupt):
    corrupt(checkpoint / WEIGHTS)
    with pytest.raises(CheckpointError, match=f"{WEIGHTS}.*(truncated|corrupt)"):
        load(checkpoint)


def test_tensor_with_the_wrong_shape_is_named_with_both_shapes(checkpoint, load):
    tensors = load_file(str(checkpoint / WEIGHTS))
    name = "model.layers.1.self_attn.k_proj.weight"
    expected = tuple(tensors[name].shape)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(checkpoint / WEIGHTS))
    found = (expected[0], expected[1] - 1)
    with pytest.raises(CheckpointError) as err:
        load(checkpoint)
    message = str(err.value)
    assert name in message and str(expected) in message and str(found) in message


def test_config_that_disagrees_with_the_weights_is_named(checkpoint, load):
    _edit_config(checkpoint, vocab_size=2048)
    with pytest.raises(CheckpointError, match=r"\(2048, 64\)"):
        load(checkpoint)


def test_missing_tensor_is_named(checkpoint, load):
    tensors = load_file(str(checkpoint / WEIGHTS))
    del tensors["model.norm.weight"]
    save_file(tensors, str(checkpoint / WEIGHTS))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        load(checkpoint)



# --- files this process may not read -------------------------------------------------
# The Docker image once shipped its model 0600 root while the container runs as uid
# 10001: safetensors then says "No such file or directory", the JSON readers "not valid
# JSON", the tokenizer "cannot be parsed". Root reads any file whatever its mode, so as
# root the loaders run in a child that has lost CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH,
# over files that belong to another uid (a child running as another uid cannot even
# start an interpreter installed under /root). Not as root: mode 0 on our own files.
NOBODY = 65534
AS_ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[3]
MISLEADING = ("No such file", "not valid JSON", "cannot be parsed", "not found")

_PROBE = """
import json, sys
what, path = sys.argv[1], sys.argv[2]
try:
    if what == "engine":
        from services.executor.engine.engine import LLMEngine
        from services.executor.engine.config import EngineConfig
        LLMEngine(path, EngineConfig(num_kv_blocks=8))
    elif what == "llm":
        from weft import LLM
        LLM(path, num_kv_blocks=8)
    elif what == "state_dict":
        from services.executor.model.checkpoint import load_state_dict
        load_state_dict(path)
    elif what == "tokenizer":
        from services.shared.tokenizer import Tokenizer
        Tokenizer.from_dir(path)
    elif what == "open":
        open(path, "rb").close()
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
else:
    print(json.dumps({"type": None, "message": ""}))
"""


# Run first in a fresh, single-threaded interpreter (a preexec_fn in this threaded pytest
# process can deadlock the forked child): drop the capabilities that let root ignore file
# modes from the bounding set, then exec the real command, which as root gets exactly it.
_DROP_DAC_THEN_EXEC = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP): cannot test file modes as root")
os.execv(sys.argv[1], sys.argv[1:])
"""


def _run_bound_by_file_modes(args: list[str]) -> subprocess.CompletedProcess:
    if AS_ROOT:
        args = [sys.executable, "-c", _DROP_DAC_THEN_EXEC, *args]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)


def _lock(path: Path) -> None:
    """Make ``path`` unreadable to the child: another uid's and owner-only as root, else mode 0."""
    if AS_ROOT:
        os.chown(path, NOBODY, NOBODY)
        path.chmod(0o700 if path.is_dir() else 0o600)
    else:
        path.chmod(0)


@pytest.fixture
def lockable(checkpoint):
    """The checkpoint copy, with its modes put back afterwards so pytest can remove it."""
    try:
        yield checkpoint
    finally:
        checkpoint.chmod(0o755)
        for f in checkpoint.iterdir():
            f.chmod(0o644)


def _probe(what: str, path: Path) -> dict:
    done = _run_bound_by_file_modes([sys.executable, "-c", _PROBE, what, str(path)])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _reason(locked: Path) -> str:
    """What the error must say about ``locked``: permission denied, and why."""
    owner = NOBODY if AS_ROOT else os.geteuid()
    return f"{locked.name} in {locked.parent} cannot be read: permission denied (mode {oct(locked.stat().st_mode & 0o777)}, owner uid {owner}, running as uid {os.geteuid()})"


def test_the_child_loads_the_checkpoint_but_cannot_open_a_locked_file(lockable):
    # Guards the tests below: they fail because of the mode, not because the child is broken.
    assert _probe("engine", lockable) == {"type": None, "message": ""}
    assert _probe("tokenizer", lockable) == {"type": None, "message": ""}
    _lock(lockable / WEIGHTS)
    assert _probe("open", lockable / WEIGHTS)["type"] == "PermissionError"


@pytest.mark.parametrize(("locked", "what", "error"), [
    (WEIGHTS, "state_dict", "CheckpointError"),
    (WEIGHTS, "engine", "CheckpointError"),
    (WEIGHTS, "llm", "CheckpointError"),
    ("config.json", "engine", "CheckpointError"),
    (".", "engine", "CheckpointError"),
    ("tokenizer.json", "tokenizer", "PermissionError"),
    ("tokenizer_config.json", "tokenizer", "PermissionError"),
    (".", "tokenizer", "PermissionError"),
])
def test_an_unreadable_model_file_says_permission_denied_and_names_it(lockable, locked, what, error):
    target = (lockable / locked).resolve()
    _lock(target)
    result = _probe(what, lockable)
    assert result["type"] == error, result
    assert _reason(target) in result["message"], result
    assert not any(m in result["message"] for m in MISLEADING), result


def test_an_executor_whose_weights_are_unreadable_exits_non_zero_saying_permission_denied(lockable):
    _lock(lockable / WEIGHTS)
    # NATS at a closed port: the checkpoint loads (and fails) before anything needs it.
    done = _run_bound_by_file_modes([
        sys.executable, "-m", "services.executor", "--model-dir", str(lockable),
        "--nats-url", "nats://127.0.0.1:1", "--port", "0", "--metrics-port", "0"])
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert _reason(lockable / WEIGHTS) in output, output[-3000:]
    assert "No such file" not in output, output[-3000:]

"""`weft model pull` / `import-gguf` interrupted with Ctrl-C (issue 14's attack): one line
and exit 130, as `weft up` does, not a KeyboardInterrupt traceback from inside the gguf
reader; the cache keeps nothing (tested in test_model_sources / test_issue14_attack_cache)."""
from __future__ import annotations

import pytest

import weft.models.gguf_import
import weft.models.sources
from weft.cli import main


@pytest.fixture(autouse=True)
def _keep_logging(monkeypatch):
    """The model commands reconfigure structlog onto this test's captured stderr, which
    later tests' cached loggers would then write to after it is closed: not here."""
    import weft.cli.model_cli

    monkeypatch.setattr(weft.cli.model_cli, "_quiet_logs", lambda: None)


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize(("module", "name", "argv", "said"), [
    (weft.models.sources, "pull", ["model", "pull", "--no-progress", "smollm2-135m-instruct"],
     "weft model pull: interrupted (nothing was installed"),
    (weft.models.gguf_import, "import_gguf", ["model", "import-gguf", "--no-progress", "x.gguf", "out"],
     "weft model import-gguf: interrupted (nothing was written)"),
], ids=["pull", "import-gguf"])
def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, tmp_path, capsys, module, name, argv, said):
    monkeypatch.setattr(module, name, _interrupt)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path / "cache"))
    assert main(argv) == 130
    assert said in capsys.readouterr().err

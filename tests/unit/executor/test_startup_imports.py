"""What an executor imports before it can serve: not xgrammar or transformers (they are
~1.1 s of its ~3.2 s import); those load on a background thread once it serves, or on
the first constrained request. The cachestore's embedding model needs no transformers
either (services/cachestore/minilm.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _modules_after(code: str) -> set[str]:
    script = textwrap.dedent(code) + "\nimport sys\nprint(' '.join(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_executor_process_imports_neither_xgrammar_nor_transformers_to_start():
    loaded = _modules_after("import services.executor.app, services.executor.server")
    assert "services.executor.engine.engine" in loaded
    assert not {"xgrammar", "transformers", "services.executor.grammar"} & loaded


def test_the_warm_up_thread_imports_the_grammar_package():
    loaded = _modules_after("""
        from services.executor.app import warm_grammar_import
        warm_grammar_import().join(120)
    """)
    assert {"services.executor.grammar", "xgrammar"} <= loaded


def test_loading_the_cachestores_embedding_model_imports_no_transformers():
    loaded = _modules_after("""
        from services.cachestore.embedder import MiniLmEmbedder
        MiniLmEmbedder().load()
    """)
    assert "services.cachestore.minilm" in loaded and "transformers" not in loaded

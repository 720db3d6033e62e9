"""weft/ in wings, imports one way (docs/architecture.md, "Map"):

    weft/__init__.py, llm.py   public API           ──▶ services
    weft/cli/                  the command line     ──▶ launcher, testing, health
    weft/launcher/             `weft up` and its helpers ──▶ health, testing, services/mesh
    weft/testing/              test-model writers   ──▶ services (checkpoint format)
    weft/models/               model sources, cache, GGUF import  ──▶ nothing else of weft/
    weft/health.py             probes (also compose's healthchecks) ──▶ services/mesh

Nothing imports the CLI but ``python -m weft``; the launcher's helpers (supervision,
chaos, control endpoint) are handed the launcher as a Protocol and import none of
``launcher.py``. No import cycle anywhere is checked by tests/unit/architecture.
"""
from __future__ import annotations

import pytest

from tests.unit.architecture.test_import_directions import imports, source_modules


def _graph() -> dict[str, set[str]]:
    """weft/'s modules and the weft modules each imports (cycles: tests/unit/architecture)."""
    mods = {m: p for m, p in source_modules().items() if m.split(".")[0] == "weft"}
    return {m: {d for d in imports(p) if d in mods} - {m} for m, p in mods.items()}


@pytest.mark.parametrize("helper", ["weft.launcher.supervision", "weft.launcher.chaos", "weft.launcher.control"])
def test_the_launchers_helpers_import_nothing_of_the_launcher(helper):
    assert "weft.launcher.launcher" not in _graph()[helper]


def test_only_python_dash_m_weft_imports_the_cli():
    importers = {m for m, deps in _graph().items() if any(d == "weft.cli" or d.startswith("weft.cli.") for d in deps)}
    assert {m for m in importers if not m.startswith("weft.cli")} == {"weft.__main__"}


@pytest.mark.parametrize(("wing", "may_import"), [
    ("weft.testing", ()),
    ("weft.models", ()),
    ("weft.launcher", ("weft.health", "weft.testing")),
    ("weft.health", ()),
])
def test_each_wing_imports_only_what_its_row_of_the_map_allows(wing, may_import):
    for mod, deps in _graph().items():
        if mod == wing or mod.startswith(wing + "."):
            stray = {d for d in deps if not d.startswith(wing) and not d.startswith(may_import or ("\0",))}
            assert stray == set(), f"{mod} imports {sorted(stray)}"

"""weft/ in wings, imports one way (docs/architecture.md, "Map"):

    weft/__init__.py, llm.py   public API           ──▶ services
    weft/cli/                  the command line     ──▶ launcher, testing, health
    weft/launcher/             `weft up` and its helpers ──▶ health, testing, services/mesh
    weft/testing/              test-model writers   ──▶ services (checkpoint format)
    weft/health.py             probes (also compose's healthchecks) ──▶ services/mesh

Nothing imports the CLI but ``python -m weft``; the launcher's helpers (supervision,
chaos, control endpoint) are handed the launcher as a Protocol and import none of
``launcher.py``; no import cycle inside weft/, counting imports inside functions and
under TYPE_CHECKING (a lazy import hides a cycle from the interpreter, not from the design).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

WEFT = Path(__file__).resolve().parents[3] / "weft"


def _module(path: Path) -> str:
    parts = ["weft", *path.relative_to(WEFT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _weft_modules() -> dict[str, Path]:
    return {_module(p): p for p in WEFT.rglob("*.py") if "v1" not in p.relative_to(WEFT).parts}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The weft modules ``path`` imports (``from a import b``: a.b when that is a module, else a)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found.update(subs or {node.module})
    return {m for m in found if m in known}


def _graph() -> dict[str, set[str]]:
    mods = _weft_modules()
    return {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}  # state: 1 = on the stack, 2 = done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return cycles


def test_weft_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_one():
    assert _cycles({"weft.a": {"weft.b"}, "weft.b": {"weft.a"}}) == [["weft.a", "weft.b", "weft.a"]]


@pytest.mark.parametrize("helper", ["weft.launcher.supervision", "weft.launcher.chaos", "weft.launcher.control"])
def test_the_launchers_helpers_import_nothing_of_the_launcher(helper):
    assert "weft.launcher.launcher" not in _graph()[helper]


def test_only_python_dash_m_weft_imports_the_cli():
    importers = {m for m, deps in _graph().items() if any(d == "weft.cli" or d.startswith("weft.cli.") for d in deps)}
    assert {m for m in importers if not m.startswith("weft.cli")} == {"weft.__main__"}


@pytest.mark.parametrize(("wing", "may_import"), [
    ("weft.testing", ()),
    ("weft.launcher", ("weft.health", "weft.testing")),
    ("weft.health", ()),
])
def test_each_wing_imports_only_what_its_row_of_the_map_allows(wing, may_import):
    for mod, deps in _graph().items():
        if mod == wing or mod.startswith(wing + "."):
            stray = {d for d in deps if not d.startswith(wing) and not d.startswith(may_import or ("\0",))}
            assert stray == set(), f"{mod} imports {sorted(stray)}"

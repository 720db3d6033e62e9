"""The layout's allowed import directions, checked on the source (docs/architecture.md, "Map").

    weft/ (public API, CLI, launcher)  ──▶  services/*
    services/<x>  ──▶  services/shared, services/mesh, weft.v1, kernels   (never services/<y>)
    services/shared, services/mesh  ──▶  no service
    no module imports another module's private (_underscored) names
    weft.v1 (generated protos)  ──▶  nothing of Weft's

Every import counts, including ones inside functions: a lazy import hides a dependency
(or a cycle) from the interpreter, not from the design.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SERVICES = ("router", "scheduler", "executor", "cachestore")
COMMON = ("shared", "mesh")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    paths = [*ROOT.glob("services/**/*.py"), *ROOT.glob("weft/**/*.py"), *ROOT.glob("kernels/**/*.py")]
    return {module_name(p): p for p in paths if "v1" not in p.relative_to(ROOT).parts[:2]}


def imports(path: Path) -> set[str]:
    """Weft modules named by ``path``'s import statements (``from a import b`` yields ``a.b``
    too, since b may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in ("services", "weft", "kernels")}


def owner(module: str) -> str:
    """``services.router.x`` -> ``router``; ``weft.v1.x`` -> ``weft.v1``; ``weft.x`` -> ``weft``."""
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return parts[1]
    if parts[:2] == ["weft", "v1"]:
        return "weft.v1"
    return parts[0]


def allowed(src: str, dst: str) -> bool:
    a, b = owner(src), owner(dst)
    if a == b or b == "weft.v1":
        return True
    if a in SERVICES:
        return b in COMMON or b == "kernels"
    if a in COMMON:
        return b in COMMON or b == "kernels" and a == "shared"
    if a == "kernels":
        return False
    return a == "weft"  # the public API, CLI and launcher may use every service


def sideways_imports() -> list[str]:
    mods = source_modules()
    return sorted(f"{src} imports {dst}" for src, path in mods.items() for dst in imports(path)
                  if (dst in mods or dst.rsplit(".", 1)[0] in mods) and not allowed(src, dst))


def import_cycles() -> list[list[str]]:
    mods = source_modules()
    graph = {m: sorted(d for d in imports(p) if d in mods and d != m) for m, p in mods.items()}
    cycles, state = [], {}  # state: 1 = on the stack, 2 = done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in graph[m]:
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


def test_no_service_imports_another_service():
    assert sideways_imports() == []


def test_no_module_level_import_cycle():
    assert import_cycles() == []


@pytest.mark.parametrize(("src", "dst", "ok"), [
    ("services.router.continuation", "services.scheduler.migration", False),
    ("services.cachestore.server", "services.executor.block_hash", False),
    ("services.shared.block_hash", "services.executor.engine", False),
    ("services.mesh.nats_bus", "services.router.app", False),
    ("services.router.app", "services.shared.tokenizer", True),
    ("services.executor.server", "weft.v1.executor_pb2", True),
    ("weft.llm", "services.executor.engine.engine", True),
    ("kernels.paged_decode", "services.executor.engine.engine", False),
])
def test_the_rule_tells_a_sideways_import_from_an_allowed_one(src, dst, ok):
    assert allowed(src, dst) is ok


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "weft"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import weft.b\n")
    (pkg / "b.py").write_text("from weft import a\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert import_cycles() == [["weft.a", "weft.b", "weft.a"]]


def private_imports() -> list[str]:
    """``from a import _b`` across modules: a private name used outside its module."""
    found = []
    for src, path in source_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] in ("services", "weft", "kernels"):
                found += [f"{src} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return sorted(found)


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []


def test_the_private_name_check_finds_one(tmp_path, monkeypatch):
    pkg = tmp_path / "services" / "scheduler"
    pkg.mkdir(parents=True)
    (pkg / "server.py").write_text("from services.scheduler.server_view import _STATES_BACK\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert private_imports() == ["services.scheduler.server imports services.scheduler.server_view._STATES_BACK"]

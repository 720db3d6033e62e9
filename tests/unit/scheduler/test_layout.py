"""The scheduler's layering: protobuf and gRPC stay in api/ (and app.py's wiring); the
request path (dispatch/), its policies and state read domain types only."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "services" / "scheduler"
WIRE = ("weft.v1", "grpc")
# suspects.py reads an executor's gRPC error trailers (is_engine_failure, used by the port);
# errors.py maps domain errors to status codes for the server's interceptor.
WIRE_ALLOWED = {"api", "app.py", "errors.py", "policy/suspects.py"}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_only_the_api_layer_touches_protobuf_or_grpc():
    offenders = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel in WIRE_ALLOWED or rel.split("/")[0] in WIRE_ALLOWED:
            continue
        wire = {m for m in imports(path) if m.split(".")[0] == "grpc" or m.startswith("weft.v1")}
        if wire:
            offenders[rel] = sorted(wire)
    assert offenders == {}


def test_the_scheduler_imports_no_other_service_and_no_private_names_across_modules():
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("services."):
                assert node.module.split(".")[1] in ("scheduler", "shared", "mesh"), (path, node.module)
                if node.module.startswith("services.scheduler"):
                    assert not [a.name for a in node.names if a.name.startswith("_")], (path, node.module)

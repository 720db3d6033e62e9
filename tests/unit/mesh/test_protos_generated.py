"""The committed weft/v1 code is exactly what scripts/gen_protos.sh produces."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_is_up_to_date(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, env=env)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "weft" / "v1").iterdir() if p.name != "__init__.py"}
    committed = {
        p.name: p.read_bytes()
        for p in (ROOT / "weft" / "v1").iterdir()
        if p.is_file() and p.name != "__init__.py" and p.suffix in (".py", ".pyi")
    }
    assert sorted(fresh) == sorted(committed), "generated file set differs: run scripts/gen_protos.sh"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code {stale}: run scripts/gen_protos.sh"


def test_every_proto_field_is_documented():
    """Conventions: a comment on every field (the line above a field declaration)."""
    for proto in sorted((ROOT / "protos" / "weft" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_field = s.endswith(";") and "=" in s and not s.startswith(("option", "syntax", "//", "reserved"))
            if is_field:
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} undocumented: {s}"

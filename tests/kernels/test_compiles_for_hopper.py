"""Every kernel compiles for sm_90 on a machine without a GPU (see hopper_compile.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.paged_inputs import ON_GPU

REPO_ROOT = Path(__file__).resolve().parents[2]


def _ptxas_available() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(ON_GPU, reason="on a GPU every other kernel test compiles and runs the "
                                   "kernels for the real device")
@pytest.mark.skipif(not _ptxas_available(), reason="this Triton wheel has no NVIDIA ptxas")
def test_all_kernels_compile_for_hopper_without_a_gpu():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silence triton 3.9's default-change warning
    result = subprocess.run([sys.executable, "-m", "tests.kernels.hopper_compile"], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "compiled" in result.stdout

"""Rendered overlays of deploy/k8s, shared by the Kubernetes tests (rendered once per session)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
K8S_DIR = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-dev", "gpu")
TARGETS = ("base", *(f"overlays/{o}" for o in OVERLAYS))


def kustomize(target: str) -> list[dict]:
    """Every object `kubectl kustomize deploy/k8s/<target>` renders."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests cannot be rendered here")
    result = subprocess.run([kubectl, "kustomize", str(K8S_DIR / target)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {target: kustomize(target) for target in TARGETS}

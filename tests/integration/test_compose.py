"""compose.yaml: valid for docker-compose 1.29 (and Compose v2 where installed), and the
same services, commands, settings and health probes as the launcher's table."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from weft.mesh_spec import SERVICES, compose_context

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("WEFT_")}


def test_docker_compose_1_29_validates_compose_yaml():
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed")
    result = subprocess.run([binary, "-f", str(COMPOSE_FILE), "config", "-q"], cwd=ROOT, env=_clean_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_compose_v2_validates_compose_yaml():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker compose (v2) not installed")
    result = subprocess.run([docker, "compose", "-f", str(COMPOSE_FILE), "config", "-q"], cwd=ROOT,
                            env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_compose_has_no_keys_that_docker_compose_1_29_rejects():
    compose = _compose()
    assert "name" not in compose
    for name, service in compose["services"].items():
        for dep in (service.get("depends_on") or {}).values() if isinstance(service.get("depends_on"), dict) else ():
            assert "required" not in dep, name


# Monitoring runs beside the mesh in compose only (tests/unit/test_monitoring_deploy.py).
MONITORING_SERVICES = {"prometheus", "grafana"}


def test_compose_services_are_exactly_the_launcher_table_plus_monitoring():
    assert set(_compose()["services"]) - MONITORING_SERVICES == {spec.name for spec in SERVICES}


@pytest.mark.parametrize("spec", SERVICES, ids=lambda s: s.name)
def test_compose_service_matches_the_launcher_table(spec):
    service = _compose()["services"][spec.name]
    ctx = compose_context().mapping()
    command = [a.format_map(ctx) for a in spec.command]
    assert service["command"] == (["python", *command] if spec.python else command)
    assert {k: str(v) for k, v in (service.get("environment") or {}).items()} == spec.render(ctx)
    port = ctx[spec.health.port_key]
    target = f"127.0.0.1:{port}" if spec.health.kind == "grpc" else f"http://127.0.0.1:{port}{spec.health.path}"
    assert service["healthcheck"]["test"] == ["CMD", "python", "-m", "weft.health", spec.health.kind, target]
    assert set(service.get("depends_on") or ()) == set(spec.depends_on)
    published = [str(p).rsplit(":", 1)[1] for p in service.get("ports", ())]
    assert published == [str(ctx[k]) for k in spec.published]
    if spec.scalable:
        assert "container_name" not in service and "ports" not in service, "replicas cannot share a name or host port"

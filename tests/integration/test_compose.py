"""compose.yaml: valid for docker-compose 1.29 (and Compose v2 where installed), the same
services, commands, settings and health probes as the launcher's table, a restart policy
and a healthcheck on every service; and the Dockerfile ships files its user can read."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from weft.launcher.mesh_spec import COMPOSE_RESTART, SERVICES, compose_context

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


# Monitoring runs beside the mesh in compose only (tests/unit/weft/test_monitoring_deploy.py).
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
    probe = spec.healthcheck  # readiness where the table has it (the router's /health/ready)
    port = ctx[probe.port_key]
    target = f"127.0.0.1:{port}" if probe.kind == "grpc" else f"http://127.0.0.1:{port}{probe.path}"
    assert service["healthcheck"]["test"] == ["CMD", "python", "-m", "weft.health", probe.kind, target]
    assert set(service.get("depends_on") or ()) == set(spec.depends_on)
    published = [str(p).rsplit(":", 1)[1] for p in service.get("ports", ())]
    assert published == [str(ctx[k]) for k in spec.published]
    if spec.scalable:
        assert "container_name" not in service and "ports" not in service, "replicas cannot share a name or host port"


def test_router_healthcheck_is_readiness_not_liveness():
    test = _compose()["services"]["router"]["healthcheck"]["test"]
    assert test[-1].endswith("/health/ready")


@pytest.mark.parametrize("name", sorted(_compose()["services"]))
def test_every_compose_service_restarts_and_has_a_healthcheck(name):
    """A dead process comes back under compose as under `weft up` (an operator's stop stays)."""
    service = _compose()["services"][name]
    assert service.get("restart") in (COMPOSE_RESTART, "on-failure"), name
    healthcheck = service.get("healthcheck") or {}
    assert healthcheck.get("test") and not healthcheck.get("disable"), name
    assert healthcheck["test"][0] in ("CMD", "CMD-SHELL"), name


# -- the image: files it ships must be readable by the user it runs as -------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, out = "", []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        joined += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = joined.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            joined = ""
    return out


def test_dockerfile_makes_shipped_files_readable_by_the_container_user(tmp_path, tiny_model_dir):
    """Runs the Dockerfile's steps after the model is made (up to the USER switch) on a copy of
    the tree whose files are root-only (0600/0700, as the safetensors writer and a umask-077
    checkout leave them), with /opt/weft pointed at the copy; then every file must be readable
    and every directory searchable by others (the container's uid 10001)."""
    import stat

    steps = _dockerfile_instructions()
    users = [i for i, (word, args) in enumerate(steps) if word == "USER"]
    make = [i for i, (word, args) in enumerate(steps) if word == "RUN" and "make-tiny" in args]
    assert users and steps[users[-1]][1] in ("weft", "10001"), "the image must not run as root"
    assert make and make[0] < users[-1]
    opt = tmp_path / "opt" / "weft"
    shutil.copytree(tiny_model_dir, opt / "models" / "tiny")
    shutil.copytree(ROOT / "weft", opt / "weft", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [opt, *opt.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    for word, args in steps[make[0] + 1:users[-1]]:
        if word == "RUN" and "/opt/weft" in args and "useradd" not in args:
            subprocess.run(["sh", "-c", args.replace("/opt/weft", str(opt))], check=True, timeout=60)
    def readable(p: Path) -> bool:
        need = stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0)
        return p.stat().st_mode & need == need

    unreadable = [str(p.relative_to(opt)) for p in [opt, *opt.rglob("*")] if not readable(p)]
    assert not unreadable, f"not readable by the container's user: {unreadable[:5]}"

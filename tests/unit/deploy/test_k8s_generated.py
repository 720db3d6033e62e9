"""deploy/k8s/base is the generator's output (weft/launcher/k8s.py over mesh_spec.SERVICES),
byte for byte, so the launcher, compose.yaml and Kubernetes run the same table."""
from __future__ import annotations

import json

import yaml

from services.mesh import nats_auth
from weft.launcher import k8s


def test_committed_base_equals_the_generators_output():
    files = k8s.render()
    committed = {p.name for p in k8s.BASE_DIR.iterdir() if p.is_file()}
    assert committed == set(files), "run: python -m weft.launcher.k8s write"
    for name, text in files.items():
        assert (k8s.BASE_DIR / name).read_text(encoding="utf-8") == text, (
            f"deploy/k8s/base/{name} is stale: run python -m weft.launcher.k8s write")


def test_check_command_passes_on_the_committed_base():
    assert k8s.main(["check"]) == 0


def test_nats_config_map_is_the_nats_auth_renderer_and_holds_no_password():
    doc = yaml.safe_load((k8s.BASE_DIR / "nats-config.yaml").read_text())
    conf = doc["data"]["nats.conf"]
    assert conf == nats_auth.render_config() == nats_auth.DEFAULT_CONFIG_PATH.read_text()
    for role in nats_auth.ROLES:
        assert f"password: ${nats_auth.role_password_env(role)}" in conf
        assert nats_auth.dev_fallback_password(role) not in conf


def test_grafana_dashboard_config_map_equals_deploy_grafana():
    doc = yaml.safe_load((k8s.BASE_DIR / "grafana-dashboard.yaml").read_text())
    assert doc["data"]["weft.json"] == k8s.DASHBOARD_FILE.read_text(encoding="utf-8")
    assert json.loads(doc["data"]["weft.json"])["panels"]
    assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"  # the Grafana sidecar's label


def test_secrets_command_prints_every_key_the_manifests_reference_with_fresh_values():
    first, second = (list(yaml.safe_load_all(k8s.secrets_manifest())) for _ in range(2))
    by_name = {d["metadata"]["name"]: d for d in first}
    assert set(by_name) == {k8s.MESH_SECRET, k8s.API_KEYS_SECRET}
    mesh = by_name[k8s.MESH_SECRET]["stringData"]
    assert set(mesh) == {"mesh-secret", *(f"nats-{r}-password" for r in nats_auth.ROLES)}
    for role in nats_auth.ROLES:  # nats-server must accept each as a variable's value
        nats_auth.check_password(mesh[f"nats-{role}-password"], role)
    assert json.loads(by_name[k8s.API_KEYS_SECRET]["stringData"]["keys.json"])
    assert first[0]["stringData"] != second[0]["stringData"], "material must be random per call"

"""Prometheus and Grafana beside the mesh in compose.yaml: the scrape config reaches every
service that exports metrics at its compose port, Grafana is provisioned from files that
exist, and every dashboard query names only metrics of the catalogue (or the services'
own ``weft_*`` metrics), so a renamed metric breaks this test, not a dashboard."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from services.mesh import metric_catalogue as catalogue
from weft.launcher.mesh_spec import SERVICES, compose_context

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _scrape_targets() -> dict[str, list[str]]:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    out = {}
    for job in config["scrape_configs"]:
        targets = [t for sc in job.get("static_configs", ()) for t in sc["targets"]]
        targets += [f"{n}:{sd['port']}" for sd in job.get("dns_sd_configs", ()) for n in sd["names"]]
        out[job["job_name"]] = targets
    return out


def test_prometheus_scrapes_every_service_with_metrics_at_its_compose_port():
    ctx = compose_context().mapping()
    expected = {}
    for spec in SERVICES:
        metrics_key = f"{spec.name}_metrics_port"
        if metrics_key in spec.ports:
            expected[spec.name] = [f"{spec.name}:{ctx[metrics_key]}"]
    assert _scrape_targets() == expected


def test_every_python_service_has_a_metrics_port_that_compose_does_not_publish():
    compose = _compose()["services"]
    for spec in SERVICES:
        if spec.python:
            key = f"{spec.name}_metrics_port"
            assert key in spec.ports and key not in spec.published, spec.name
            assert all(str(spec.ports[key]) not in str(p) for p in compose[spec.name].get("ports", ())), spec.name


def test_scaled_executors_are_found_through_dns_not_a_fixed_target():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "executor")
    assert "static_configs" not in job and job["dns_sd_configs"][0]["type"] == "A"


def test_monitoring_services_mount_files_that_exist_and_grafana_is_provisioned():
    services = _compose()["services"]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), volume
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/weft.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "depends_on" in services["grafana"] and "required" not in services["grafana"]["depends_on"]["prometheus"]


def _dashboard_metric_names() -> set[str]:
    dash = json.loads((DEPLOY / "grafana/dashboards/weft.json").read_text())
    datasource_uid = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]["uid"]
    names = set()
    for panel in dash["panels"]:
        for target in panel.get("targets", ()):
            assert target["datasource"]["uid"] == datasource_uid
            names |= set(re.findall(r"\bweft_[a-z0-9_]+", target["expr"]))
    return names


def test_every_dashboard_query_names_a_catalogue_metric():
    known = set()
    for spec in catalogue.CATALOGUE:
        known.add(spec.name)
        if spec.kind == "histogram":
            known |= {f"{spec.name}_bucket", f"{spec.name}_count", f"{spec.name}_sum"}
    used = _dashboard_metric_names()
    assert used - known == set()
    # the list: latency, queue, KV per partition, tiers, pauses, demotions,
    # promotions, migrations, degradation, rejections, and the verdict
    assert {s.name for s in catalogue.CATALOGUE} - {n.removesuffix("_bucket") for n in used} == set()


def test_docs_metrics_md_documents_every_catalogue_metric_with_its_type_and_status():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): [c.strip() for c in line.split("|")[1:-1]]
            for line in doc.splitlines() if line.startswith("| `weft_")}
    for spec in catalogue.CATALOGUE:
        assert spec.name in rows, f"{spec.name} missing from docs/metrics.md"
        _, kind, labels, service, status, _help = rows[spec.name]
        assert (kind, service) == (spec.kind, spec.service), spec.name
        assert labels == ", ".join(f"`{label}`" for label in spec.labels), spec.name
        assert status == ("live" if spec.live else f"waits for {spec.waits_for}"), spec.name
    assert set(rows) == {s.name for s in catalogue.CATALOGUE}

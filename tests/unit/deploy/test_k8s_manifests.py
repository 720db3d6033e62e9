"""Every kustomize target of deploy/k8s renders, validates offline against the Kubernetes 1.32
schemas (strict: no unknown field), and keeps the mesh's rules: the table's services, ports
and settings; probes, requests and limits everywhere; no Secret material in a manifest;
only the router reachable from outside the namespace; non-root pods; a disruption budget
and an autoscaler where the docs promise them."""
from __future__ import annotations

import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from services.mesh import metric_catalogue, nats_auth
from weft.launcher import k8s
from weft.launcher.mesh_spec import SERVICES

from .conftest import TARGETS

KUBERNETES_VERSION = "1.32.0"  # the kubectl installed here and on CI
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
GPU_ONLY_ENV = {"WEFT_EXECUTOR_DEVICE", "WEFT_EXECUTOR_DTYPE"}  # the gpu overlay's additions


def objects(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def workloads(docs):
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def component(doc) -> str:
    return doc["spec"]["template"]["metadata"]["labels"][k8s.COMPONENT]


def main_container(doc) -> dict:
    (container,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == component(doc)]
    return container


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates_strictly_against_the_kubernetes_schemas(rendered, target):
    assert rendered[target]
    for doc in rendered[target]:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{target}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}")


@pytest.mark.parametrize("target", TARGETS)
def test_manifests_run_exactly_the_tables_services(rendered, target):
    assert {component(w) for w in workloads(rendered[target])} == {s.name for s in SERVICES}
    pools = {w["spec"]["template"]["metadata"]["labels"].get(k8s.POOL) for w in workloads(rendered[target])
             if component(w) == "executor"}
    assert pools == {p.name for p in k8s.POOLS}, "one executor Deployment per degradation pool"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("spec", SERVICES, ids=lambda s: s.name)
def test_each_container_has_the_tables_command_ports_and_settings(rendered, target, spec):
    ctx = k8s.context().mapping()
    for doc in (w for w in workloads(rendered[target]) if component(w) == spec.name):
        container = main_container(doc)
        command = [a.format_map(ctx) for a in spec.command]
        assert container["command"] == (["python", *command] if spec.python else command)
        assert sorted(p["containerPort"] for p in container["ports"]) == sorted(spec.ports.values())
        env = {e["name"]: e for e in container["env"]}
        for name, template in spec.settings.items():
            key = k8s.secret_key(template)
            if key is None:
                assert env[name].get("value") == template.format_map(ctx), name
            else:
                assert env[name]["valueFrom"]["secretKeyRef"] == {"name": k8s.MESH_SECRET, "key": key}, name
        allowed = {e["name"] for e in k8s.EXTRA_ENV.get(spec.name, [])}
        if spec.scalable:
            allowed |= {"WEFT_EXECUTOR_SERVES_RUNG", *(n for p in k8s.POOLS for n in p.env)}
        if target.endswith("gpu") and spec.scalable:
            allowed |= GPU_ONLY_ENV
        assert set(env) - set(spec.settings) <= allowed, "a setting outside the table and EXTRA_ENV"


@pytest.mark.parametrize("target", TARGETS)
def test_every_address_in_a_setting_is_a_service_exposing_that_port(rendered, target):
    docs = rendered[target]
    services = {s["metadata"]["name"]: {p["port"] for p in s["spec"]["ports"]} for s in objects(docs, "Service")}
    for doc in workloads(docs):
        for e in main_container(doc)["env"]:
            for host, port in re.findall(r"(?:^|//)([a-z][a-z0-9-]*):(\d+)$", e.get("value", "")):
                assert int(port) in services.get(host, set()), f"{e['name']}={e['value']}: no Service {host}:{port}"


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_has_probes_requests_and_limits(rendered, target):
    for doc in workloads(rendered[target]):
        pod = doc["spec"]["template"]["spec"]
        for container in pod["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in container, f"{doc['metadata']['name']}: no {probe}"
        for container in pod["containers"] + pod.get("initContainers", []):
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), (doc["metadata"]["name"], bound)


@pytest.mark.parametrize("target", TARGETS)
def test_readiness_means_can_serve(rendered, target):
    for doc in workloads(rendered[target]):
        spec = next(s for s in SERVICES if s.name == component(doc))
        ready = main_container(doc)["readinessProbe"]
        want = spec.healthcheck  # the router's /health/ready; grpc.health.v1 elsewhere
        if want.kind == "grpc":
            assert ready["grpc"]["port"] == spec.ports[want.port_key]
        else:
            assert ready["httpGet"]["path"] == want.path
    router = next(w for w in workloads(rendered[target]) if component(w) == "router")
    assert main_container(router)["readinessProbe"]["httpGet"]["path"] == "/health/ready"


@pytest.mark.parametrize("target", TARGETS)
def test_executors_startup_budget_covers_model_loading(rendered, target):
    for doc in (w for w in workloads(rendered[target]) if component(w) == "executor"):
        startup = main_container(doc)["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= k8s.STARTUP_BUDGET_S["executor"]
        # The pod is killed only after the executor's own drain (grace_s) could finish.
        assert doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > k8s.EXECUTOR_GRACE_S


@pytest.mark.parametrize("target", TARGETS)
def test_no_secret_material_in_any_manifest(rendered, target):
    docs = rendered[target]
    assert not objects(docs, "Secret"), "manifests reference Secrets and ship none"
    text = repr(docs)
    for role in nats_auth.ROLES:
        assert nats_auth.dev_fallback_password(role) not in text
    assert "change-me" not in text
    for doc in workloads(docs):
        for container in doc["spec"]["template"]["spec"]["containers"]:
            for e in container["env"]:
                if re.search(r"PASSWORD|SECRET|TOKEN|API_KEY", e["name"]) and not e["name"].endswith("_FILE"):
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{e['name']} is not read from a Secret"
    router = next(w for w in workloads(docs) if component(w) == "router")
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == k8s.API_KEYS_SECRET


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are understood here"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _ports_from_outside(policies: list[dict], labels: dict, *, monitoring: bool) -> set:
    """Ports of a pod with ``labels`` that a peer outside the namespace may reach ("all" for
    every port); ``monitoring``: the peer's namespace carries the monitoring label."""
    ports: set = set()
    for policy in (p for p in policies if _selects(p["spec"]["podSelector"], labels)):
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            outside = peers is None or any(
                "ipBlock" in peer or ("namespaceSelector" in peer and (
                    monitoring or k8s.MONITORING_NAMESPACE_LABEL not in peer["namespaceSelector"].get("matchLabels", {})))
                for peer in peers)
            if outside:
                ports |= {p["port"] for p in rule["ports"]} if rule.get("ports") else {"all"}
    return ports


@pytest.mark.parametrize("target", TARGETS)
def test_network_policies_admit_only_the_router_from_outside_the_namespace(rendered, target):
    docs = rendered[target]
    policies = objects(docs, "NetworkPolicy")
    assert any(p["spec"]["podSelector"] == {} and p["spec"]["policyTypes"] == ["Ingress"]
               and not p["spec"].get("ingress") for p in policies), "no default deny of ingress"
    metrics = {v for s in SERVICES for key, v in s.ports.items() if key.endswith("metrics_port")}
    for doc in workloads(docs):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        spec = next(s for s in SERVICES if s.name == component(doc))
        public = _ports_from_outside(policies, labels, monitoring=False)
        assert public == ({spec.ports[k] for k in spec.published} if spec.name == "router" else set()), spec.name
        scraped = _ports_from_outside(policies, labels, monitoring=True) - public
        assert scraped <= metrics, f"{spec.name}: a monitoring namespace may reach only metrics ports"


@pytest.mark.parametrize("target", TARGETS)
def test_pods_run_as_non_root(rendered, target):
    for doc in workloads(rendered[target]):
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        for container in pod["containers"] + pod.get("initContainers", []):
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("target", TARGETS)
def test_every_workload_has_a_disruption_budget_and_scalable_ones_an_autoscaler(rendered, target):
    docs = rendered[target]
    budgets = objects(docs, "PodDisruptionBudget")
    autoscalers = {h["spec"]["scaleTargetRef"]["name"]: h for h in objects(docs, "HorizontalPodAutoscaler")}
    for doc in workloads(docs):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert any(_selects(b["spec"]["selector"], labels) for b in budgets), doc["metadata"]["name"]
        if component(doc) == "executor":  # scales on a Weft metric, through the Prometheus adapter
            (metric,) = autoscalers[doc["metadata"]["name"]]["spec"]["metrics"]
            (spec,) = [m for m in metric_catalogue.CATALOGUE if m.name == metric["pods"]["metric"]["name"]]
            assert spec.service == "executor" and spec.kind == "gauge" and spec.waits_for is None
            assert doc["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        if component(doc) == "router":
            (metric,) = autoscalers["router"]["spec"]["metrics"]
            assert metric["resource"]["name"] == "cpu"


@pytest.mark.parametrize("target", TARGETS)
def test_cachestore_keeps_its_disk_tier_on_a_volume_claim(rendered, target):
    (store,) = [w for w in workloads(rendered[target]) if component(w) == "cachestore"]
    assert store["kind"] == "StatefulSet"
    (claim,) = store["spec"]["volumeClaimTemplates"]
    disk_dir = next(e["value"] for e in main_container(store)["env"] if e["name"] == "WEFT_CACHESTORE_DISK_DIR")
    assert {"name": claim["metadata"]["name"], "mountPath": disk_dir} in main_container(store)["volumeMounts"]


@pytest.mark.parametrize("target", TARGETS)
def test_model_reaches_every_pod_that_reads_it_through_weft_model_pull(rendered, target):
    model_dir = k8s.context().model_dir
    for doc in workloads(rendered[target]):
        if not any(e.get("value") == model_dir for e in main_container(doc)["env"]):
            continue
        (init,) = doc["spec"]["template"]["spec"]["initContainers"]
        assert init["command"][:5] == ["python", "-m", "weft", "model", "pull"]
        assert model_dir.startswith(init["command"][init["command"].index("--cache-dir") + 1])


def test_gpu_overlay_gives_every_executor_a_gpu_and_cpu_dev_none(rendered):
    for target, want in (("overlays/gpu", 1), ("overlays/cpu-dev", None)):
        for doc in workloads(rendered[target]):
            limits = main_container(doc)["resources"]["limits"]
            expected = want if component(doc) == "executor" else None
            assert limits.get("nvidia.com/gpu") == expected, (target, doc["metadata"]["name"])


def test_prometheus_adapter_rule_serves_the_executor_autoscalers_metric_per_pod():
    values = yaml.safe_load((k8s.ROOT / "deploy" / "k8s" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == k8s.EXECUTOR_HPA_METRIC
    assert rule["seriesQuery"].startswith(k8s.EXECUTOR_HPA_METRIC + "{")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


def _declared_env(module: str) -> set[str]:
    """The WEFT_* variables ``python -m <module> --help`` says the service reads."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                            cwd=k8s.ROOT)
    assert result.returncode == 0, result.stderr
    return set(re.findall(r"\[env\s+(WEFT_[A-Z0-9_]+)", result.stdout))


def test_every_setting_kubernetes_adds_is_one_the_service_reads(rendered):
    """An unknown variable is ignored silently, so a misspelt one would never take effect."""
    added: dict[str, set[str]] = {}
    for target in TARGETS:
        for doc in workloads(rendered[target]):
            spec = next(s for s in SERVICES if s.name == component(doc))
            names = {e["name"] for e in main_container(doc)["env"]} - set(spec.settings)
            added.setdefault(spec.name, set()).update(n for n in names if n.startswith("WEFT_"))
    assert added["executor"], "the executor pools add settings"
    for service, names in added.items():
        if names:
            assert names <= _declared_env(f"services.{service}"), service


@pytest.mark.parametrize("target", TARGETS)
def test_every_dependent_variable_refers_to_one_defined_before_it(rendered, target):
    """Kubernetes expands $(NAME) only from variables listed earlier; a later one stays literal."""
    for doc in workloads(rendered[target]):
        defined: set[str] = set()
        for e in main_container(doc)["env"]:
            for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                assert ref in defined, f"{doc['metadata']['name']}: {e['name']} uses $({ref}) before it is set"
            defined.add(e["name"])
    executor = next(w for w in workloads(rendered[target]) if component(w) == "executor")
    advertise = next(e for e in main_container(executor)["env"] if e["name"] == "WEFT_EXECUTOR_ADVERTISE_ADDRESS")
    assert advertise["value"] == f"$(POD_IP):{next(s for s in SERVICES if s.scalable).ports['executor_port']}"

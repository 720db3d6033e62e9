"""Attacks on deploy/k8s (issue 18) as an unlucky operator and as a hostile neighbour in the
cluster, each kept as a test: node drains that wait for ever, an apply that undoes the
autoscaler, a service-account token in every pod, a metrics port any namespace could
label itself into, node credentials one request away, a generator that accepts a stray
file or crashes on a bad --out, Secrets that repeat or do not parse where they are read."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil

import pytest
import yaml

from services.mesh import nats_auth
from services.mesh.live_settings import SettingsFollower
from services.router.auth import parse_keys
from weft.launcher import k8s

from .conftest import TARGETS

IMMUTABLE_NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server, nobody may change it


def objects(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _pod_templates(docs):
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def _fewest_pods(doc, autoscalers: dict) -> int:
    """The fewest pods a workload may run: its autoscaler's floor, else its replicas (1 unset)."""
    hpa = autoscalers.get((doc["kind"], doc["metadata"]["name"]))
    return hpa["spec"].get("minReplicas", 1) if hpa else doc["spec"].get("replicas", 1)


@pytest.mark.parametrize("target", TARGETS)
def test_every_disruption_budget_lets_a_node_drain_evict_a_pod(rendered, target):
    """minAvailable 1 over one router (cpu-dev) refused every eviction: `kubectl drain` hung."""
    docs = rendered[target]
    autoscalers = {(h["spec"]["scaleTargetRef"]["kind"], h["spec"]["scaleTargetRef"]["name"]): h
                   for h in objects(docs, "HorizontalPodAutoscaler")}
    for budget in objects(docs, "PodDisruptionBudget"):
        for doc in (w for w in _pod_templates(docs)
                    if _selects(budget["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])):
            pods = _fewest_pods(doc, autoscalers)
            spec = budget["spec"]
            allowed = spec["maxUnavailable"] if "maxUnavailable" in spec else pods - spec["minAvailable"]
            assert allowed >= 1, f"{target}: PDB {budget['metadata']['name']} blocks evictions of {pods} pod(s)"


@pytest.mark.parametrize("target", TARGETS)
def test_an_autoscaled_deployment_sets_no_replicas_that_apply_would_reset(rendered, target):
    """With spec.replicas in the manifest every `kubectl apply -k` put the autoscaler's count
    back to it (executors it had added were drained at once)."""
    docs = rendered[target]
    scaled = {(h["spec"]["scaleTargetRef"]["kind"], h["spec"]["scaleTargetRef"]["name"])
              for h in objects(docs, "HorizontalPodAutoscaler")}
    assert scaled, "the router and the executor pools are autoscaled"
    for doc in _pod_templates(docs):
        if (doc["kind"], doc["metadata"]["name"]) in scaled:
            assert "replicas" not in doc["spec"], f"{target}: {doc['metadata']['name']} sets replicas"


@pytest.mark.parametrize("target", TARGETS)
def test_no_pod_gets_a_kubernetes_api_token(rendered, target):
    """No service calls the Kubernetes API; the default token let a compromised router do so."""
    for doc in _pod_templates(rendered[target]):
        assert doc["spec"]["template"]["spec"].get("automountServiceAccountToken") is False, doc["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_namespaces_are_admitted_only_by_their_immutable_name(rendered, target):
    """A label like weft.dev/monitoring=true can be put on any namespace by its admin, so a
    neighbour labelled its own namespace and read every tenant's metrics."""
    for policy in objects(rendered[target], "NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    selector = peer["namespaceSelector"]
                    assert set(selector) == {"matchLabels"}, policy["metadata"]["name"]
                    assert set(selector["matchLabels"]) == {IMMUTABLE_NAMESPACE_LABEL}, policy["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_no_pod_may_reach_the_cloud_metadata_endpoint(rendered, target):
    """Egress was open: a compromised pod could read the node's cloud credentials."""
    docs = rendered[target]
    egress = [p for p in objects(docs, "NetworkPolicy") if "Egress" in p["spec"]["policyTypes"]]
    for doc in _pod_templates(docs):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in egress if _selects(p["spec"]["podSelector"], labels)]
        assert mine, f"{doc['metadata']['name']}: no egress policy"
        for rule in (r for p in mine for r in p["spec"].get("egress", [])):
            assert "to" in rule and "ports" not in rule, "an egress rule open to everything"
            for peer in rule["to"]:
                block = peer.get("ipBlock")
                if block and block["cidr"] == "0.0.0.0/0":
                    assert "169.254.169.254/32" in block.get("except", [])
                assert block is None or not block["cidr"].startswith("169.254.")


def test_write_into_a_file_is_a_readable_usage_error(tmp_path, capsys):
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        k8s.main(["write", "--out", str(target)])
    assert exit_info.value.code == 2
    assert f"write --out {target}: not a directory" in capsys.readouterr().err


def test_write_into_an_odd_new_directory_writes_the_whole_base(tmp_path):
    out = tmp_path / "a dir with spaces" / "ünïcode"
    assert k8s.main(["write", "--out", str(out)]) == 0
    assert {p.name: p.read_text(encoding="utf-8") for p in out.iterdir()} == k8s.render()


@pytest.fixture
def base_copy(tmp_path, monkeypatch):
    """A copy of the committed base that `check` reads (the shared tree stays untouched)."""
    copy = tmp_path / "base"
    shutil.copytree(k8s.BASE_DIR, copy)
    monkeypatch.setattr(k8s, "BASE_DIR", copy)
    return copy


def test_check_names_a_hand_edited_manifest(base_copy, capsys):
    router = base_copy / "router.yaml"
    router.write_text(router.read_text().replace("cpu: 250m", "cpu: 100m", 1))
    assert k8s.main(["check"]) == 1
    err = capsys.readouterr().err
    assert "router.yaml is stale" in err and "python -m weft.launcher.k8s write" in err


def test_check_refuses_a_manifest_the_generator_does_not_write(base_copy, capsys):
    (base_copy / "my-patch.yaml").write_text("kind: ConfigMap\n")
    assert k8s.main(["check"]) == 1
    assert "my-patch.yaml is not generated" in capsys.readouterr().err


def test_secrets_never_repeat_and_each_parses_where_it_is_read():
    seen: set[str] = set()
    for _ in range(3):
        docs = list(yaml.safe_load_all(k8s.secrets_manifest()))
        values = [v for d in docs for v in d["stringData"].values()]
        assert len(set(values)) == len(values), "two keys of one manifest share a value"
        assert not seen & set(values), "a value repeated across calls"
        seen |= set(values)
        keys = next(d for d in docs if d["metadata"]["name"] == k8s.API_KEYS_SECRET)["stringData"]["keys.json"]
        assert all(e.tenant == "default" for e in parse_keys(json.loads(keys)).values())
    mesh = next(d for d in docs if d["metadata"]["name"] == k8s.MESH_SECRET)["stringData"]
    assert len(mesh["mesh-secret"]) >= 64


def test_secrets_command_writes_only_the_manifest_to_stdout(capsys):
    assert k8s.main(["secrets"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and [d["kind"] for d in yaml.safe_load_all(out)] == ["Secret", "Secret"]


def test_live_settings_do_not_flip_between_two_router_replicas():
    """Kubernetes runs 2-6 routers, each republishing its document every
    WEFT_SETTINGS_REPUBLISH_S: after an admin PATCH on one replica, services flipped
    between the patched and the old document. Now the newest stamp wins everywhere."""
    applied: list[dict] = []
    follower = SettingsFollower("scheduler", "scheduler", applied.append)
    patched = json.dumps({"version": 2, "updated_at": 200.0, "writer": "router-a",  # replica A, after PATCH
                          "scheduler": {"policy": "fcfs"}}).encode()
    stale = json.dumps({"version": 1, "updated_at": 100.0, "writer": "router-b"}).encode()  # replica B, as started

    async def republish() -> None:
        for _ in range(3):
            await follower.receive(patched)
            await follower.receive(stale)

    asyncio.run(republish())
    assert applied == [{"policy": "fcfs"}] and follower.version == 2


def _main_container(doc) -> dict:
    name = doc["spec"]["template"]["metadata"]["labels"][k8s.COMPONENT]
    return next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name)


@pytest.mark.parametrize("target", TARGETS)
def test_each_python_services_threads_follow_its_own_cpu_limit(rendered, target):
    """torch sizes its pool by the node's cores, not the container's CPU limit: an executor
    limited to 4 CPUs on a 64-core node ran dozens of threads and was throttled."""
    for doc in _pod_templates(rendered[target]):
        container = _main_container(doc)
        if container["command"][0] != "python":
            continue
        env = {e["name"]: e for e in container["env"]}
        assert env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"] == {
            "containerName": container["name"], "resource": "limits.cpu", "divisor": "1"}, doc["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_services_carry_no_metrics_port(rendered, target):
    """Prometheus scrapes pods by annotation; a metrics port on Service `router` (per-tenant
    labels) went public with it once an operator made that Service a LoadBalancer."""
    metrics = {v for s in k8s.SERVICES for key, v in s.ports.items() if key.endswith("metrics_port")}
    for service in objects(rendered[target], "Service"):
        assert not {p["port"] for p in service["spec"]["ports"]} & metrics, service["metadata"]["name"]
    (router,) = [s for s in objects(rendered[target], "Service") if s["metadata"]["name"] == "router"]
    spec = next(s for s in k8s.SERVICES if s.name == "router")
    assert sorted(p["port"] for p in router["spec"]["ports"]) == sorted(spec.ports[k] for k in spec.published)


@pytest.mark.parametrize("target", TARGETS)
def test_each_service_holds_only_its_own_nats_password(rendered, target):
    """nats_auth's permissions mean nothing if a pod could log in as another role."""
    for doc in _pod_templates(rendered[target]):
        container = _main_container(doc)
        keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"]
                if "secretKeyRef" in e.get("valueFrom", {})}
        passwords = {k for k in keys if k.startswith("nats-")}
        want = ({f"nats-{r}-password" for r in nats_auth.ROLES} if container["name"] == "nats"
                else {f"nats-{container['name']}-password"})
        assert passwords == want, doc["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_a_restart_does_not_chown_the_whole_disk_tier(rendered, target):
    """fsGroup's default policy (Always) re-owns every file of the 20 Gi claim at each start:
    a cachestore full of archived blocks came back minutes late."""
    for doc in _pod_templates(rendered[target]):
        context = doc["spec"]["template"]["spec"]["securityContext"]
        assert context.get("fsGroupChangePolicy") == "OnRootMismatch", doc["metadata"]["name"]


def _mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


@pytest.mark.parametrize("target", TARGETS)
def test_the_model_pull_fits_its_memory_limit_with_room_for_the_files_it_writes(rendered, target):
    """`weft model pull smollm2-135m-instruct` peaks at ~903 MiB resident (k8s.MODEL_PULL_PEAK_MIB,
    measured) and writes ~517 MiB that the same cgroup is charged for: a 1 Gi limit was 86 %
    used by the process alone, an OOM kill away from a crash-looping init container."""
    for doc in _pod_templates(rendered[target]):
        for init in doc["spec"]["template"]["spec"].get("initContainers", []):
            resources = init["resources"]
            assert _mib(resources["limits"]["memory"]) >= 2 * k8s.MODEL_PULL_PEAK_MIB, doc["metadata"]["name"]
            assert _mib(resources["requests"]["memory"]) >= k8s.MODEL_PULL_PEAK_MIB, doc["metadata"]["name"]


@pytest.mark.parametrize("target", [t for t in TARGETS if t.startswith("overlays/")])
def test_overlay_namespaces_enforce_the_restricted_pod_security_standard(rendered, target):
    """The pods meet `restricted`; without the label a later patch (or a neighbour with
    create rights in the namespace) could run a root or privileged pod beside the mesh."""
    (namespace,) = objects(rendered[target], "Namespace")
    assert namespace["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "restricted"


def _default(config_class, name: str):
    return next(f.default for f in dataclasses.fields(config_class) if f.name == name)


def test_the_executor_autoscalers_target_is_reachable_under_the_default_overcommit():
    """The scheduler keeps its backlog in its own queue and hands an executor at most
    overcommit x max_num_seqs requests, so an executor's queue never exceeds
    (overcommit - 1) x max_num_seqs: at overcommit 1 (or a target above that) the HPA saw
    no queue and never scaled out, however long the scheduler's queue grew."""
    from services.executor.engine.config import EngineConfig
    from services.scheduler.config import SchedulerConfig

    overcommit = _default(SchedulerConfig, "executor_overcommit")  # 0: no cap, executors hold the backlog
    most_waiting = (overcommit - 1) * _default(EngineConfig, "max_num_seqs") if overcommit else float("inf")
    assert float(k8s.EXECUTOR_HPA_TARGET) < most_waiting, (overcommit, most_waiting)

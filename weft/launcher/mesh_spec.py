"""The mesh's services, their commands and settings: ONE table for every way of running
Weft. ``weft up`` (``weft/launcher/launcher.py``) renders it for local processes on loopback;
``compose.yaml`` holds the same table rendered for Docker Compose, and
``tests/integration/test_compose.py`` checks that the two agree; ``deploy/k8s/base`` is
its rendering for Kubernetes (``python -m weft.launcher.k8s write``), checked equal to the
generator's output by ``tests/unit/deploy``.

Settings are ``WEFT_*`` environment variables (plus the odd runtime knob such as
``OMP_WAIT_POLICY``) (every service reads its config from
flags or env through ``services/mesh/env_config.py``), so a service's command is the
same everywhere and only the rendered values differ. Values are templates over a
``Context``:

    {bind_host}       address services bind        local: 127.0.0.1   compose: 0.0.0.0
    {model_dir}       checkpoint directory         local: --model     compose: ${WEFT_MODEL_DIR:-...}
    {nats_url}        the NATS server              local: free port   compose: nats://nats:4222
    {<svc>_addr}      host:port of a gRPC service  local: free port   compose: <svc>:<default port>
    {<port_key>}      this instance's own ports    local: free ports  compose: the defaults below
    {executor_name}   executor-<i> locally; compose replicas name themselves (empty)
    {cachestore_dir}  the archived KV tier         local: <state dir>/cachestore   compose: a volume
    {mesh_secret}     shared secret of internal calls  local: $WEFT_MESH_SECRET (may be empty)
                                                   compose: ${WEFT_MESH_SECRET:-<dev default>}
    {nats_config}     nats-server's users and permissions  local: <state dir>/nats.conf
                                                   compose: the image's services/mesh/nats.conf
    {nats_<role>_password}  NATS login of a role   local: random per `weft up` (or derived from
                                                   $WEFT_NATS_SECRET)  compose: ${WEFT_NATS_<ROLE>_PASSWORD:-<dev>}
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.mesh import nats_auth


@dataclass(frozen=True)
class Health:
    """How to probe an instance: gRPC health Check on a port, or HTTP GET of a path."""

    kind: str  # "grpc" | "http" | "tcp"
    port_key: str
    path: str = ""


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    role: str  # one line: what it does in the mesh
    command: tuple[str, ...]  # argv after the interpreter: ("-m", "services.router"); nats: its binary's args
    ports: Mapping[str, int]  # port key -> default (container) port
    settings: Mapping[str, str]  # WEFT_* env -> template
    health: Health
    depends_on: tuple[str, ...] = ()
    scalable: bool = False  # several instances (executors); no fixed name or host port
    published: tuple[str, ...] = ()  # port keys exposed to clients (host ports in compose)
    python: bool = True  # command runs under the Python interpreter (nats-server does not)
    # Readiness, where it differs from liveness (``health``): the router is alive before any
    # executor joined, ready (``GET /health/ready`` 200) once one serves. Compose's
    # healthcheck uses it; ``weft up`` waits on it before printing "Weft mesh is up".
    ready: Health | None = None

    @property
    def healthcheck(self) -> Health:
        """What a container healthcheck probes: readiness where defined, else liveness."""
        return self.ready or self.health

    def render(self, ctx: Mapping[str, str]) -> dict[str, str]:
        """The environment of one instance under ``ctx``."""
        return {key: template.format_map(ctx) for key, template in self.settings.items()}


# Every Python service: log level, and the mesh secret its internal gRPC calls carry and
# its servers require (services/mesh/mesh_auth.py).
_COMMON = {"WEFT_LOG_LEVEL": "{log_level}", "WEFT_MESH_SECRET": "{mesh_secret}"}


def _nats_login(role: str) -> dict[str, str]:
    """A service's own NATS login: its role and that role's password, nobody else's
    (services/mesh/nats_auth.py: only executors may publish heartbeats)."""
    return {nats_auth.USER_ENV: role, nats_auth.PASSWORD_ENV: "{nats_%s_password}" % role}


SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec(
        name="nats", role="event bus (kv / load / membership / session events)",
        command=("nats-server", "-c", "{nats_config}", "-a", "{bind_host}", "-p", "{nats_port}",
                 "-m", "{nats_monitor_port}"),
        ports={"nats_port": 4222, "nats_monitor_port": 8222},
        # The config names the users; their passwords reach nats-server only through these.
        settings={nats_auth.role_password_env(r): "{nats_%s_password}" % r for r in nats_auth.ROLES},
        health=Health("http", "nats_monitor_port", "/healthz"),
        python=False,
    ),
    ServiceSpec(
        name="cachestore", role="tiered KV block store and semantic index",
        command=("-m", "services.cachestore"),
        ports={"cachestore_port": 50071, "cachestore_metrics_port": 9171},
        settings={**_COMMON, "WEFT_CACHESTORE_HOST": "{bind_host}", "WEFT_CACHESTORE_PORT": "{cachestore_port}",
                  "WEFT_CACHESTORE_METRICS_PORT": "{cachestore_metrics_port}",
                  "WEFT_CACHESTORE_DISK_DIR": "{cachestore_dir}", "WEFT_NATS_URL": "{nats_url}",
                  **_nats_login("cachestore")},
        health=Health("grpc", "cachestore_port"),
        depends_on=("nats",),
    ),
    ServiceSpec(
        name="scheduler", role="admission, placement, priority (control plane)",
        command=("-m", "services.scheduler"),
        ports={"scheduler_port": 50052, "scheduler_metrics_port": 9152},
        settings={**_COMMON, "WEFT_NATS_URL": "{nats_url}", "WEFT_SCHEDULER_HOST": "{bind_host}",
                  "WEFT_SCHEDULER_PORT": "{scheduler_port}", "WEFT_SCHEDULER_METRICS_PORT": "{scheduler_metrics_port}",
                  # The intent check's sources: the cachestore's embeddings of text the served
                  # model's tokenizer detokenises (bigrams while the cachestore is unreachable).
                  "WEFT_SCHEDULER_CACHESTORE_ADDRESS": "{cachestore_addr}", "WEFT_SCHEDULER_MODEL_DIR": "{model_dir}",
                  **_nats_login("scheduler")},
        health=Health("grpc", "scheduler_port"),
        depends_on=("nats",),
    ),
    ServiceSpec(
        name="executor", role="model + paged KV cache, continuous batching (data plane)",
        command=("-m", "services.executor"),
        ports={"executor_port": 50061, "executor_metrics_port": 9161},
        settings={**_COMMON, "WEFT_NATS_URL": "{nats_url}", "WEFT_EXECUTOR_HOST": "{bind_host}",
                  "WEFT_EXECUTOR_PORT": "{executor_port}", "WEFT_EXECUTOR_METRICS_PORT": "{executor_metrics_port}",
                  "WEFT_EXECUTOR_MODEL_DIR": "{model_dir}", "WEFT_EXECUTOR_NAME": "{executor_name}",
                  # torch's CPU runtime as services/executor/process_env.py says why: idle
                  # OpenMP workers sleep (spinning ones starved co-located event loops), after
                  # a bounded spin (pure PASSIVE made a decode step ~1.6x slower), and
                  # weights on transparent huge pages.
                  "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000", "THP_MEM_ALLOC_ENABLE": "1",
                  "WEFT_EXECUTOR_CACHESTORE_ADDRESS": "{cachestore_addr}", **_nats_login("executor")},
        health=Health("grpc", "executor_port"),
        depends_on=("nats",),
        scalable=True,
    ),
    ServiceSpec(
        name="router", role="public gRPC + OpenAI HTTP API, tokenization",
        command=("-m", "services.router"),
        # Metrics on their own port (per-tenant labels stay off the public one), bound like
        # the other services' (loopback locally, the compose network in compose), never published.
        ports={"router_http_port": 8000, "router_grpc_port": 50051, "router_metrics_port": 9150},
        settings={**_COMMON, "WEFT_ROUTER_HOST": "{bind_host}", "WEFT_ROUTER_HTTP_PORT": "{router_http_port}",
                  "WEFT_ROUTER_GRPC_PORT": "{router_grpc_port}", "WEFT_ROUTER_MODEL_DIR": "{model_dir}",
                  "WEFT_ROUTER_SCHEDULER_ADDRESS": "{scheduler_addr}", "WEFT_ROUTER_KEYS_FILE": "{keys_file}",
                  "WEFT_ROUTER_CACHESTORE_ADDRESS": "{cachestore_addr}",
                  "WEFT_ROUTER_METRICS_HOST": "{bind_host}", "WEFT_ROUTER_METRICS_PORT": "{router_metrics_port}",
                  # The live-settings document (docs/live_config.md): read from this file, sent
                  # to the other services over NATS, where only the router may publish it.
                  "WEFT_SETTINGS_FILE": "{settings_file}", "WEFT_NATS_URL": "{nats_url}",
                  **_nats_login("router")},
        health=Health("http", "router_http_port", "/health"),
        ready=Health("http", "router_http_port", "/health/ready"),
        depends_on=("scheduler",),
        published=("router_http_port", "router_grpc_port"),
    ),
)

BY_NAME: dict[str, ServiceSpec] = {s.name: s for s in SERVICES}
# Settings of the mesh itself (not of one service) that compose takes from the host
# environment: ``WEFT_MODEL_DIR=/models/x docker-compose up``. The default is the model
# `weft up` serves without --model (SmolLM2-135M-Instruct), pulled into the image's model
# cache when the image is built (Dockerfile: `weft model pull`, WEFT_CACHE_DIR=/opt/weft/cache).
COMPOSE_MODEL_DIR = "${WEFT_MODEL_DIR:-/opt/weft/cache/models/smollm2-135m-instruct}"
COMPOSE_KEYS_FILE = "${WEFT_KEYS_FILE:-}"
COMPOSE_SETTINGS_FILE = "${WEFT_SETTINGS_FILE:-}"
COMPOSE_LOG_LEVEL = "${WEFT_LOG_LEVEL:-info}"
COMPOSE_CACHESTORE_DIR = "/var/lib/weft/cachestore"  # the cachestore-data volume
# Internal calls inside a compose mesh always carry a secret. The fallback only keeps
# `docker compose up` working out of the box: set WEFT_MESH_SECRET for anything shared.
COMPOSE_MESH_SECRET = "${WEFT_MESH_SECRET:-weft-dev-mesh-secret-change-me}"
# NATS logins: the image ships the rendered users file; each role's password comes from the
# host (`python -m services.mesh.nats_auth env >> .env`), else a public development
# fallback that every bus warns about.
COMPOSE_NATS_CONFIG = "/opt/weft/services/mesh/nats.conf"
COMPOSE_NATS_PASSWORDS = {r: "${%s:-%s}" % (nats_auth.role_password_env(r), nats_auth.dev_fallback_password(r))
                          for r in nats_auth.ROLES}
# Compose restarts a container whose process exits, as ``weft up``'s supervisor restarts a
# process (weft/launcher/restart_policy.py); not one an operator stopped.
COMPOSE_RESTART = "unless-stopped"


@dataclass(frozen=True)
class Context:
    """Values the templates are rendered with; ``ports`` maps every port key in use."""

    bind_host: str
    model_dir: str
    ports: Mapping[str, int]
    hosts: Mapping[str, str]  # service name -> host other services dial it at
    keys_file: str = ""
    settings_file: str = ""  # the live-settings document (docs/live_config.md)
    log_level: str = "info"
    executor_name: str = ""
    cachestore_dir: str = ""
    mesh_secret: str = ""
    nats_config: str = ""
    nats_passwords: Mapping[str, str] = field(default_factory=dict)  # role -> password
    extra: Mapping[str, str] = field(default_factory=dict)

    def mapping(self) -> dict[str, str]:
        values: dict[str, str] = {k: str(v) for k, v in self.ports.items()}
        values.update(bind_host=self.bind_host, model_dir=self.model_dir, keys_file=self.keys_file,
                      settings_file=self.settings_file,
                      log_level=self.log_level, executor_name=self.executor_name,
                      cachestore_dir=self.cachestore_dir, mesh_secret=self.mesh_secret,
                      nats_config=self.nats_config,
                      nats_url=f"nats://{self.hosts['nats']}:{self.ports['nats_port']}")
        values.update({f"nats_{role}_password": pw for role, pw in self.nats_passwords.items()})
        for spec in SERVICES:
            grpc_key = next((k for k in spec.ports if k == f"{spec.name}_port" or k.endswith("grpc_port")), None)
            if grpc_key is not None and spec.name in self.hosts and grpc_key in self.ports:
                values[f"{spec.name}_addr"] = f"{self.hosts[spec.name]}:{self.ports[grpc_key]}"
        values.update(self.extra)
        return values


def compose_context() -> Context:
    """How compose.yaml renders the table: service DNS names, default ports."""
    ports = {k: v for spec in SERVICES for k, v in spec.ports.items()}
    return Context(bind_host="0.0.0.0", model_dir=COMPOSE_MODEL_DIR, ports=ports,
                   hosts={s.name: s.name for s in SERVICES}, keys_file=COMPOSE_KEYS_FILE,
                   settings_file=COMPOSE_SETTINGS_FILE,
                   log_level=COMPOSE_LOG_LEVEL, executor_name="", cachestore_dir=COMPOSE_CACHESTORE_DIR,
                   mesh_secret=COMPOSE_MESH_SECRET, nats_config=COMPOSE_NATS_CONFIG,
                   nats_passwords=COMPOSE_NATS_PASSWORDS)

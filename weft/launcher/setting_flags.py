"""The services' settings an operator sets through ``weft up``: one table, flag -> service(s) ->
``WEFT_*`` variable.

Each service reads its settings from flags or ``WEFT_<SERVICE>_<FIELD>`` variables
(``services/mesh/env_config.py``); ``weft up`` hands a setting to the services that read it
through their environment (``Launcher.instance_env``), so a service process never sees a
flag it does not own. The table is written out here, not read from the services' config
classes, because building ``weft --help`` must not import the services (torch);
``tests/unit/weft/test_up_setting_flags.py`` checks every row against the config class it
names (field, env name, default, choices), so the two cannot drift. Values stay the text a
service parses; ``weft/launcher/setting_checks.py`` validates them with the services' own
parsers before anything starts.

Keys of ``UpOptions.settings`` are the flags' dest names (``pause_policy`` for ``--pause-policy``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

SCHEDULING = "scheduling order"
PAUSES = "tool-call pauses and sessions"
LADDER = "degradation ladder"
TENANTS = "tenants: KV partitions and quotas"
POOL = "KV pool and batching (every executor)"
TIERS = "KV tiers (cachestore)"
REQUESTS = "requests and recovery"
GROUPS = (SCHEDULING, PAUSES, LADDER, TENANTS, POOL, TIERS, REQUESTS)


@dataclass(frozen=True)
class SettingFlag:
    """One ``weft up`` flag: the config field(s) it sets and how ``--help`` explains it."""

    flag: str  # "--pause-policy"
    group: str  # one of GROUPS: the --help section it is listed in
    targets: tuple[tuple[str, str], ...]  # (service, config field) pairs it sets
    default: str  # the services' default, as text (what `weft ps` compares against)
    help: str
    choices: tuple[str, ...] = ()
    boolean: bool = False  # --x / --no-x
    metavar: str = ""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def envs(self) -> dict[str, str]:
        """service -> the variable it reads this setting from (env_config.env_name's rule)."""
        return {service: f"WEFT_{service.upper()}_{field.upper()}" for service, field in self.targets}

    def describe(self) -> str:
        """The --help text: what it does, which service reads it under which variable, the default."""
        where = ", ".join(f"{s} {e}" for s, e in self.envs.items())
        return f"{self.help} [{where}; default: {self.default or 'empty'}]"


def _s(flag: str, group: str, field: str, default: str, help: str, **kw) -> SettingFlag:
    return SettingFlag(flag, group, (("scheduler", field),), default, help, **kw)


def _e(flag: str, group: str, field: str, default: str, help: str, **kw) -> SettingFlag:
    return SettingFlag(flag, group, (("executor", field),), default, help, **kw)


def _c(flag: str, group: str, field: str, default: str, help: str, **kw) -> SettingFlag:
    return SettingFlag(flag, group, (("cachestore", field),), default, help, **kw)


def _r(flag: str, group: str, field: str, default: str, help: str, **kw) -> SettingFlag:
    return SettingFlag(flag, group, (("router", field),), default, help, **kw)


FLAGS: tuple[SettingFlag, ...] = (
    # -- scheduling order ---------------------------------------------------------------
    _s("--policy", SCHEDULING, "policy", "weft",
       "scheduling policy: weft (dynamic per-program priority, cost-based pauses), fcfs (arrival order: "
       "the vLLM-like baseline) or priority (static class + caller priority)", choices=("weft", "fcfs", "priority")),
    _e("--preemption-policy", SCHEDULING, "preemption_policy", "priority",
       "an executor's waiting order and who loses KV blocks under pressure: priority (the scheduler's "
       "priority; borrowers lose first) or fcfs (arrival order, newest loses: the vLLM-like ablation)",
       choices=("fcfs", "priority")),
    _s("--placement", SCHEDULING, "placement", "kv",
       "which executor gets a request: kv (prefix overlap and load), round_robin or least_loaded",
       choices=("kv", "round_robin", "least_loaded")),
    _s("--max-in-flight", SCHEDULING, "max_in_flight", "256", "requests streaming at once", metavar="N"),
    _s("--max-queue", SCHEDULING, "max_queue", "1024",
       "requests waiting for an in-flight slot; beyond it RESOURCE_EXHAUSTED / 429", metavar="N"),
    _s("--max-in-flight-per-tenant", SCHEDULING, "max_in_flight_per_tenant", "128",
       "requests of one tenant streaming at once", metavar="N"),
    _s("--max-queue-per-tenant", SCHEDULING, "max_queue_per_tenant", "1024",
       "requests of one tenant that may wait beyond its in-flight cap (the default lets one tenant reach "
       "the ladder's shed rung)", metavar="N"),
    _s("--executor-overcommit", SCHEDULING, "executor_overcommit", "1.25",
       "in-flight requests per executor batch slot (max_num_seqs); the rest wait in the scheduler's scored "
       "queue, where the policy orders them; 0: no cap by slots (requests queue at the executors); live "
       "(docs/live_config.md)", metavar="F"),
    _s("--kv-overlap-weight", SCHEDULING, "kv_overlap_weight", "1.0",
       "kv placement: cost of computing one prompt block relative to one KV block in use on the executor "
       "(higher: prefix reuse weighs more than load)", metavar="W"),
    _s("--retry-after-ms", SCHEDULING, "retry_after_ms", "200", "retry hint sent with an overload refusal",
       metavar="MS"),
    _s("--priority-weights", SCHEDULING, "priority_weights", "",
       "--policy weft: weights of the priority terms over the defaults, name=value comma-separated: las (least "
       "attained service per program, 1), slack (contract deadline, 1), fresh (0.5), entropy (0.5), aging_s "
       "(seconds of waiting worth one class level, 30); live (docs/live_config.md)", metavar="NAME=W,..."),
    _s("--priority-interval-s", SCHEDULING, "priority_interval_s", "0.5",
       "seconds between re-estimations of running requests' priority (--policy weft)", metavar="S"),
    # -- tool-call pauses ---------------------------------------------------------------
    _s("--pause-policy", PAUSES, "pause_policy", "auto",
       "what a session's KV does during a tool call: cost (keep / demote / drop by cost), keep, demote, drop; "
       "auto: cost under --policy weft, drop otherwise", choices=("auto", "cost", "keep", "demote", "drop")),
    _s("--default-tool-ms", PAUSES, "default_tool_ms", "2000.0",
       "expected tool-call pause when neither the caller nor the session's history says", metavar="MS"),
    _s("--max-pinned-fraction", PAUSES, "max_pinned_fraction", "0.5",
       "most of an executor's KV pool that paused sessions may pin", metavar="F"),
    _s("--demote", PAUSES, "demote", "true",
       "let the pause policy demote paused sessions to the cachestore's host tier", boolean=True),
    _s("--prefill-ms-per-token", PAUSES, "prefill_ms_per_token", "0.2",
       "pause cost model: prefill time per prompt token", metavar="MS"),
    _s("--block-second-ms", PAUSES, "block_second_ms", "2.0",
       "pause cost model: price of holding one KV block idle for a second on a half-full pool", metavar="MS"),
    _s("--transfer-ms-per-block", PAUSES, "transfer_ms_per_block", "0.5",
       "pause cost model: moving one KV block to or from the host tier", metavar="MS"),
    _s("--intent-shift-threshold", PAUSES, "intent_shift_threshold", "0.9",
       "distance (0..1) of a new turn from its session's context above which kept KV is released early",
       metavar="D"),
    _s("--max-sessions", PAUSES, "max_sessions", "10000",
       "sessions (and programs) remembered, least recently used dropped", metavar="N"),
    _e("--demote-on-finish", PAUSES, "demote_on_finish", "sessions",
       "which finished requests' KV blocks an executor writes to the cachestore",
       choices=("never", "sessions", "all")),
    _e("--demote-on-finish-min-held", PAUSES, "demote_on_finish_min_held", "0.5",
       "demote-on-finish writes only while running requests hold at least this fraction of the executor's KV "
       "pool (pins count as room: they yield to live work; below it LRU keeps the blocks anyway); 0: always",
       metavar="F"),
    # -- degradation ladder -------------------------------------------------------------
    _s("--degradation-rungs", LADDER, "degradation_rungs", "none,kv_int8,kv_compress,smaller_model,shed",
       "comma-separated rungs the ladder may use (a degraded rung acts only while an executor serves it: "
       "--extra-executor)", metavar="RUNGS"),
    _s("--degradation-thresholds", LADDER, "degradation_thresholds", "",
       "load thresholds (0..1), rung=enter:exit comma-separated over the defaults (kv_int8=0.6:0.45, "
       "kv_compress=0.7:0.55, smaller_model=0.8:0.65, shed=0.95:0.75)", metavar="RUNG=ENTER:EXIT,..."),
    _s("--degradation-min-dwell-s", LADDER, "degradation_min_dwell_s", "2.0",
       "seconds a class stays on a rung before it may step down", metavar="S"),
    # -- tenants ------------------------------------------------------------------------
    _s("--tenant-quotas", TENANTS, "tenant_quotas", "",
       "most KV blocks per executor a tenant may hold, name=blocks comma-separated; a contract asking more "
       "is refused", metavar="NAME=BLOCKS,..."),
    _s("--tenant-weights", TENANTS, "tenant_weights", "",
       "fair-share weight per tenant in the scheduler's queue, name=weight comma-separated (unnamed tenants "
       "weigh 1; a weight-2 tenant gets twice the slots under contention)", metavar="NAME=WEIGHT,..."),
    _e("--tenant-partitions", TENANTS, "tenant_partitions", "",
       "KV partitions per tenant in every executor, name=reserved:credit blocks comma-separated "
       "(e.g. acme=32:16)", metavar="NAME=RESERVED:CREDIT,..."),
    _e("--credit-audit-period-s", TENANTS, "credit_audit_period_s", "2.0",
       "seconds between audits that decay a borrowing tenant's credit; 0 disables", metavar="S"),
    # -- KV pool and batching -----------------------------------------------------------
    _e("--num-kv-blocks", POOL, "num_kv_blocks", "none",
       "KV blocks in each executor's pool; none: derived from --kv-cache-memory-bytes", metavar="N|none"),
    _e("--kv-cache-memory-bytes", POOL, "kv_cache_memory_bytes", "1073741824",
       "bytes of KV cache per executor when --num-kv-blocks is none (at most twice what --max-num-seqs "
       "full-length sequences fill)", metavar="BYTES"),
    _e("--block-size", POOL, "block_size", "16", "tokens per KV block", metavar="N"),
    _e("--kv-cache-dtype", POOL, "kv_cache_dtype", "auto",
       "KV storage: auto (the model dtype) or int8 (an int8 pool serves the kv_int8 rung)",
       choices=("auto", "int8")),
    _e("--enable-prefix-caching", POOL, "enable_prefix_caching", "true",
       "reuse KV blocks across requests by block hash", boolean=True),
    _e("--promote-before-prefill", POOL, "promote_before_prefill", "true",
       "load a prompt's prefix blocks from the cachestore before its prefill when cheaper than recompute",
       boolean=True),
    _e("--native-decode", POOL, "native_decode", "true",
       "on a CPU in float32, run a batch-1 decode step as one native C call (built with gcc at first use; "
       "a failed build keeps the torch path)", boolean=True),
    _e("--max-num-seqs", POOL, "max_num_seqs", "64", "most requests computed in one step (max batch)", metavar="N"),
    _e("--max-num-batched-tokens", POOL, "max_num_batched_tokens", "2048", "most tokens computed in one step",
       metavar="N"),
    _e("--max-prefill-chunk", POOL, "max_prefill_chunk", "512",
       "longest prefill chunk one request gets per step (<= --max-num-batched-tokens)", metavar="N"),
    SettingFlag("--max-model-len", POOL, (("executor", "max_model_len"), ("router", "max_model_len")), "none",
                "context limit in tokens, in the executors and the router; none: the checkpoint's",
                metavar="N|none"),
    _e("--device", POOL, "device", "cpu", "torch device of the executors: cpu, cuda, cuda:N", metavar="DEVICE"),
    _e("--dtype", POOL, "dtype", "float32", "weight and KV dtype", choices=("float32", "float16", "bfloat16")),
    _e("--num-threads", POOL, "num_threads", "none", "torch CPU threads per executor; none: torch's choice",
       metavar="N|none"),
    # -- cachestore ---------------------------------------------------------------------
    _c("--host-capacity-bytes", TIERS, "host_capacity_bytes", "1073741824",
       "bytes of host RAM for the sleeping KV tier", metavar="BYTES"),
    _c("--disk-capacity-bytes", TIERS, "disk_capacity_bytes", "10737418240",
       "bytes of disk for the archived KV tier", metavar="BYTES"),
    _c("--tier-policy", TIERS, "tier_policy", "demote_on_evict", "where blocks land and where RAM evictions go",
       choices=("demote_on_evict", "write_through", "host_only")),
    _c("--demotion-policy", TIERS, "demotion_policy", "pause_aware",
       "which sleeping (RAM) blocks a sweep archives to disk", choices=("never", "age", "pause_aware")),
    # -- requests -----------------------------------------------------------------------
    _r("--request-timeout-s", REQUESTS, "request_timeout_s", "600.0",
       "deadline of one generation, propagated downstream", metavar="S"),
    _r("--max-body-bytes", REQUESTS, "max_body_bytes", "16777216",
       "largest request on either public API (HTTP 413 / gRPC RESOURCE_EXHAUSTED beyond)", metavar="BYTES"),
    _r("--tool-call-parser", REQUESTS, "tool_call_parser", "auto",
       "how tool calls are written and parsed: auto (from the chat template), hermes, smollm2, llama3_json, "
       "mistral or pythonic", metavar="FORMAT"),
    _r("--served-model-name", REQUESTS, "served_model_name", "",
       "model id clients send; empty: the checkpoint directory's name", metavar="NAME"),
    _r("--continuation-attempts", REQUESTS, "continuation_attempts", "3",
       "times the router re-issues a stream when the scheduler dies or stalls mid-stream; 0: never",
       metavar="N"),
    _s("--migration-attempts", REQUESTS, "migration_attempts", "3",
       "executors one stream may use in all when executors die or stall mid-stream (1: no migration)",
       metavar="N"),
)

BY_DEST: dict[str, SettingFlag] = {f.dest: f for f in FLAGS}


def unknown_settings(settings: Mapping[str, str]) -> list[str]:
    return sorted(k for k in settings if k not in BY_DEST)


def service_env(settings: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """service -> {WEFT_* variable: value} for ``settings`` (dest -> value text)."""
    env: dict[str, dict[str, str]] = {}
    for dest, value in settings.items():
        for service, variable in BY_DEST[dest].envs.items():
            env.setdefault(service, {})[variable] = value
    return env


def non_default(service: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The table's settings of ``service`` that ``environ`` (its process environment) sets to
    something other than the default, as flag -> value; what ``weft ps`` shows."""
    out: dict[str, str] = {}
    for f in FLAGS:
        variable = f.envs.get(service)
        if variable is not None and variable in environ and not _same(f, environ[variable]):
            out[f.flag] = environ[variable]
    return out


def _same(f: SettingFlag, value: str) -> bool:
    text = value.strip().lower()
    if f.boolean:
        return text in (("1", "true", "yes", "on") if f.default == "true" else ("0", "false", "no", "off"))
    if text == f.default.lower() or (f.default == "none" and text in ("", "null")):
        return True
    try:
        return float(text) == float(f.default)
    except ValueError:
        return False

"""`weft up`'s setting flags: each reaches exactly the services that read it, as the variable
their own config parser reads; a bad value is refused naming the flag before anything starts;
--help lists every flag; `weft ps` shows what differs from the defaults. No mesh is started:
the launcher renders each instance's environment and the services' own configs load it."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from services.cachestore.config import CacheStoreConfig
from services.executor.config import ExecutorConfig
from services.mesh.env_config import env_name, resolve
from services.router.config import RouterConfig
from services.scheduler.config import SchedulerConfig
from weft.cli.commands import build_parser, main
from weft.cli.up_flags import settings_from_args
from weft.launcher.launcher import Launcher
from weft.launcher.mesh_spec import BY_NAME, SERVICES
from weft.launcher.mesh_state import MeshState, read_state, write_state
from weft.launcher.options import UpOptions
from weft.launcher.setting_flags import FLAGS, non_default

CONFIGS = {"scheduler": SchedulerConfig, "executor": ExecutorConfig, "cachestore": CacheStoreConfig,
           "router": RouterConfig}

# A valid value other than the default for every flag that is neither boolean nor a choice.
SAMPLES = {
    "max_in_flight": "7", "max_queue": "9", "max_in_flight_per_tenant": "3", "max_queue_per_tenant": "4",
    "retry_after_ms": "50", "priority_interval_s": "0.25", "default_tool_ms": "750", "max_pinned_fraction": "0.25",
    "demote_on_finish_min_held": "0.25",
    "prefill_ms_per_token": "0.5", "block_second_ms": "3", "transfer_ms_per_block": "1.5",
    "intent_shift_threshold": "0.7", "max_sessions": "99", "degradation_rungs": "none,shed",
    "degradation_thresholds": "shed=0.9:0.7", "degradation_min_dwell_s": "1.5", "tenant_quotas": "acme=64", "tenant_weights": "acme=2",
    "executor_overcommit": "2", "kv_overlap_weight": "0.5",
    "tenant_partitions": "acme=32:16", "credit_audit_period_s": "0", "num_kv_blocks": "128",
    "kv_cache_memory_bytes": "1048576", "block_size": "32", "max_num_seqs": "8", "max_num_batched_tokens": "4096",
    "max_prefill_chunk": "256", "max_model_len": "1024", "device": "cuda:1", "num_threads": "2",
    "host_capacity_bytes": "4096", "disk_capacity_bytes": "8192", "request_timeout_s": "30",
    "max_body_bytes": "65536", "tool_call_parser": "hermes", "served_model_name": "m",
    "continuation_attempts": "0", "migration_attempts": "1", "priority_weights": "las=0.5,aging_s=10",
}


def _argv(f) -> list[str]:
    if f.boolean:
        return [f.flag if f.default == "false" else "--no-" + f.flag[2:]]
    value = next(c for c in f.choices if c != f.default) if f.choices else SAMPLES[f.dest]
    return [f.flag, value]


def _default_text(value) -> str:
    if value is None:
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("f", FLAGS, ids=lambda f: f.flag)
def test_each_row_names_a_real_field_with_its_variable_default_and_choices(f):
    for service, name in f.targets:
        field = {x.name: x for x in dataclasses.fields(CONFIGS[service])}[name]
        assert f.envs[service] == env_name(service, field)
        assert f.default == _default_text(field.default)
        if field.metadata.get("choices"):
            assert set(f.choices) == set(field.metadata["choices"]) - {""}


def test_every_plain_flag_has_a_sample_value():
    assert {f.dest for f in FLAGS if not f.boolean and not f.choices} == set(SAMPLES)


def _launcher(tmp_path, settings, extra_env=None) -> Launcher:
    return Launcher(UpOptions(state_dir=tmp_path, settings=settings, extra_env=dict(extra_env or {})))


def _render(launcher: Launcher, service: str, model_dir) -> dict[str, str]:
    """The environment ``spawn`` would give one instance of ``service``."""
    ports = {k: 20000 + i for i, k in enumerate(k for s in SERVICES for k in s.ports)}
    launcher.model_dir = str(model_dir)
    ctx = launcher._context(ports, executor_name="executor-0" if service == "executor" else "")
    return launcher.instance_env(BY_NAME[service], ctx.mapping())


@pytest.mark.parametrize("f", FLAGS, ids=lambda f: f.flag)
def test_flag_reaches_only_its_services_as_their_variable(f, tmp_path):
    args = build_parser().parse_args(["up", *_argv(f)])
    settings = settings_from_args(args)
    assert list(settings) == [f.dest]
    launcher = _launcher(tmp_path, settings)
    for spec in SERVICES:
        env = _render(launcher, spec.name, tmp_path)
        for service, variable in f.envs.items():
            if service == spec.name:
                assert env[variable] == settings[f.dest]
                assert non_default(service, env) == {f.flag: settings[f.dest]}
        others = {v for s, v in f.envs.items() if s != spec.name}
        assert not others & {k for k in env if k not in os.environ}


def test_rendered_environments_load_in_the_services_own_configs(tmp_path):
    """Integration of the rendering: what the launcher hands each service is what its own
    parser reads, flags over the options' extra environment, the table's ports over both."""
    (tmp_path / "tokenizer.json").write_text("{}")
    settings = {"policy": "fcfs", "pause_policy": "demote", "tenant_quotas": "acme=64", "num_kv_blocks": "128",
                "preemption_policy": "fcfs", "enable_prefix_caching": "false", "max_model_len": "512",
                "tier_policy": "host_only", "request_timeout_s": "30"}
    launcher = _launcher(tmp_path, settings, extra_env={"WEFT_SCHEDULER_POLICY": "priority",
                                                        "WEFT_SCHEDULER_MAX_QUEUE": "5"})
    envs = {s: _render(launcher, s, tmp_path) for s in CONFIGS}
    scheduler = resolve(SchedulerConfig, "scheduler", {}, envs["scheduler"])
    assert (scheduler.policy, scheduler.resolved_pause_policy, scheduler.max_queue) == ("fcfs", "demote", 5)
    assert scheduler.tenant_quotas == "acme=64" and scheduler.port == 20000 + _port_index("scheduler_port")
    executor = resolve(ExecutorConfig, "executor", {}, envs["executor"])
    assert (executor.num_kv_blocks, executor.preemption_policy, executor.enable_prefix_caching,
            executor.max_model_len) == (128, "fcfs", False, 512)
    assert resolve(CacheStoreConfig, "cachestore", {}, envs["cachestore"]).tier_policy == "host_only"
    router = resolve(RouterConfig, "router", {}, envs["router"])
    assert (router.max_model_len, router.request_timeout_s) == (512, 30.0)
    shown = launcher.effective_settings()
    assert shown["scheduler"] == {"--max-queue": "5", "--policy": "fcfs", "--pause-policy": "demote",
                                  "--tenant-quotas": "acme=64"}
    assert shown["router"] == {"--max-model-len": "512", "--request-timeout-s": "30"}


def _port_index(key: str) -> int:
    return [k for s in SERVICES for k in s.ports].index(key)


def test_setting_variables_never_collide_with_the_tables_rendered_ones():
    rendered = {k for s in SERVICES for k in s.settings}
    assert not rendered & {v for f in FLAGS for v in f.envs.values()}


@pytest.mark.parametrize("argv, flag", [
    (["--num-kv-blocks", "-3"], "--num-kv-blocks"),
    (["--num-kv-blocks", "lots"], "--num-kv-blocks"),
    (["--tenant-partitions", "acme=x"], "--tenant-partitions"),
    (["--tenant-quotas", "acme"], "--tenant-quotas"),
    (["--degradation-thresholds", "kv_int8=0.9"], "--degradation-thresholds"),
    (["--tool-call-parser", "nope"], "--tool-call-parser"),
    (["--max-pinned-fraction", "x"], "--max-pinned-fraction"),
    (["--max-prefill-chunk", "4096"], "--max-prefill-chunk"),
    (["--max-model-len", "1"], "--max-model-len"),
])
def test_bad_value_fails_up_before_anything_starts_naming_the_flag(argv, flag, tmp_path, capsys):
    code = main(["up", "--state-dir", str(tmp_path), "--model", str(tmp_path / "absent"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"weft up failed: {flag}:")
    assert list(tmp_path.iterdir()) == []  # no state, no logs: nothing started


def test_bad_choice_is_refused_by_the_parser_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["up", "--policy", "fastest"])
    assert exit_.value.code == 2 and "--policy" in capsys.readouterr().err


def test_values_valid_only_together_are_accepted():
    UpOptions(settings={"max_prefill_chunk": "4096", "max_num_batched_tokens": "8192"})


def test_help_lists_every_flag_with_its_variable_and_default():
    up = build_parser()._subparsers._group_actions[0].choices["up"]
    text = up.format_help()
    for f in FLAGS:
        assert f.flag in text
        for variable in f.envs.values():
            assert variable in text
    assert "default: weft]" in text and "settings: scheduling order" in text


def test_configuration_doc_lists_every_flag_and_variable():
    doc = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    for f in FLAGS:
        assert f"`{f.flag}`" in doc
        for variable in f.envs.values():
            assert f"`{variable}`" in doc


def test_defaults_given_explicitly_are_not_reported_as_changed():
    env = {"WEFT_SCHEDULER_MAX_QUEUE": "1024", "WEFT_SCHEDULER_DEFAULT_TOOL_MS": "2000", "WEFT_SCHEDULER_DEMOTE": "on",
           "WEFT_SCHEDULER_DEGRADATION_THRESHOLDS": "", "WEFT_SCHEDULER_POLICY": "fcfs"}
    assert non_default("scheduler", env) == {"--policy": "fcfs"}


def test_ps_lists_non_default_settings(tmp_path, capsys):
    write_state(tmp_path, MeshState(launcher_pid=os.getpid(), control_port=1, control_token="t", model_dir="m",
                                    http_url="", grpc_address="", nats_url="",
                                    settings={"scheduler": {"--policy": "fcfs"}, "executor": {"--num-kv-blocks": "128"}}))
    assert main(["ps", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3] == "settings (not the default):"
    assert out[-2].split() == ["executor", "--num-kv-blocks", "128"]
    assert out[-1].split() == ["scheduler", "--policy", "fcfs"]


def test_a_state_file_without_settings_still_reads(tmp_path):
    write_state(tmp_path, MeshState(launcher_pid=1, control_port=1, control_token="t", model_dir="m", http_url="",
                                    grpc_address="", nats_url=""))
    raw = (tmp_path / "mesh.json").read_text().replace(',\n  "settings": {}', "")
    (tmp_path / "mesh.json").write_text(raw)
    assert read_state(tmp_path).settings == {}

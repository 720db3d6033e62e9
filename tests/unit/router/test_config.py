"""RouterConfig: the shared service options come from ServiceOptions, every flag the router
ever took still parses, and the drain is --drain-timeout-s, else the shared --grace-s."""
from __future__ import annotations

import dataclasses

import pytest

from services.mesh.env_config import build_parser, load_config
from services.mesh.service_options import ServiceOptions
from services.router.config import RouterConfig
from weft.testing.tiny_model import make_tiny_checkpoint

# Every flag `python -m services.router --help` listed before the config took ServiceOptions.
FLAGS = """--body-read-timeout-s --cachestore-address --continuation-attempts --continuation-min-stall-s
--continuation-probe-attempts --continuation-probe-backoff --continuation-probe-timeout-s --continuation-wait-s
--drain-timeout-s --grpc-port --host --http-idle-timeout-s --http-port --keys-file --log-format --log-level
--max-body-bytes --max-model-len --mesh-secret-file --metrics-host --metrics-port --model-dir --request-timeout-s
--scheduler-address --served-model-name""".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_tiny_checkpoint(path)
    return str(path)


def _load(model_dir, *argv: str, env: dict | None = None) -> RouterConfig:
    return load_config(RouterConfig, "router", "x", ["--model-dir", model_dir, *argv], env or {})


def test_the_router_takes_the_shared_service_options_and_keeps_every_flag_it_had():
    assert issubclass(RouterConfig, ServiceOptions)
    text = build_parser(RouterConfig, "router", "x").format_help()
    for flag in FLAGS:
        assert flag in text
    for f in dataclasses.fields(RouterConfig):
        assert f.metadata.get("help"), f"RouterConfig.{f.name} has no help text"
    host = next(f for f in dataclasses.fields(RouterConfig) if f.name == "host")
    assert "both listeners" in host.metadata["help"]


def test_the_drain_is_drain_timeout_s_else_the_shared_grace_s(model_dir):
    assert _load(model_dir).drain_s == 10.0
    assert _load(model_dir, "--grace-s", "3").drain_s == 3.0
    assert _load(model_dir, "--grace-s", "3", "--drain-timeout-s", "5").drain_s == 5.0
    assert _load(model_dir, env={"WEFT_ROUTER_DRAIN_TIMEOUT_S": "7"}).drain_s == 7.0


@pytest.mark.parametrize("argv", [
    ("--drain-timeout-s", "0"), ("--grpc-port", "70000"), ("--metrics-port", "-1"), ("--grace-s", "-1"),
    ("--max-message-bytes", "0"),
])
def test_bad_router_settings_are_usage_errors(model_dir, argv):
    with pytest.raises(SystemExit):
        _load(model_dir, *argv)

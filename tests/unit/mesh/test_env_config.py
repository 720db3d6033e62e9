from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.mesh.env_config import build_parser, load_config, option, to_argv


@dataclass(frozen=True)
class DemoConfig:
    port: int = option("gRPC port.", default=5000)
    ratio: float | None = option("A ratio.", default=None)
    mode: str = option("Mode.", default="a", choices=("a", "b"))
    verbose: bool = option("Talk more.", default=False)
    nats_url: str = option("NATS.", default="nats://x", shared=True)

    def __post_init__(self) -> None:
        if self.port <= 0:
            raise ValueError("port must be > 0")


def test_flag_beats_env_beats_default():
    env = {"WEFT_DEMO_PORT": "6000", "WEFT_NATS_URL": "nats://y", "WEFT_DEMO_VERBOSE": "yes"}
    assert load_config(DemoConfig, "demo", "d", [], env) == DemoConfig(6000, None, "a", True, "nats://y")
    assert load_config(DemoConfig, "demo", "d", ["--port", "7000", "--no-verbose"], env).port == 7000
    assert load_config(DemoConfig, "demo", "d", ["--no-verbose"], env).verbose is False
    assert load_config(DemoConfig, "demo", "d", [], {}) == DemoConfig()


def test_bad_env_value_is_a_usage_error_naming_the_variable(capsys):
    with pytest.raises(SystemExit) as exit_:
        load_config(DemoConfig, "demo", "d", [], {"WEFT_DEMO_PORT": "many"})
    assert exit_.value.code == 2
    assert "WEFT_DEMO_PORT" in capsys.readouterr().err


def test_validation_error_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        load_config(DemoConfig, "demo", "d", ["--port", "-1"], {})
    assert "port must be > 0" in capsys.readouterr().err


def test_env_choice_is_checked():
    with pytest.raises(SystemExit):
        load_config(DemoConfig, "demo", "d", [], {"WEFT_DEMO_MODE": "z"})


def test_help_explains_every_flag_with_its_env_name_and_default():
    text = build_parser(DemoConfig, "demo", "Demo service.").format_help()
    for flag, env in (("--port", "WEFT_DEMO_PORT"), ("--ratio", "WEFT_DEMO_RATIO"), ("--mode", "WEFT_DEMO_MODE"),
                      ("--verbose", "WEFT_DEMO_VERBOSE"), ("--nats-url", "WEFT_NATS_URL")):
        assert flag in text and env in text
    assert "default: 5000" in text


def test_to_argv_round_trips():
    cfg = DemoConfig(port=1234, ratio=0.5, mode="b", verbose=True)
    assert load_config(DemoConfig, "demo", "d", to_argv(cfg), {}) == cfg

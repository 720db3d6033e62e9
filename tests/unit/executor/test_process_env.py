"""The executor's torch runtime settings reach every way an executor runs."""
from __future__ import annotations

from pathlib import Path

import yaml

from services.executor.process_env import EXECUTOR_ENV, apply_executor_env
from weft.launcher.mesh_spec import SERVICES


def test_apply_sets_what_is_unset_and_keeps_what_an_operator_set():
    env = {"GOMP_SPINCOUNT": "0"}
    apply_executor_env(env)
    assert env["GOMP_SPINCOUNT"] == "0"  # the operator's value wins
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"


def test_a_bounded_spin_comes_with_the_passive_policy():
    # PASSIVE alone makes every parallel region pay a futex wake-up (a decode step ~1.6x
    # slower); libgomp honours GOMP_SPINCOUNT under PASSIVE, so both must be set together.
    assert EXECUTOR_ENV["OMP_WAIT_POLICY"] == "PASSIVE"
    assert int(EXECUTOR_ENV["GOMP_SPINCOUNT"]) > 0


def test_the_launcher_and_compose_start_executors_with_the_same_settings():
    executor = next(s for s in SERVICES if s.name == "executor")
    for key, value in EXECUTOR_ENV.items():
        assert executor.settings[key] == value, key
    with open(Path(__file__).resolve().parents[3] / "compose.yaml") as f:
        compose = yaml.safe_load(f)
    for key, value in EXECUTOR_ENV.items():
        assert compose["services"]["executor"]["environment"][key] == value, key

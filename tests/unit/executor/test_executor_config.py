"""ExecutorConfig declares only the executor's own options: the shared ones come from
ServiceOptions, the engine's from EngineConfig, and the flags a user types stay flat."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from services.executor.config import ExecutorConfig
from services.executor.engine.config import EngineConfig
from services.mesh.env_config import env_name, load_config
from services.mesh.service_options import ServiceOptions


def _own_annotations(cls) -> set[str]:
    return set(cls.__dict__.get("__annotations__", {}))


def test_no_shared_or_engine_option_is_redeclared():
    own = _own_annotations(ExecutorConfig)
    assert not own & {f.name for f in dataclasses.fields(ServiceOptions)}
    assert not own & {f.name for f in dataclasses.fields(EngineConfig)}


def test_every_engine_option_is_a_flat_executor_flag_with_its_env_name_and_default():
    fields = {f.name: f for f in dataclasses.fields(ExecutorConfig)}
    for f in dataclasses.fields(EngineConfig):
        assert f.name in fields
        assert env_name("executor", fields[f.name]) == "WEFT_EXECUTOR_" + f.name.upper()
        assert fields[f.name].default == f.default and f.metadata.get("help")


def test_engine_config_is_built_from_the_flags_and_the_environment(tmp_path):
    cfg = load_config(ExecutorConfig, "executor", "x",
                      ["--model-dir", str(tmp_path), "--max-num-seqs", "3", "--kv-cache-dtype", "int8"],
                      {"WEFT_EXECUTOR_BLOCK_SIZE": "32", "WEFT_EXECUTOR_NUM_KV_BLOCKS": "none"})
    engine = cfg.engine_config
    assert type(engine) is EngineConfig
    assert (engine.max_num_seqs, engine.block_size, engine.kv_cache_dtype, engine.num_kv_blocks) == (3, 32, "int8", None)
    assert engine == EngineConfig(max_num_seqs=3, block_size=32, kv_cache_dtype="int8")
    assert cfg.resolved_serves_rung == "kv_int8"


def test_shared_options_are_validated_by_the_base(tmp_path):
    with pytest.raises(ValueError, match="metrics_port"):
        ExecutorConfig(model_dir=str(tmp_path), metrics_port=70000)
    with pytest.raises(ValueError, match="port must be"):
        ExecutorConfig(model_dir=str(tmp_path), port=-1)
    with pytest.raises(ValueError, match="max_prefill_chunk"):  # the engine's own validation
        ExecutorConfig(model_dir=str(tmp_path), max_prefill_chunk=4096)


def test_reading_the_executor_config_does_not_load_torch():
    code = "import sys, services.executor.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("value", ["nan", "-0.1", "1.5", "inf"])
def test_demote_on_finish_min_held_outside_zero_to_one_is_refused_by_name(tmp_path, capsys, value):
    with pytest.raises(SystemExit):
        load_config(ExecutorConfig, "executor", "x",
                    ["--model-dir", str(tmp_path), "--demote-on-finish-min-held", value], {})
    assert "demote_on_finish_min_held must be in [0, 1]" in capsys.readouterr().err


def test_demote_on_finish_min_held_reads_its_flag_and_variable(tmp_path):
    args = ["--model-dir", str(tmp_path)]
    assert load_config(ExecutorConfig, "executor", "x", args, {}).demote_on_finish_min_held == 0.5
    env = {"WEFT_EXECUTOR_DEMOTE_ON_FINISH_MIN_HELD": "0"}
    assert load_config(ExecutorConfig, "executor", "x", args, env).demote_on_finish_min_held == 0.0

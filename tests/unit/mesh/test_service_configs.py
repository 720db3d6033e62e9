import dataclasses

import pytest

from services.cachestore.config import CacheStoreConfig
from services.executor.config import ExecutorConfig
from services.mesh.env_config import build_parser, load_config
from services.scheduler.config import SchedulerConfig


@pytest.mark.parametrize("cls, service", [
    (ExecutorConfig, "executor"), (SchedulerConfig, "scheduler"), (CacheStoreConfig, "cachestore"),
])
def test_help_explains_every_flag(cls, service):
    text = build_parser(cls, service, "x").format_help()
    for f in dataclasses.fields(cls):
        assert "--" + f.name.replace("_", "-") in text
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_executor_requires_an_existing_model_dir(tmp_path):
    with pytest.raises(SystemExit):
        load_config(ExecutorConfig, "executor", "x", [], {})
    cfg = load_config(ExecutorConfig, "executor", "x", ["--model-dir", str(tmp_path), "--num-kv-blocks", "8"], {})
    assert cfg.engine_config.num_kv_blocks == 8 and cfg.resolved_model_id == tmp_path.name
    with pytest.raises(SystemExit):  # the engine's own validation surfaces as a usage error
        load_config(ExecutorConfig, "executor", "x", ["--model-dir", str(tmp_path), "--block-size", "0"], {})


def test_scheduler_placement_flag_selects_the_policy():
    cfg = load_config(SchedulerConfig, "scheduler", "x", [], {"WEFT_SCHEDULER_PLACEMENT": "least_loaded"})
    assert cfg.placement_policy.value == "least_loaded"
    with pytest.raises(SystemExit):
        load_config(SchedulerConfig, "scheduler", "x", ["--placement", "random"], {})

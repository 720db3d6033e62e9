"""The smaller_model rung through the real mesh (`weft up`): one full-quality executor on
the tiny model and one started on a genuinely smaller checkpoint (one layer instead of
two, same tokenizer) with ``--serves-rung smaller_model`` (``--extra-executor``), the
scheduler's ladder pinned on smaller_model (enter threshold 0). A request whose contract
accepts the rung is served by the smaller model's pool under its own model id and says
so; one whose contract refuses it is served at full quality. (No timing thresholds: the
ladder is pinned by config.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.integration.launched_mesh import launched_mesh
from tests.integration.test_degraded_pools import executors, post
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2

FULL, SMALL = "executor-0", "executor-1"


def one_layer_checkpoint(out: Path) -> Path:
    """The tiny preset's tokenizer with a one-layer model: a smaller sibling checkpoint."""
    make_tiny_checkpoint(out, preset="tiny", seed=1)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = load_file(str(out / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.1.")}
    assert len(kept) < len(weights)
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    small_dir = one_layer_checkpoint(tmp_path_factory.mktemp("models") / "tiny-1layer")
    state_dir = tmp_path_factory.mktemp("smaller-model-pool")
    env = {"WEFT_EXECUTOR_NUM_THREADS": "1", "WEFT_SCHEDULER_DEGRADATION_RUNGS": "none,smaller_model,shed",
           "WEFT_SCHEDULER_DEGRADATION_THRESHOLDS": "smaller_model=0:0"}
    extra = [f"--extra-executor=--model-dir {small_dir} --serves-rung smaller_model"]
    with launched_mesh(state_dir, tiny_model_dir, 1, env, extra, timeout_s=150) as (_, state):
        yield state


def test_the_smaller_executor_announces_its_rung_and_its_own_model(mesh):
    known = executors(mesh)
    assert known[SMALL].heartbeat.serves_rung == common_pb2.DEGRADATION_RUNG_SMALLER_MODEL
    assert known[FULL].heartbeat.serves_rung == common_pb2.DEGRADATION_RUNG_NONE
    assert known[SMALL].heartbeat.model_id == "tiny-1layer" != known[FULL].heartbeat.model_id


def test_a_request_accepting_smaller_model_is_served_by_the_smaller_pool_and_says_so(mesh):
    port = mesh.instance("router").ports["router_http_port"]
    for contract in (None, {"accepted_degrade_steps": ["smaller_model"]}):
        status, headers, body = post(port, contract, prompt="served by the smaller model")
        assert status == 200, body
        assert (headers["x-weft-executor"], headers["x-weft-degradation-rung"]) == (SMALL, "smaller_model")
        assert body["usage"]["completion_tokens"] == 3


def test_a_request_refusing_smaller_model_is_served_at_full_quality(mesh):
    port = mesh.instance("router").ports["router_http_port"]
    status, headers, body = post(port, {"accepted_degrade_steps": ["none"]}, prompt="full quality only")
    assert status == 200, body
    assert (headers["x-weft-executor"], headers["x-weft-degradation-rung"]) == (FULL, "none")

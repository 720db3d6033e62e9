"""The executor bounds torch's per-shape CPU kernel caches, so serving batches of ever
different sizes does not grow its memory (services/mesh/onednn_caches.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.mesh.onednn_caches import CACHE_VARIABLES, DEFAULT_CAPACITY, bound_onednn_caches
from weft.testing.tiny_model import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[3]


def test_both_capacities_are_set_unless_the_operator_set_them():
    env = {}
    bound_onednn_caches(env)
    assert env == {name: str(DEFAULT_CAPACITY) for name in CACHE_VARIABLES}
    env = {"LRU_CACHE_CAPACITY": "512"}
    bound_onednn_caches(env)
    assert env["LRU_CACHE_CAPACITY"] == "512" and env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(DEFAULT_CAPACITY)


def test_the_executor_entry_point_bounds_them_before_torch_loads():
    out = subprocess.run(
        [sys.executable, "-c", "import os, sys; import services.executor.__main__ as m; "
         "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(DEFAULT_CAPACITY)] * 2


# Random batch sizes and prompt lengths: every step a new matmul shape. With torch's
# default capacities this grew RSS by ~150 MiB over the measured 1,200 requests.
_ENGINE_RUN = textwrap.dedent("""
    import random, sys
    from services.mesh.onednn_caches import bound_onednn_caches
    bound_onednn_caches()
    import psutil, torch
    from services.executor.engine.engine import LLMEngine
    from services.executor.engine.config import EngineConfig
    from services.executor.engine.sampling_params import SamplingParams
    torch.set_num_threads(1)
    engine = LLMEngine(sys.argv[1], EngineConfig(num_kv_blocks=512))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rng, num_requests, rss = random.Random(0), 0, []
    for checkpoint in (400, 1600):
        while num_requests < checkpoint:
            for _ in range(rng.randrange(4, 16)):
                prompt = [rng.randrange(1024) for _ in range(rng.randrange(20, 60))]
                engine.add_request(f"r{num_requests}", prompt, params)
                num_requests += 1
            while engine.has_unfinished_requests:
                engine.step()
        rss.append(psutil.Process().memory_info().rss)
    print((rss[1] - rss[0]) / 2**20)
""")


@pytest.mark.slow
def test_engine_memory_stays_flat_over_many_batch_shapes(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", preset="tiny", arch="llama")
    out = subprocess.run([sys.executable, "-c", _ENGINE_RUN, str(checkpoint)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    growth_mib = float(out.stdout.split()[-1])
    assert growth_mib < 32, f"RSS grew {growth_mib:.0f} MiB over 1,200 requests"

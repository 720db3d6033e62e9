"""The unlucky operator sizes the KV pool too small (issue 15): an executor started with a
tight --num-kv-blocks must preempt requests that asked for prompt logprobs (and top
logprobs), and still answer exactly what a roomy executor answers: the same tokens, the
same logprobs, and the prompt logprobs once, not recomputed into something else or sent
twice after the preempted request's prompt is prefilled again.

Four greedy requests of 24-token prompts (2 blocks of 16) each grow to 24 + 56 = 80 tokens
(5 blocks); twelve blocks hold all four prompts but not their growth, so the tight
executor must preempt; the roomy one (1024 blocks) never does.
"""
from __future__ import annotations

import random
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.integration.conftest import nats_server  # noqa: F401  (a fixture)
from tests.integration.conftest import free_port, processes  # noqa: F401  (a fixture)
from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc

ATOL = 1e-4  # the same fp32 model; batch composition differs between the two runs
NUM_REQUESTS = 4


def _prompts() -> list[list[int]]:
    rng = random.Random(15)
    return [[rng.randrange(10, 1000) for _ in range(24)] for _ in range(NUM_REQUESTS)]


def _generate(address: str, i: int, prompt: list[int]) -> dict:
    sampling = common_pb2.SamplingParams(max_tokens=56, temperature=0.0, ignore_eos=True, logprobs=True,
                                         top_logprobs=2, prompt_logprobs=2)
    got = {"tokens": [], "logprobs": [], "top": [], "prompt": [], "prompt_top": [], "prompt_chunks": 0}
    with grpc.insecure_channel(address) as channel:
        stream = executor_pb2_grpc.ExecutorStub(channel).Generate(executor_pb2.ExecuteRequest(
            request_id=f"pressure-{i}", prompt_token_ids=prompt, sampling=sampling), timeout=300)
        for chunk in stream:
            got["tokens"] += chunk.token_ids_delta
            got["logprobs"] += chunk.logprobs_delta
            got["top"] += [list(t.token_ids) for t in chunk.top_logprobs_delta]
            if chunk.prompt_logprobs or chunk.prompt_top_logprobs:
                got["prompt_chunks"] += 1
                got["prompt"] = list(chunk.prompt_logprobs)
                got["prompt_top"] = [(list(t.token_ids), list(t.logprobs)) for t in chunk.prompt_top_logprobs]
            finish = chunk.finish_reason
    got["finish"] = finish
    return got


def _run(address: str) -> list[dict]:
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:  # concurrent, so they share (and fight over) the pool
        return list(pool.map(lambda ip: _generate(address, *ip), enumerate(_prompts())))


def _preemptions(metrics_port: int, executor: str) -> float:
    """The executor's own count of preemptions (``weft_kv_preemptions_total``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(r'^weft_kv_preemptions_total\{executor="%s"\} (\S+)$' % re.escape(executor), text, re.M)
    return float(found.group(1)) if found else 0.0


def test_prompt_logprobs_under_kv_pressure_equal_an_unpressured_run(processes, nats_server, tiny_model_dir):
    common = ["--nats-url", nats_server.url, "--model-dir", str(tiny_model_dir), "--block-size", "16",
              "--num-threads", "1", "--heartbeat-interval-s", "0.25"]
    ports = {"roomy": free_port(), "tight": free_port()}
    roomy = processes.start("executor", *common, "--num-kv-blocks", "1024", "--name", "roomy",
                            "--metrics-port", str(ports["roomy"]), name="roomy", timeout_s=90)
    tight = processes.start("executor", *common, "--num-kv-blocks", "12", "--name", "tight",
                            "--metrics-port", str(ports["tight"]), name="tight", timeout_s=90)
    expected, pressured = _run(roomy.address), _run(tight.address)
    assert _preemptions(ports["roomy"], "roomy") == 0
    assert _preemptions(ports["tight"], "tight") > 0, "the tight pool never preempted: the test proves nothing"
    for want, got in zip(expected, pressured):
        assert got["finish"] == want["finish"] == common_pb2.FINISH_REASON_LENGTH
        assert got["prompt_chunks"] == want["prompt_chunks"] == 1, "prompt logprobs not sent exactly once"
        assert got["tokens"] == want["tokens"]
        assert got["top"] == want["top"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=ATOL)
        assert len(got["prompt"]) == len(want["prompt"]) == 23
        assert got["prompt"] == pytest.approx(want["prompt"], abs=ATOL)
        assert [ids for ids, _ in got["prompt_top"]] == [ids for ids, _ in want["prompt_top"]]
        for (_, lp_got), (_, lp_want) in zip(got["prompt_top"], want["prompt_top"]):
            assert lp_got == pytest.approx(lp_want, abs=ATOL)

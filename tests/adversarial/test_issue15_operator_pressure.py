"""The unlucky operator sizes the KV pool too small (issue 15): an executor started with a
tight --num-kv-blocks must preempt requests that asked for prompt logprobs (and top
logprobs), and still answer exactly what a roomy executor answers: the same tokens, the
same logprobs, and the prompt logprobs once, not recomputed into something else or sent
twice after the preempted request's prompt is prefilled again.

Four greedy requests of 24-token prompts (2 blocks of 16) each grow to 24 + 56 = 80 tokens
(5 blocks); twelve blocks hold all four prompts but not their growth, so the tight
executor must preempt; the roomy one (1024 blocks) never does.

Preemption needs three of the four decoding at once, so they must reach the engine together,
not by luck: four threads with a channel each once ran one after another on a loaded CI box
(a request takes ~25 ms) and nothing was preempted. So the executor is stopped (SIGSTOP)
while the four calls go out on one connection, each seen in the kernel's receive queue of
the stopped executor's end before the next is sent, and only then resumed (SIGCONT): it
reads all four at once, and its engine admits them within a few steps of each other. That
is enough: the prompts' 8 blocks leave room for all four, which then outgrow the pool
together; three admitted at once always preempt, and four admitted at even intervals still
do up to 14 steps apart (the engine driven step by step in-process). The freeze lasts
milliseconds, and no scheduler watches these executors' heartbeats anyway.
"""
from __future__ import annotations

import os
import random
import re
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.integration.conftest import nats_server  # noqa: F401  (a fixture)
from tests.integration.conftest import ServiceProcess, free_port, processes, wait_for  # noqa: F401  (a fixture)
from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc

ATOL = 1e-4  # the same fp32 model; batch composition differs between the two runs
NUM_REQUESTS = 4


def _prompts() -> list[list[int]]:
    rng = random.Random(15)
    return [[rng.randrange(10, 1000) for _ in range(24)] for _ in range(NUM_REQUESTS)]


def _request(i: int, prompt: list[int]) -> executor_pb2.ExecuteRequest:
    sampling = common_pb2.SamplingParams(max_tokens=56, temperature=0.0, ignore_eos=True, logprobs=True,
                                         top_logprobs=2, prompt_logprobs=2)
    return executor_pb2.ExecuteRequest(request_id=f"pressure-{i}", prompt_token_ids=prompt, sampling=sampling)


def _collect(stream) -> dict:
    got = {"tokens": [], "logprobs": [], "top": [], "prompt": [], "prompt_top": [], "prompt_chunks": 0}
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


def _unread_bytes(port: int) -> list[int]:
    """The receive queue (bytes not yet read) of each established connection whose server
    end is ``port``, from the kernel's socket tables: what a stopped server has been sent."""
    queues = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
        for _, local, _, state, tx_rx, *_ in rows:
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:  # 01: ESTABLISHED
                queues.append(int(tx_rx.split(":")[1], 16))
    return queues


def _run(executor: ServiceProcess) -> list[dict]:
    """The four requests, all sent to the executor before it reads any (the module's docstring)."""
    port, pid = executor.port, executor.process.pid
    with grpc.insecure_channel(executor.address) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = executor_pb2_grpc.ExecutorStub(channel)
        # The connection's setup frames read: from here on its receive queue grows only by the calls.
        wait_for(lambda: _unread_bytes(port) == [0], 30, "one idle connection to the executor")
        os.kill(pid, signal.SIGSTOP)
        try:
            streams = []
            for i, prompt in enumerate(_prompts()):
                unread = sum(_unread_bytes(port))
                streams.append(stub.Generate(_request(i, prompt), timeout=300))
                wait_for(lambda unread=unread: sum(_unread_bytes(port)) > unread, 10,
                         f"request {i} to reach the stopped executor", interval_s=0.001)
        finally:
            os.kill(pid, signal.SIGCONT)
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:  # read at once: they share (and fight over) the pool
            return list(pool.map(_collect, streams))


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
    expected, pressured = _run(roomy), _run(tight)
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

"""The unlucky operator serves a checkpoint whose chat template knows nothing of tools
(issue 15). Before: a request with tools was rendered without them (the template ignores
the variable), sent on, and answered as if the model had seen them; a forced call was
the grammar's guess at functions the model was never shown. Now both doors refuse it at
once: HTTP 400 with ``param: tools``, gRPC INVALID_ARGUMENT naming ``tools``. The router
runs alone (its scheduler address leads nowhere): the refusal needs no downstream."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import grpc
import httpx
import pytest

from tests.integration.conftest import free_port, wait_for
from tests.integration.launched_mesh import ROOT
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

PLAIN_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + "
                "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def router(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("no-tool-template")
    model = root / "plain-chatml"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = PLAIN_CHATML
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    http_port, grpc_port = free_port(), free_port()
    log = open(root / "router.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.router", "--host", "127.0.0.1", "--model-dir", str(model),
         "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(free_port()),
         "--scheduler-address", f"127.0.0.1:{free_port()}"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{http_port}"

        def up() -> bool:
            assert process.poll() is None, (root / "router.log").read_text()[-3000:]
            return httpx.get(f"{url}/health", timeout=2).status_code == 200

        wait_for(up, 90, "the router's /health")
        yield url, f"127.0.0.1:{grpc_port}"
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tools_for_a_template_without_tool_support_are_400_naming_tools(router, tool_choice):
    url, _ = router
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "plain-chatml", "max_tokens": 4, "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": [TOOL], "tool_choice": tool_choice})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tools", reply.text
    assert "no tool support" in reply.json()["error"]["message"], reply.text


def test_tools_for_a_template_without_tool_support_are_invalid_argument_over_grpc(router):
    _, address = router
    request = router_pb2.GenerateRequest(
        chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="weather in Paris?")]),
        tools=[router_pb2.ToolDefinition(name="get_weather", parameters_json=json.dumps(TOOL["function"]["parameters"]))],
        sampling=common_pb2.SamplingParams(max_tokens=4))
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "tools" in err.value.details() and "no tool support" in err.value.details(), err.value.details()

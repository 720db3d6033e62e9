"""The unlucky operator: one request whose prompt trips an engine bug (injected by
``poison_site/sitecustomize.py`` into every executor of a real `weft up`). The engine of
the executor running it dies, the executor exits for a restart, and the scheduler moved
the request on: to the next executor, whose engine died too, and the router resent it,
again and again. One request killed 6 engines in 15 s and left every executor 3 deaths
from a crash loop, where the supervisor stops restarting and the mesh is down for good.
Now a request aboard ``max_engine_failures`` (2) engine deaths ends with ABORTED, its id
is refused on a resend, and the mesh serves again."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh
from weft.launcher.mesh_state import read_state
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

SITE = Path(__file__).resolve().parent / "poison_site"
POISON = [1001, 1002, 1003, 5, 6]
ENV = {"WEFT_EXECUTOR_NUM_THREADS": "1", "WEFT_EXECUTOR_HEARTBEAT_INTERVAL_S": "0.25",
       "WEFT_TEST_POISON": "1", "PYTHONPATH": str(SITE)}
MAX_ENGINE_FAILURES = 2  # services/scheduler/migration.py MigrationPolicy default


def _generate(address: str, ids: list[int]):
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                         sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0))
    with grpc.insecure_channel(address) as channel:
        return list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120))


def _deaths(state_dir) -> int:
    state = read_state(state_dir)
    return sum(i.restarts + (i.status == "restarting") for i in state.by_service("executor"))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("poison-mesh")
    with launched_mesh(state_dir, tiny_model_dir, 2, ENV) as (process, state):
        yield state_dir, state


def test_a_poison_request_kills_at_most_two_engines_and_the_mesh_serves_again(mesh):
    state_dir, state = mesh
    assert _generate(state.grpc_address, [20, 21, 22])[-1].finish_reason
    with pytest.raises(grpc.RpcError) as err:
        _generate(state.grpc_address, POISON)
    wait_for(lambda: all(i.status == "running" for i in read_state(state_dir).by_service("executor")), 60,
             "both executors restarted")
    assert _deaths(state_dir) <= MAX_ENGINE_FAILURES, [(i.name, i.restarts, i.last_exit, i.status)
                                                       for i in read_state(state_dir).by_service("executor")]
    assert err.value.code() is grpc.StatusCode.ABORTED or "not retried" in (err.value.details() or ""), \
        err.value.details()

    def serves():
        try:
            return bool(_generate(state.grpc_address, [20, 21, 22])[-1].finish_reason)
        except grpc.RpcError:
            return False

    wait_for(serves, 60, "the mesh to serve after the poison request")

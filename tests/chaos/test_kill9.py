"""Plain `kill -9` per service under load (issue 12, "Done means"): no `weft chaos`, the
pid comes from the state file and the launcher learns of the death as it would of a crash.

For each of cachestore, scheduler, executor-1, router and NATS in turn, while NUM_STREAMS
greedy streams run:
  * every stream ends exactly once (under_load): complete with its undisturbed tokens, or
    a clean gRPC error; never a hang (each call has a deadline), never two ends;
  * only the router's death may end a stream with an error (the clients' connections are
    to it); after it, new requests succeed once it is back;
  * the killed service is back under a new pid, healthy, and the mesh serves as before.

Recovery (kill until the new process passes its health probe) is printed as a table and
appended to ``$WEFT_CHAOS_RESULTS`` when set; benchmarks/chaos_recovery.py measures the
same without load, median of 3.
"""
from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest

from tests.chaos.chaos_mesh import CHAOS_ENV, NUM_STREAMS, Mesh, Outcome, generate, record, under_load
from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh
from weft.launcher.chaos import wait_recovered

MAX_TOKENS = 200  # shorter than the other chaos tests': five rounds stay bounded on two cores
RECOVERY_DEADLINE_S = 60.0  # a bound, not a threshold: a cold Python service start on busy cores
CLEAN_ERRORS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
VICTIMS = ["cachestore", "scheduler", "executor-1", "router", "nats"]
RECOVERY_S: dict[str, float] = {}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("kill9-mesh")
    with launched_mesh(state_dir, tiny_model_dir, 2, CHAOS_ENV, check_orphans=False) as (process, _):
        m = Mesh(state_dir, process)
        for i in range(NUM_STREAMS):  # the undisturbed greedy outputs
            o = generate(m, i, Outcome(), max_tokens=MAX_TOKENS)
            assert o.completed and len(o.tokens) == MAX_TOKENS, o
            m.reference[i] = o.tokens
        yield m
    if RECOVERY_S:
        print("\n| service | kill -9 until healthy again (s) |\n|---|---|")
        for name, seconds in RECOVERY_S.items():
            print(f"| {name} | {seconds:.2f} |")


def _serves_as_before(mesh: Mesh) -> bool:
    o = generate(mesh, 0, Outcome(), max_tokens=MAX_TOKENS)
    return o.completed and o.tokens == mesh.reference[0]


@pytest.mark.parametrize("name", VICTIMS)
def test_kill9_under_load_every_stream_ends_once_and_the_service_comes_back(mesh, name):
    old_pid = mesh.state.instance(name).pid
    recovered: dict[str, object] = {}

    def watch():
        try:
            recovered["s"] = wait_recovered(mesh.state_dir, name, old_pid, RECOVERY_DEADLINE_S)
        except TimeoutError as exc:
            recovered["error"] = exc

    watcher = threading.Thread(target=watch, daemon=True)

    def disturb(_outcomes):
        os.kill(old_pid, signal.SIGKILL)
        watcher.start()

    outcomes = under_load(mesh, disturb, max_tokens=MAX_TOKENS)  # asserts: no hang, one end each
    for i, o in enumerate(outcomes):
        if o.completed:
            assert o.tokens == mesh.reference[i], f"stream {i} differs from its undisturbed run"
        else:
            assert name == "router", f"stream {i} ended with {o.error} though only {name} died"
            assert o.error in CLEAN_ERRORS, f"stream {i}: {o.error}"
    watcher.join(RECOVERY_DEADLINE_S + 5)
    assert "s" in recovered, recovered.get("error", "recovery watcher did not finish")
    assert mesh.process.poll() is None, "the launcher stopped the mesh"
    assert mesh.state.instance(name).pid != old_pid
    wait_for(lambda: mesh.serving_executors() == {"executor-0", "executor-1"}, 30, "both executors serving")
    wait_for(lambda: _serves_as_before(mesh), 30, "the mesh to serve as before")
    RECOVERY_S[name] = recovered["s"]
    record(service=name, action="kill -9", num_streams=NUM_STREAMS,
           num_failed=sum(1 for o in outcomes if not o.completed), recovery_s=round(recovered["s"], 2))

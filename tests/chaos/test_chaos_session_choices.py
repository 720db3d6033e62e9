"""A session hop's ``n > 1`` (docs/sessions.md, "Several completions of one hop";
services/router/session_branches.py) while an executor dies for real: a `weft up` mesh with
two executors, a session at hop 0, then a stateful hop 1 with n = 3 (greedy, streaming over
gRPC with a deadline); once every choice has tokens flowing, the executor serving choice 0
is killed with SIGKILL and the launcher restarts it.

Asserted:
  * every choice ends exactly once: finished normally (the scheduler migrates a lost
    executor's streams), or, for i >= 1 only, finish_reason ERROR with a ChoiceError; or the
    whole call fails with a clean gRPC status;
  * a choice that finished normally equals the undisturbed run token for token (greedy
    migration is exact: tests/chaos/test_chaos.py);
  * the call succeeded: the session and every finished branch serve a stateful hop 2, and
    every failed branch was ended (EndSession finds it already ended);
  * the call failed: once the executor is back, hop 1 with n = 3 asked again succeeds (no
    409 / ALREADY_EXISTS naming a branch left by the failed call).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from tests.chaos.chaos_mesh import CALL_TIMEOUT_S, CHAOS_ENV, Mesh
from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh
from weft.launcher.chaos import wait_recovered
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

N = 3
MAX_TOKENS = 300  # long enough that the kill lands mid-stream on every choice
HOP0_PROMPT = [(11 * j + 5) % 500 + 20 for j in range(24)]
HOP1_NEW = [(3 * j + 101) % 500 + 20 for j in range(8)]  # a stateful hop: its new tokens only
HOP2_NEW = [42, 43, 44]
RECOVERY_DEADLINE_S = 60.0  # a bound, not a threshold: a cold executor start on busy cores
CLEAN_ERRORS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.ABORTED)
ERROR = common_pb2.FINISH_REASON_ERROR


@dataclass
class Choice:
    tokens: list[int] = field(default_factory=list)
    session_id: str = ""
    executors: list[str] = field(default_factory=list)
    finish_reasons: list[int] = field(default_factory=list)
    error: router_pb2.ChoiceError | None = None
    num_migrations: int = 0

    @property
    def finished(self) -> bool:  # its hop finished (not an "error" end)
        return len(self.finish_reasons) == 1 and self.finish_reasons[0] != ERROR


@dataclass
class Hop:
    choices: dict[int, Choice] = field(default_factory=dict)
    status: grpc.StatusCode | None = None  # the call failed with it
    details: str = ""


def run_hop(mesh: Mesh, session_id: str, hop_index: int, prompt: list[int], n: int, stateful: bool,
            max_tokens: int = MAX_TOKENS, on_chunk=None) -> Hop:
    request = router_pb2.GenerateRequest(
        request_id=f"sc-{session_id}-{hop_index}-{time.monotonic_ns()}", token_ids=router_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n),
        session=common_pb2.SessionInfo(session_id=session_id, hop_index=hop_index, stateful=stateful,
                                       request_class=common_pb2.REQUEST_CLASS_AGENTIC))
    hop = Hop()
    try:
        with grpc.insecure_channel(mesh.state.grpc_address) as channel:
            for chunk in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=CALL_TIMEOUT_S):
                c = hop.choices.setdefault(chunk.index, Choice())
                c.tokens.extend(chunk.token_ids_delta)
                c.session_id = c.session_id or chunk.session_id
                if chunk.executor and chunk.executor not in c.executors:
                    c.executors.append(chunk.executor)
                if chunk.finish_reason:
                    c.finish_reasons.append(chunk.finish_reason)
                    c.num_migrations = chunk.num_migrations
                    if chunk.HasField("error"):
                        c.error = chunk.error
                if on_chunk is not None:
                    on_chunk(hop)
    except grpc.RpcError as exc:
        hop.status, hop.details = exc.code(), exc.details() or ""
    return hop


def end_session(mesh: Mesh, session_id: str) -> router_pb2.EndSessionResponse:
    with grpc.insecure_channel(mesh.state.grpc_address) as channel:
        return router_pb2_grpc.RouterStub(channel).EndSession(
            router_pb2.EndSessionRequest(session_id=session_id), timeout=CALL_TIMEOUT_S)


def served(hop: Hop, n: int) -> bool:
    return hop.status is None and sorted(hop.choices) == list(range(n)) and all(
        c.finished for c in hop.choices.values())


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("chaos-session-choices")
    with launched_mesh(state_dir, tiny_model_dir, 2, CHAOS_ENV, check_orphans=False) as (process, _):
        yield Mesh(state_dir, process)


@pytest.fixture(scope="module")
def reference(mesh) -> dict[int, list[int]]:
    """Each choice's tokens on an undisturbed run of the same hops."""
    sid = f"ref-{time.monotonic_ns()}"
    assert served(run_hop(mesh, sid, 0, HOP0_PROMPT, 1, False, max_tokens=4), 1)
    hop1 = run_hop(mesh, sid, 1, HOP1_NEW, N, True)
    assert served(hop1, N), hop1
    assert [c.session_id for _, c in sorted(hop1.choices.items())] == [sid] + [f"{sid}.h1.n{i}" for i in range(1, N)]
    assert all(len(c.tokens) == MAX_TOKENS for c in hop1.choices.values())
    return {i: c.tokens for i, c in hop1.choices.items()}


@pytest.mark.parametrize("other", ["serving", "paused"])
def test_executor_killed_mid_hop_every_choice_ends_once_and_the_session_goes_on(mesh, reference, other):
    """``other``: the executor not killed serves on (the streams migrate to it), or is
    paused at the kill (SIGSTOP, resumed after the call): nowhere to migrate but the
    killed executor's restart."""
    sid = f"chaos-choices-{time.monotonic_ns()}"
    assert served(run_hop(mesh, sid, 0, HOP0_PROMPT, 1, False, max_tokens=4), 1)
    killed: dict[str, object] = {}
    recovered: dict[str, object] = {}

    def watch(name: str, pid: int) -> None:
        try:
            recovered["s"] = wait_recovered(mesh.state_dir, name, pid, RECOVERY_DEADLINE_S)
        except TimeoutError as exc:
            recovered["error"] = exc

    def kill_when_all_stream(hop: Hop) -> None:
        """SIGKILL the executor serving choice 0 once every choice has tokens flowing."""
        if killed or len(hop.choices) < N or any(len(c.tokens) < 5 for c in hop.choices.values()):
            return
        victim = hop.choices[0].executors[-1]
        pid = mesh.state.instance(victim).pid
        if other == "paused":
            killed["paused"] = ({"executor-0", "executor-1"} - {victim}).pop()
            mesh.chaos_now("pause", killed["paused"])
        killed.update(name=victim, pid=pid, at={i: len(c.tokens) for i, c in hop.choices.items()},
                      on={i: list(c.executors) for i, c in hop.choices.items()})
        os.kill(pid, signal.SIGKILL)
        killed["watcher"] = threading.Thread(target=watch, args=(victim, pid), daemon=True)
        killed["watcher"].start()

    try:
        hop1 = run_hop(mesh, sid, 1, HOP1_NEW, N, True, on_chunk=kill_when_all_stream)
    finally:  # the call has ended: a paused executor must not poison what follows
        if "paused" in killed:
            mesh.chaos_now("resume", killed["paused"])
    assert killed, f"the hop ended before every choice streamed: {hop1}"
    assert all(n < MAX_TOKENS for n in killed["at"].values()), killed  # the kill landed mid-stream
    report = f"killed {killed['name']} at {killed['at']} (choices on {killed['on']}); hop 1: {hop1}"

    # Every choice ends exactly once: a finish (normal or "error"), or the call's status.
    for i, c in hop1.choices.items():
        assert len(c.finish_reasons) <= 1, f"choice {i} ended {len(c.finish_reasons)} times; {report}"
        if c.finish_reasons and c.finish_reasons[0] == ERROR:
            assert i >= 1, f"choice 0 ended 'error' instead of failing the call; {report}"
            assert c.error is not None and c.error.code and c.error.message, f"choice {i}: no ChoiceError; {report}"
        else:
            assert c.error is None, f"choice {i}: a ChoiceError on a normal finish; {report}"
        if c.finished:  # greedy migration is exact
            assert c.tokens == reference[i], f"choice {i} differs from its undisturbed run; {report}"
    if hop1.status is None:
        assert sorted(hop1.choices) == list(range(N)), report
        assert all(c.finish_reasons for c in hop1.choices.values()), f"a choice never ended; {report}"
        assert hop1.choices[0].finished, report
    else:
        assert hop1.status in CLEAN_ERRORS, report

    killed["watcher"].join(RECOVERY_DEADLINE_S + 5)
    assert "s" in recovered, recovered.get("error", "recovery watcher did not finish")
    assert mesh.process.poll() is None, "the launcher stopped the mesh"
    wait_for(lambda: mesh.serving_executors() == {"executor-0", "executor-1"}, 30, "both executors serving")

    if hop1.status is None:
        # The session moved on from choice 0; each finished branch is at hop 2 too, and each
        # failed branch was ended by the router before the call completed.
        for i, c in sorted(hop1.choices.items()):
            if c.finished:
                hop2 = run_hop(mesh, c.session_id, 2, HOP2_NEW, 1, True, max_tokens=4)
                assert served(hop2, 1), f"stateful hop 2 on choice {i}'s {c.session_id}: {hop2}; {report}"
            else:
                ended = end_session(mesh, c.session_id)
                assert not ended.ended_now, f"failed branch {c.session_id} was left behind; {report}"
    else:
        # The session did not move, and no branch of the failed call is left (the router
        # ended each, finished or not, before the call completed): the same hop asked
        # again is served, not 409 / ALREADY_EXISTS naming a branch.
        for i in range(1, N):
            branch = f"{sid}.h1.n{i}"
            assert not end_session(mesh, branch).ended_now, f"branch {branch} was left behind; {report}"
        again = run_hop(mesh, sid, 1, HOP1_NEW, N, True)
        assert served(again, N), f"hop 1 asked again: {again}; {report}"
        assert {i: c.tokens for i, c in again.choices.items()} == reference, report

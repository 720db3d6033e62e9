"""Attacks on the transport floor (benchmarks/grpc_floor.py): a relay whose upstream is
unreachable, a chain whose hop cannot start, and stop() called twice or after a hop died.
Every wait is a gRPC call with a deadline or a process wait with a timeout."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import grpc
import pytest

from benchmarks import grpc_floor
from benchmarks.grpc_floor import ROOT, FloorChain, FloorClient

DEADLINE_S = 30.0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_hop(*extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.grpc_floor", "serve", *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line
    return proc, f"127.0.0.1:{int(line.split()[1])}"


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=DEADLINE_S)
    proc.stdout.close()


def test_a_relay_whose_upstream_is_unreachable_fails_each_call_and_lives_on():
    relay, address = _start_hop("--upstream", f"127.0.0.1:{_closed_port()}")
    try:
        async def main():
            client = FloorClient(address)
            codes = []
            try:
                for _ in range(3):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.run(4, DEADLINE_S)
                    codes.append(err.value.code())
            finally:
                await client.close()
            return codes

        codes = asyncio.run(asyncio.wait_for(main(), DEADLINE_S * 4))
        # an error from the relay, not the client's own deadline running out on a hung call
        assert all(c not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED) for c in codes), codes
        assert relay.poll() is None  # the relay survived every failed call
    finally:
        _end(relay)


def test_a_relay_in_front_of_a_leaf_that_died_fails_calls_and_lives_on():
    leaf, leaf_address = _start_hop()
    relay, address = _start_hop("--upstream", leaf_address)
    try:
        async def main():
            client = FloorClient(address)
            try:
                _, _, total = await client.run(3, DEADLINE_S)
                assert total == 3
                _end(leaf)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.run(3, DEADLINE_S)
                return err.value.code()
            finally:
                await client.close()

        code = asyncio.run(asyncio.wait_for(main(), DEADLINE_S * 3))
        assert code is not grpc.StatusCode.DEADLINE_EXCEEDED
        assert relay.poll() is None
    finally:
        _end(relay)
        if leaf.poll() is None:
            _end(leaf)


class _RecordingPopen(subprocess.Popen):
    """Starts the chain's hops; the ``fail_at``-th one (0-based) is ``broken`` instead."""

    started: list[subprocess.Popen] = []
    fail_at = 1
    broken = ("-c", "print('boom', flush=True)")

    def __init__(self, argv, *args, **kwargs):
        if len(_RecordingPopen.started) == _RecordingPopen.fail_at:
            argv = [sys.executable, *_RecordingPopen.broken]
        super().__init__(argv, *args, **kwargs)
        _RecordingPopen.started.append(self)


@pytest.mark.parametrize("fail_at", [0, 1, 2])
@pytest.mark.parametrize("broken", [("-c", "print('boom', flush=True)"), ("-c", "import sys; sys.exit(3)"),
                                    ("-c", "print('PORT notanumber', flush=True)")])
def test_a_hop_that_cannot_start_fails_the_chain_and_leaves_no_process(monkeypatch, fail_at, broken):
    monkeypatch.setattr(_RecordingPopen, "started", [])
    monkeypatch.setattr(_RecordingPopen, "fail_at", fail_at)
    monkeypatch.setattr(_RecordingPopen, "broken", broken)
    monkeypatch.setattr(grpc_floor.subprocess, "Popen", _RecordingPopen)
    with pytest.raises((RuntimeError, ValueError)):
        FloorChain(3)
    started = _RecordingPopen.started
    assert len(started) == fail_at + 1  # nothing started after the broken hop
    for proc in started:
        assert proc.poll() is not None  # killed and reaped by the chain's own cleanup
        proc.stdout.close()


def test_a_missing_interpreter_fails_the_chain_cleanly(monkeypatch):
    monkeypatch.setattr(grpc_floor.sys, "executable", "/nonexistent/python")
    with pytest.raises(FileNotFoundError):
        FloorChain(2)


def test_stop_twice_and_stop_after_a_hop_died_are_harmless():
    chain = FloorChain(2)
    procs = list(chain.procs)
    procs[0].kill()
    procs[0].wait(timeout=DEADLINE_S)  # the leaf dies on its own before stop()
    chain.stop()
    assert all(p.poll() is not None for p in procs) and chain.procs == []
    chain.stop()  # a second stop: nothing left to do, nothing raised
    assert chain.procs == []
    for p in procs:
        p.stdout.close()


def test_a_hop_that_never_says_its_port_fails_the_chain_at_its_timeout(monkeypatch, tmp_path):
    """A hop that hangs before listening (here: a script that waits on stdin) is not waited
    for forever: the chain raises at its start timeout and ends the hop."""
    import subprocess
    import sys

    from benchmarks import grpc_floor

    started = []
    real_popen = subprocess.Popen

    def silent_hop(argv, **kwargs):
        proc = real_popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                          stdout=kwargs["stdout"], text=True)
        started.append(proc)
        return proc

    monkeypatch.setattr(grpc_floor.subprocess, "Popen", silent_hop)
    with pytest.raises(RuntimeError, match="did not start within"):
        grpc_floor.FloorChain(1, start_timeout_s=0.2)
    assert started and all(p.poll() is not None for p in started)

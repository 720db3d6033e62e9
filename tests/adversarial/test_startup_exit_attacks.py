"""Hostile-client / unlucky-operator attacks on two changes (the third, the cachestore's
plain-torch MiniLM, is attacked in test_minilm_attacks.py):

* fef4a1a: ``run_service`` ends a service with ``os._exit(0)`` after flushing;
* 79d3731: xgrammar imported on a daemon thread after the executor is ready, or on the
  first constrained request.

No sleeps as synchronisation: every wait polls a condition with a bound."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- helpers


def _run_script(code: str, timeout: float = 120, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (nothing imported yet); its last stdout line is JSON."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"status {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from weft.testing.tiny_model import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama"))


# ---------------------------------------------------------------- 3. lazy xgrammar


def test_constrained_requests_racing_the_warm_up_import_equal_the_ones_after_it(tiny_checkpoint):
    """The first constrained requests reach a fresh engine while the warm-up thread is
    importing xgrammar and other threads import the grammar package too: none fails, and
    each output equals the same request's output once the import is long done."""
    out = _run_script(f"""
        import importlib, json, sys, threading
        from services.executor.engine.config import EngineConfig
        from services.executor.engine.engine import LLMEngine
        from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
        from services.executor.app import warm_grammar_import
        assert "services.executor.grammar" not in sys.modules and "xgrammar" not in sys.modules

        engine = LLMEngine({str(tiny_checkpoint)!r}, EngineConfig(num_kv_blocks=64, num_threads=1))
        import torch
        threads_before = torch.get_num_threads()
        SPECS = {{
            "regex": GrammarSpec("regex", "[0-9]{{3}}-[a-z]{{1,3}}"),
            "schema": GrammarSpec("json_schema", json.dumps({{"type": "object", "properties": {{
                "a": {{"enum": [1, 22]}}, "b": {{"enum": ["x", "y"]}}}},
                "required": ["a", "b"], "additionalProperties": False}})),
            "ebnf": GrammarSpec("ebnf", 'root ::= "yes" | "no"'),
            "object": GrammarSpec("json_object"),
        }}

        def run(tag):
            for i, (name, spec) in enumerate(SPECS.items()):
                engine.add_request(f"{{tag}}-{{name}}", [5 + i, 6, 7, 8],
                                   SamplingParams(temperature=0.0, max_tokens=64, grammar=spec))
            toks = {{f"{{tag}}-{{n}}": [] for n in SPECS}}
            for _ in range(400):
                if not engine.has_unfinished_requests:
                    break
                for o in engine.step():
                    toks[o.request_id].extend(o.new_token_ids)
            assert not engine.has_unfinished_requests
            return {{k.split("-", 1)[1]: v for k, v in toks.items()}}

        errors = []
        go = threading.Barrier(5)
        def grab():
            go.wait()
            try:
                importlib.import_module("services.executor.grammar")
            except BaseException as e:
                errors.append(repr(e))
        racers = [threading.Thread(target=grab) for _ in range(4)]
        for t in racers:
            t.start()
        warm = warm_grammar_import()
        go.wait()
        warm_alive_at_first_request = warm.is_alive()
        first = run("cold")
        warm.join(120)
        for t in racers:
            t.join(120)
        again = run("warm")
        vocab = engine.grammars.tokenizer_info.decoded_vocab
        stops = set(engine.model_config.eos_token_ids)
        text = {{k: b"".join(vocab[t] for t in v if t not in stops).decode("utf-8", "replace")
                for k, v in first.items()}}
        print(json.dumps({{"first": first, "again": again, "errors": errors, "text": text,
                          "warm_alive": warm_alive_at_first_request,
                          "threads": [threads_before, torch.get_num_threads()]}}))
    """)
    assert out["errors"] == []
    assert out["threads"][0] == out["threads"][1]  # importing xgrammar/transformers leaves torch's threads alone
    assert out["first"] == out["again"]
    assert all(out["first"].values())


    assert re.fullmatch("[0-9]{3}-[a-z]{1,3}", out["text"]["regex"]), out["text"]
    assert out["text"]["ebnf"] in ("yes", "no")
    obj = json.loads(out["text"]["schema"])
    assert set(obj) == {"a", "b"} and obj["b"] in ("x", "y")
    assert out["text"]["object"].lstrip().startswith("{")  # unbounded: may stop at max_tokens


_NATIVE_LOAD_FAILS = (
    'import types, importlib.abc, importlib.machinery\n'
    '    ATTEMPTS = []\n'
    '    class Boom(importlib.abc.MetaPathFinder, importlib.abc.Loader):\n'
    '        def find_spec(self, name, path, target=None):\n'
    '            return importlib.machinery.ModuleSpec(name, self) if name == "xgrammar" else None\n'
    '        def create_module(self, spec): return None\n'
    '        def exec_module(self, module):\n'
    '            ATTEMPTS.append(1)\n'
    '            raise OSError("libxgrammar.so: cannot open shared object file")\n'
    '    sys.meta_path.insert(0, Boom())')

_BROKEN_XGRAMMAR_EXECUTOR = """
    import asyncio, json, sys
    {inject}
    import grpc
    from services.executor.engine.async_engine import AsyncEngine
    from services.executor.engine.config import EngineConfig
    from services.executor.engine.engine import LLMEngine
    from services.executor.server import ERROR_RULES, ExecutorServicer
    from services.executor.app import warm_grammar_import
    from services.mesh.grpc_server import GrpcServer, channel_options
    from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc

    async def gen(stub, rid, grammar=None):
        sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, grammar=grammar)
        toks = []
        try:
            async for c in stub.Generate(executor_pb2.ExecuteRequest(
                    request_id=rid, prompt_token_ids=[5, 6, 7, 8], sampling=sampling), timeout=60):
                toks.extend(c.token_ids_delta)
        except grpc.aio.AioRpcError as e:
            return {{"code": e.code().name, "details": e.details()}}
        return {{"tokens": toks}}

    async def main():
        engine = LLMEngine({ckpt!r}, EngineConfig(num_kv_blocks=32, num_threads=1))
        ae = AsyncEngine(engine)
        server = GrpcServer("weft.v1.Executor", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1)
        executor_pb2_grpc.add_ExecutorServicer_to_server(ExecutorServicer(ae, "ex", engine.model_id, 16), server.server)
        port = await server.start()
        warm = warm_grammar_import()
        await asyncio.to_thread(warm.join, 60)
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{{port}}", options=channel_options())
        stub = executor_pb2_grpc.ExecutorStub(ch)
        r = {{}}
        r["free1"] = await gen(stub, "f1")
        r["schema"] = await gen(stub, "c1", common_pb2.Grammar(json_schema='{{"type": "object"}}'))
        r["regex"] = await gen(stub, "c2", common_pb2.Grammar(regex="[0-9]+"))
        r["free2"] = await gen(stub, "f2")
        r["attempts"] = len(globals().get("ATTEMPTS", []))
        r["engine_alive"] = ae._thread.is_alive() if hasattr(ae, "_thread") else None
        await ch.close()
        await server.server.stop(0)
        ae.shutdown()
        print(json.dumps(r))

    asyncio.run(main())
"""


@pytest.mark.parametrize("inject", [
    'sys.modules["xgrammar"] = None  # "import xgrammar" raises ImportError',
    # a module that blows up half-way through its import (a broken native wheel)
    _NATIVE_LOAD_FAILS,
], ids=["missing", "native-load-fails"])
def test_a_broken_xgrammar_leaves_free_requests_served_and_constrained_ones_get_a_clear_error(tiny_checkpoint, inject):
    r = _run_script(_BROKEN_XGRAMMAR_EXECUTOR.format(inject=inject, ckpt=str(tiny_checkpoint)))
    assert r["free1"].get("tokens") and r["free2"] == r["free1"], r
    for kind in ("schema", "regex"):
        err = r[kind]
        assert "code" in err, r  # refused, not silently unconstrained
        # a clear, client-visible error naming the field and the cause (the missing-tokenizer case's wording)
        assert err["code"] == "INVALID_ARGUMENT", err
        assert "this executor cannot constrain output: xgrammar did not load" in err["details"], err
    assert r["engine_alive"] in (True, None)


def test_a_broken_xgrammar_is_not_re_imported_on_the_engine_thread_for_every_constrained_request(tiny_checkpoint):
    """A failed import is not cached by Python: each constrained request re-runs xgrammar's
    (and, for a real broken wheel, transformers') import on the engine thread, stalling
    every stream for ~1 s. The failure should be remembered (warm-up + at most one retry)."""
    r = _run_script(_BROKEN_XGRAMMAR_EXECUTOR.format(inject=_NATIVE_LOAD_FAILS, ckpt=str(tiny_checkpoint)))
    assert r["free1"].get("tokens"), r
    assert 1 <= r["attempts"] <= 2, r


# ---------------------------------------------------------------- 2. os._exit after main()


def test_a_broken_stdout_pipe_does_not_turn_a_clean_exit_into_a_failure(tmp_path):
    """stdout closed by the reader (a supervisor that went away): flush fails with EPIPE;
    the exit status stays 0 and stderr still gets its last line."""
    code = """
        import sys
        from services.mesh.logging import configure_logging
        from services.mesh.service_main import run_service
        import structlog
        configure_logging("svc", "info", "json")
        async def main():
            sys.stdout.write("x" * 10)  # buffered; the pipe is closed by then
            structlog.get_logger("svc").info("svc_stopped")
        run_service(main, "svc", config_errors=())
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout stays block-buffered
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(120) == 0, err
    assert "svc_stopped" in err


# ---------------------------------------------------------------- SIGTERM a launched mesh's services


@pytest.fixture(scope="module")
def mesh(tiny_checkpoint, tmp_path_factory):
    from tests.integration.launched_mesh import launched_mesh

    state_dir = tmp_path_factory.mktemp("mesh")
    with launched_mesh(state_dir, tiny_checkpoint, 1, check_orphans=False) as (process, state):
        yield process, state


def _log_events(path: str) -> list[dict]:
    events = []
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events


def test_sigterm_mid_stream_drains_the_stream_and_logs_the_stop(mesh):
    import grpc

    from tests.integration.conftest import wait_for
    from weft.launcher.mesh_state import pid_alive
    from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc

    _, state = mesh
    ex = state.by_service("executor")[0]
    port = ex.ports.get("grpc") or next(iter(ex.ports.values()))
    max_tokens = 200

    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = executor_pb2_grpc.ExecutorStub(ch)
            sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            toks, finish, signalled = [], None, False
            async for c in stub.Generate(executor_pb2.ExecuteRequest(
                    request_id="drain-me", prompt_token_ids=[5, 6, 7, 8], sampling=sampling), timeout=60):
                toks.extend(c.token_ids_delta)
                if not signalled and toks:
                    os.kill(ex.pid, signal.SIGTERM)
                    signalled = True
                    # the drain has begun while this stream is still open on our side
                    await asyncio.to_thread(wait_for, lambda: "drain_started" in [
                        e.get("event") for e in _log_events(ex.log_path)], 30, "drain_started")
                if c.finish_reason:
                    finish = c.finish_reason
            return toks, finish

    toks, finish = asyncio.run(go())
    assert len(toks) == max_tokens, (len(toks), finish)
    wait_for(lambda: not pid_alive(ex.pid), 30, "the executor to exit after its drain")
    events = [e.get("event") for e in _log_events(ex.log_path)]
    for needed in ("drain_started", "drain_finished", "executor_stopped"):
        assert needed in events, (needed, events[-15:])
    assert events.index("drain_finished") < len(events) - 1 - events[::-1].index("executor_stopped") + 1


def test_sigterm_the_scheduler_logs_its_stop_and_exits(mesh):
    from tests.integration.conftest import wait_for
    from weft.launcher.mesh_state import pid_alive

    _, state = mesh
    sched = state.by_service("scheduler")[0]
    os.kill(sched.pid, signal.SIGTERM)
    wait_for(lambda: not pid_alive(sched.pid), 30, "the scheduler to exit")
    events = [e.get("event") for e in _log_events(sched.log_path)]
    assert "scheduler_stopped" in events, events[-15:]


def test_sigterm_the_cachestore_logs_its_stop_and_exits(mesh):
    from tests.integration.conftest import wait_for
    from weft.launcher.mesh_state import pid_alive

    _, state = mesh
    stores = state.by_service("cachestore")
    if not stores:
        pytest.skip("this mesh runs no cachestore")
    cs = stores[0]
    os.kill(cs.pid, signal.SIGTERM)
    wait_for(lambda: not pid_alive(cs.pid), 30, "the cachestore to exit")
    events = [e.get("event") for e in _log_events(cs.log_path)]
    assert "drain_finished" in events and "cachestore_stopped" in events, events[-15:]
    assert events[-1] == "cachestore_stopped" or "cachestore_stopped" in events[-5:], events[-10:]


# ---------------------------------------------------------------- a standalone executor process on the mesh's bus


@pytest.fixture(scope="module")
def bus_url(tmp_path_factory):
    from services.mesh.nats_server import NatsServer

    server = NatsServer(log_path=tmp_path_factory.mktemp("nats") / "nats.log").start()
    try:
        yield server.url
    finally:
        server.stop()


class _Executor:
    """``python -m services.executor`` against the launched mesh's NATS, JSON logs to a file."""

    def __init__(self, model_dir: Path, nats_url: str, log_path: Path, name: str) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.executor", "--model-dir", str(model_dir), "--port", "0",
             "--metrics-port", "0", "--nats-url", nats_url, "--name", name, "--num-kv-blocks", "64",
             "--num-threads", "1", "--log-format", "json", "--grace-s", "20"],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def events(self) -> list[dict]:
        return _log_events(str(self.log_path))

    def wait_ready(self) -> int:
        from tests.integration.conftest import wait_for

        def ready():
            if self.process.poll() is not None:
                pytest.fail(f"executor exited {self.process.returncode}: {self.log_path.read_text()[-3000:]}")
            return next((e for e in self.events() if e.get("event") == "executor_ready"), None)

        return wait_for(ready, 60, "executor_ready", interval_s=0.01)["port"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self._log.close()


async def _generate(port: int, rid: str, grammar=None, max_tokens: int = 24) -> list[int]:
    import grpc

    from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = executor_pb2_grpc.ExecutorStub(ch)
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar)
        toks = []
        async for c in stub.Generate(executor_pb2.ExecuteRequest(
                request_id=rid, prompt_token_ids=[5, 6, 7, 8], sampling=sampling), timeout=60):
            toks.extend(c.token_ids_delta)
        return toks


def test_constrained_requests_the_instant_a_real_executor_is_ready_then_sigterm(bus_url, tiny_checkpoint, tmp_path):
    from weft.v1 import common_pb2

    ex = _Executor(tiny_checkpoint, bus_url, tmp_path / "ex.log", "executor-adv-cold")
    try:
        port = ex.wait_ready()
        grammars = [common_pb2.Grammar(regex="[0-9]{3}-[a-z]{1,3}"),
                    common_pb2.Grammar(json_schema='{"type": "object", "properties": {"k": {"enum": ["v", "w"]}},'
                                                   ' "required": ["k"], "additionalProperties": false}'),
                    common_pb2.Grammar(ebnf='root ::= "yes" | "no"')]

        async def burst(tag):
            return await asyncio.gather(*(_generate(port, f"{tag}-{i}", g) for i, g in enumerate(grammars * 2)))

        cold = asyncio.run(burst("cold"))
        warm = asyncio.run(burst("warm"))
        assert cold == warm and all(cold)
        assert cold[:3] == cold[3:]
        ex.process.send_signal(signal.SIGTERM)
        assert ex.process.wait(60) == 0
        events = [e.get("event") for e in ex.events()]
        assert "grammar_import_failed" not in events
        assert events.index("drain_finished") < events.index("executor_stopped")
        assert "Traceback" not in ex.log_path.read_text()
    finally:
        ex.close()


def test_sigterm_while_the_grammar_warm_up_is_still_importing_exits_cleanly(bus_url, tiny_checkpoint, tmp_path):
    ex = _Executor(tiny_checkpoint, bus_url, tmp_path / "ex.log", "executor-adv-term")
    try:
        ex.wait_ready()
        ex.process.send_signal(signal.SIGTERM)  # the daemon import thread is most likely mid-import
        assert ex.process.wait(60) == 0
        text = ex.log_path.read_text()
        assert [e.get("event") for e in ex.events()][-1] == "executor_stopped", text[-2000:]
        assert "Traceback" not in text and "Fatal Python error" not in text, text[-3000:]
    finally:
        ex.close()


# ---------------------------------------------------------------- the disk tier under kill -9


def test_kill_9_mid_disk_writes_leaves_no_torn_or_temp_block(tmp_path):
    from tests.integration.conftest import wait_for

    root = tmp_path / "disk"
    code = f"""
        import zlib
        from services.cachestore.blocks import Block, BlockMeta, checksum
        from services.cachestore.disk_tier import DiskTier
        tier = DiskTier({str(root)!r}, 1 << 40, fsync=False)
        i = 0
        while True:
            payload = bytes([i % 251]) * (1 << 20)
            tier.put(Block(BlockMeta(block_hash=i + 1, dtype="uint8", shape=(len(payload),),
                                     size_bytes=len(payload), checksum=checksum(payload)), payload))
            i += 1
    """
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: p.poll() is not None or len(list(root.glob("*/*"))) >= 20, 60, "20 block files")
        assert p.poll() is None, p.stderr.read().decode()[-3000:]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    from services.cachestore.disk_tier import DiskTier

    tier = DiskTier(root, 1 << 40, fsync=False)
    assert not [x for x in root.glob("*/*") if x.name.startswith(".tmp-")]
    hashes = tier.hashes()
    assert len(hashes) >= 19
    for h in hashes:
        block = tier.get(h)
        assert block is not None and block.payload == bytes([(h - 1) % 251]) * (1 << 20), h

"""The unlucky operator restarts an executor with other grammar settings (issue 15): the
flags are explained by --help (what each bounds, its env variable, its default), the help
says what a slow compile costs as the executor now behaves (the compile left the engine
thread in 2958a89; the help still said every stream stalls), and nonsense values are a
usage error naming the setting before any model loads."""
from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from tests.integration.conftest import free_port, wait_for
from tests.integration.launched_mesh import ROOT


def _executor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.executor", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def _help_of(flag: str) -> str:
    text = _executor("--help").stdout
    match = re.search(rf"^  {re.escape(flag)} \S+\n((?:\s{{6,}}.*\n)+)", text, re.M)
    assert match, f"{flag} is not explained by --help"
    return " ".join(match.group(1).split())


@pytest.mark.parametrize("flag, env, default", [
    ("--grammar-cache-entries", "WEFT_EXECUTOR_GRAMMAR_CACHE_ENTRIES", "256"),
    ("--grammar-max-bytes", "WEFT_EXECUTOR_GRAMMAR_MAX_BYTES", "65536"),
    ("--grammar-compile-timeout-s", "WEFT_EXECUTOR_GRAMMAR_COMPILE_TIMEOUT_S", "5.0"),
])
def test_each_grammar_flag_is_explained_with_its_env_and_default(flag, env, default):
    text = _help_of(flag)
    assert f"env {env}" in text and f"default: {default}" in text, text


def test_the_compile_timeout_help_says_only_the_compiling_request_waits():
    text = _help_of("--grammar-compile-timeout-s")
    assert "every stream stalls" not in text, text
    assert "INVALID_ARGUMENT" in text and "other streams keep going" in text, text


@pytest.mark.parametrize("flag, value, field", [
    ("--grammar-cache-entries", "0", "grammar_cache_entries"),
    ("--grammar-max-bytes", "-1", "grammar_max_bytes"),
    ("--grammar-compile-timeout-s", "0", "grammar_compile_timeout_s"),
])
def test_a_nonsense_grammar_setting_is_a_usage_error_naming_it(tiny_model_dir, flag, value, field):
    out = _executor("--model-dir", str(tiny_model_dir), flag, value)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert f"{field} must be > 0" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("parser", ["hermes", "smollm2", "llama3_json", "mistral", "pythonic", "auto"])
def test_a_router_starts_with_each_tool_call_parser(tmp_path, tiny_model_dir, parser):
    """Every format --help lists is one the router starts with (an unknown one is a usage
    error: test_issue15_operator_mesh), even where the template teaches another."""
    http_port = free_port()
    log = open(tmp_path / "router.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.router", "--host", "127.0.0.1", "--model-dir", str(tiny_model_dir),
         "--tool-call-parser", parser, "--http-port", str(http_port), "--grpc-port", str(free_port()),
         "--metrics-port", str(free_port()), "--scheduler-address", f"127.0.0.1:{free_port()}"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            if process.poll() is not None:
                pytest.fail(f"the router exited {process.returncode}: {(tmp_path / 'router.log').read_text()[-3000:]}")
            return httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200

        wait_for(up, 90, f"the router with --tool-call-parser {parser}")
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()

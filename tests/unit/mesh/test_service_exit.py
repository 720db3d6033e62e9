"""A service whose ``main()`` returned exits at once (``run_service`` skips the
interpreter's teardown), and nothing it wrote is lost on the way: its last log line,
unflushed stdout and stderr, a file it wrote. A ``main()`` that raises still exits
non-zero with its traceback."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    head = textwrap.dedent(f"""\
        import sys
        from services.mesh.logging import configure_logging
        from services.mesh.service_main import run_service
        import structlog
        configure_logging("svc", "info", "json")
        log = structlog.get_logger("svc")
        out = {str(tmp_path / 'written')!r}
        async def main():
    """)
    tail = 'run_service(main, "svc", config_errors=())\nprint("not reached", flush=True)\n'
    script = head + textwrap.indent(textwrap.dedent(body), "    ") + tail
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_clean_return_keeps_the_last_log_line_unflushed_output_and_files(tmp_path):
    done = _run(tmp_path, """
        with open(out, "w") as f:
            f.write("kept")
        log.info("svc_stopped", reason="drained")
        sys.stdout.write("stdout tail without newline")  # left in the buffer
        sys.stderr.write("stderr tail")
    """)
    assert done.returncode == 0, done.stderr
    assert "not reached" not in done.stdout  # the process ended inside run_service
    assert "stdout tail without newline" in done.stdout and "stderr tail" in done.stderr
    events = [json.loads(line)["event"] for line in done.stderr.splitlines() if line.startswith("{")]
    assert "svc_stopped" in events
    assert (tmp_path / "written").read_text() == "kept"


def test_a_main_that_raises_still_fails_with_its_traceback(tmp_path):
    done = _run(tmp_path, """
        raise RuntimeError("engine wedged")
    """)
    assert done.returncode == 1
    assert "RuntimeError: engine wedged" in done.stderr and "not reached" not in done.stdout

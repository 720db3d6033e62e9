"""`weft up`'s checks before anything starts (weft/launcher/startup_checks.py): one line naming the
cause; and a service's death reported as one line from its log."""
from __future__ import annotations

import json
import socket

from weft.launcher.startup_checks import bind_error, check_model_dir, check_ports_free, last_log_line, ports_free


def test_missing_model_dir_says_no_such_directory(tmp_path):
    missing = tmp_path / "nope"
    assert check_model_dir(str(missing)) == f"no such directory: {missing} (--model)"
    assert check_model_dir(str(tmp_path)) is None
    assert check_model_dir(None) is None  # the built-in tiny model


def test_a_file_as_model_dir_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{}")
    assert check_model_dir(str(path)).startswith("not a directory:")


def test_a_listened_port_is_named_with_its_flag_and_a_free_one_passes():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        problem = check_ports_free("127.0.0.1", {"--grpc-port": 0, "--http-port": port})
        assert problem is not None and "\n" not in problem
        assert f"port {port} (--http-port)" in problem and "in use" in problem
        assert bind_error("127.0.0.1", port) is not None
        assert not ports_free("127.0.0.1", [port])
    assert check_ports_free("127.0.0.1", {"--http-port": port}) is None
    assert ports_free("127.0.0.1", [port])


def test_last_log_line_is_one_short_line(tmp_path):
    log = tmp_path / "router.log"
    log.write_text("Traceback (most recent call last):\n  ...\nOSError: [Errno 98] address already in use\n\n")
    assert last_log_line(log) == "OSError: [Errno 98] address already in use"
    log.write_text(json.dumps({"timestamp": "t", "level": "error", "event": "model_load_failed", "error": "x" * 500}))
    line = last_log_line(log)
    assert line.startswith("event=model_load_failed") and len(line) == 300 and "\n" not in line
    assert last_log_line(tmp_path / "absent.log") == "(no log)"

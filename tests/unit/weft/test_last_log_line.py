"""`weft up` names why a service failed to start by its log's last line. An executor whose
safetensors file is truncated logged the cause (CheckpointError …) and then, while the
interpreter shut down, asyncio's "Task was destroyed" / "Exception ignored in" noise, so
the operator read "RuntimeError: Event loop is closed". The cause must win over the noise."""
from weft.launcher.startup_checks import last_log_line

CAUSE = ("services.executor.errors.CheckpointError: model.safetensors in /m is truncated or corrupt: "
         "Error while deserializing header: invalid header length")
SHUTDOWN_NOISE = """Task was destroyed but it is pending!
task: <Task pending name='Task-10' coro=<Client._read_loop() running at client.py:2413>>
Task was destroyed but it is pending!
task: <Task pending name='Task-11' coro=<Client._ping_interval() running at client.py:2381>>
Exception ignored in: <coroutine object Client._flusher at 0x7f8590e22b60>
Traceback (most recent call last):
  File "client.py", line 2359, in _flusher
RuntimeError: Event loop is closed
"""


def test_interpreter_shutdown_noise_after_the_fatal_error_is_not_the_cause(tmp_path):
    log = tmp_path / "executor-0.log"
    log.write_text('{"event": "nats_connected", "level": "info"}\nTraceback (most recent call last):\n'
                   '  File "app.py", line 1, in main\n' + CAUSE + "\n" + SHUTDOWN_NOISE)
    assert last_log_line(log, max_chars=1000) == CAUSE


def test_noise_followed_by_a_later_record_or_traceback_keeps_the_latest(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(SHUTDOWN_NOISE + '{"event": "engine_failed", "level": "error"}\n')
    assert last_log_line(log) == "event=engine_failed"
    log.write_text(SHUTDOWN_NOISE + "Traceback (most recent call last):\n  File x\nValueError: bad\n")
    assert last_log_line(log) == "ValueError: bad"


def test_a_log_of_only_noise_still_shows_its_last_line(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(SHUTDOWN_NOISE)
    assert last_log_line(log) == "RuntimeError: Event loop is closed"

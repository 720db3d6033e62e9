"""`weft top --once` after an operator's bad afternoon: an executor restarted three times
after engine deaths (exit 70) looked exactly like one that never died ("up", nothing else),
and one the supervisor gave up on (crash-loop) just said DOWN. The rows now carry what
`weft ps` knows: restarts, the last exit status, a crash loop."""
from weft.cli.top import ServiceView, Snapshot, render


def _row(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if f" {name} " in line)


def test_restarts_last_exit_and_a_crash_loop_show_in_top():
    snap = Snapshot(0.0, [
        ServiceView("executor-0", "executor", 11, up=True, restarts=3, last_exit=70),
        ServiceView("executor-1", "executor", 12, up=False, restarts=4, last_exit=-9, status="crash-loop"),
        ServiceView("scheduler", "scheduler", 13, up=True),
    ], None)
    text = render(snap)
    assert "restarts 3 exit 70" in _row(text, "executor-0") and " up " in _row(text, "executor-0")
    assert "CRASH-LOOP" in _row(text, "executor-1") and "exit -9" in _row(text, "executor-1")
    assert "restarts" not in _row(text, "scheduler")

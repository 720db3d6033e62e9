"""benchmarks/mesh_startup.py refuses flags it cannot run, naming them."""
from __future__ import annotations

import pytest

from benchmarks.mesh_startup import parse_args


@pytest.mark.parametrize("argv", [["--executors", "0"], ["--rounds", "0"]])
def test_impossible_counts_are_refused_by_name(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and "need --executors >= 1 and --rounds >= 1" in capsys.readouterr().err


def test_defaults_are_one_executor_three_rounds():
    args = parse_args([])
    assert (args.executors, args.rounds, args.model) == (1, 3, None)

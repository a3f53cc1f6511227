"""torchrun's environment, set wrong by hand: one line naming the variable, never a traceback.

``setup`` checks ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (integers, in range) and the
rendezvous address before torch sees them, and says a failed rendezvous in one line. The
command line is run for real in a child process: the exit path reads ``WORLD_SIZE`` too
(Note [gloo exit]), and used to raise a traceback after the error line.
"""

from __future__ import annotations

import re
import socket

import forks
import pytest
from torchrun_runs import HERE, env

from bigbatch.distributed import launch

LAUNCH = r"launch with `torchrun --nproc_per_node N \.\.\.`, which sets it, or unset it\."
BAD = {
    "WORLD_SIZE not a number": (
        {"WORLD_SIZE": "abc"},
        rf"^environment variable WORLD_SIZE='abc' is not an integer: {LAUNCH}$",
    ),
    "WORLD_SIZE 0": (
        {"WORLD_SIZE": "0"},
        rf"^environment variable WORLD_SIZE=0 is not allowed: it is the number of processes, at "
        rf"least 1; {LAUNCH}$",
    ),
    "RANK past the ranks": (
        {"WORLD_SIZE": "2", "RANK": "5"},
        rf"^environment variable RANK=5 is out of range for WORLD_SIZE=2 \(0 to 1\); {LAUNCH}$",
    ),
    "RANK negative": (
        {"RANK": "-1"},
        r"^environment variable RANK=-1 is out of range for WORLD_SIZE=1 \(0 to 0\)",
    ),
    "RANK not a number": ({"RANK": "zero"}, r"^environment variable RANK='zero' is not an integer"),
    "LOCAL_RANK out of range": (
        {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "7"},
        r"^environment variable LOCAL_RANK=7 is out of range \(WORLD_SIZE=2\)",
    ),
    "no rendezvous address": (
        {"WORLD_SIZE": "2", "RANK": "1"},
        r"^environment variable WORLD_SIZE=2 asks for 2 processes, and MASTER_ADDR and "
        r"MASTER_PORT are not set: launch with `torchrun --nproc_per_node 2 \.\.\.`",
    ),
    "a port that is not one": (
        {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "99999"},
        r"^environment variable MASTER_PORT=99999 is not a port \(1 to 65535\)",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_variable_is_named(case, monkeypatch):
    variables, message = BAD[case]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        launch.setup("cpu")


def test_a_rendezvous_that_fails_is_one_line(monkeypatch):
    """Rank 0 cannot listen on a port another process holds (a real socket)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():  # fmt: skip
            monkeypatch.setenv(name, value)
        with pytest.raises(
            RuntimeError,
            match=rf"^rank 0 of 2 could not join the process group at 127\.0\.0\.1:{port} \(.*"
            r"address already in use.*\): launch with `torchrun --nproc_per_node N",
        ):
            launch.setup("cpu")
    assert not launch.in_group()


@pytest.mark.slow  # child processes
@pytest.mark.parametrize("case", ["WORLD_SIZE not a number", "RANK past the ranks", "WORLD_SIZE 0"])
def test_the_command_line_says_it_in_one_line(case, tmp_path):
    variables, message = BAD[case]
    task = f"{HERE.parent / 'app' / 'tasks.py'}:classify"
    done = forks.run(  # a real child, forked (forks.py)
        ["-m", "bigbatch", "train", task, "--out", str(tmp_path / "run")], {**env(), **variables}
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    line = done.stderr.strip().removeprefix("bigbatch train: error: ")
    assert re.match(message, line), line
    assert not (tmp_path / "run").exists()

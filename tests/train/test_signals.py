"""SIGINT and SIGTERM sent to a running ``bigbatch train`` (Note [clean stop] in train.signals).

The child stops itself (SIGSTOP) inside a window at a known micro-batch; the test sends the
signal and SIGCONT. The first signal lets the step in flight finish, writes a snapshot at that
step, prints one line with the command that resumes, and exits 128 + the signal; running that
command ends bitwise equal to an uninterrupted run. A second SIGINT stops at once, the step in
flight discarded, the last snapshot kept.
"""

from __future__ import annotations

import shlex
import signal
import sys

import pytest
import runs

from bigbatch.app.log import read_csv

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_snapshots_and_says_how_to_resume(
    signum, tmp_path, reference_run
):
    out, err = tmp_path / "run", tmp_path / "err"
    args = runs.argv(out)
    child = runs.start(args, err, STOP_AT="14")  # the second micro-batch of step 5
    runs.wait_stopped(child, err)
    runs.signal_and_continue(child, signum)
    assert child.wait(timeout=300) == 128 + signum
    line = runs.one_line(err.read_text())
    name = signal.Signals(signum).name
    prefix = f"bigbatch train: stopped by {name} after step 5 of 10; snapshot written to "
    assert line.startswith(prefix + f"{out / 'snapshot.pt'}. Resume with: "), line
    command = shlex.split(line.split("Resume with: ", 1)[1])
    assert command == ["bigbatch", *args[3:], "--resume"]
    assert runs.snapshot_step(out) == 5  # the step in flight was finished and saved
    assert [int(r["step"]) for r in read_csv(str(out / "metrics.csv"))] == [1, 2, 3, 4, 5]
    done = runs.run([sys.executable, "-m", "bigbatch", *command[1:]])  # the printed command
    assert done.returncode == 0, done.stderr[-3000:]
    runs.assert_same_run(out, reference_run)


def test_a_second_sigint_stops_at_once(tmp_path, reference_run):
    out, err = tmp_path / "run", tmp_path / "err"
    child = runs.start(runs.argv(out), err, STOP_AT="14,15")  # two micro-batches of step 5
    runs.wait_stopped(child, err)
    runs.signal_and_continue(child, signal.SIGINT)  # noted: the step goes on
    runs.wait_stopped(child, err)
    runs.signal_and_continue(child, signal.SIGINT)  # the second: stop now
    assert child.wait(timeout=300) == 130
    assert runs.one_line(err.read_text()) == "bigbatch train: interrupted."
    assert runs.snapshot_step(out) == 3  # step 5 was not finished, nothing newer was written
    assert [int(r["step"]) for r in read_csv(str(out / "metrics.csv"))] == [1, 2, 3, 4]
    done = runs.run(runs.argv(out, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    runs.assert_same_run(out, reference_run)

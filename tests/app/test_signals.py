"""SIGINT and SIGTERM sent to a running ``bigbatch train`` (Note [clean stop] in app.loop).

The child stops itself (SIGSTOP) inside a window at a known micro-batch; the test sends the
signal and SIGCONT. The first signal lets the step in flight finish, writes a snapshot at that
step, prints one line with the command that resumes, and exits 128 + the signal; running that
command ends bitwise equal to an uninterrupted run. A second SIGTERM is the same stop (a copy:
pkill, SLURM, torchrun forwarding it); a second SIGINT stops at once, the step in
flight discarded, the last snapshot kept, except during a snapshot's write: two signals there
let the write finish and stop with that snapshot. A signal during the final evaluation stops
it (the training is complete and snapshotted); the printed command evaluates and writes
``model.pt``. A resumed run says the step it resumes from.
"""

from __future__ import annotations

import json
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
    assert done.stdout == f"resuming from step 5 of 10 ({out / 'snapshot.pt'})\n"  # --quiet too
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


def test_a_second_sigterm_is_the_same_stop(tmp_path, reference_run):
    """pkill, SLURM and torchrun's forwarding send a process SIGTERM twice: the second is a copy
    of the first, and the run still finishes the step, snapshots and says how to resume.
    Before, it stopped at once and the step in flight was lost."""
    out, err = tmp_path / "run", tmp_path / "err"
    child = runs.start(runs.argv(out), err, STOP_AT="14,15")  # two micro-batches of step 5
    runs.wait_stopped(child, err)
    runs.signal_and_continue(child, signal.SIGTERM)
    runs.wait_stopped(child, err)
    runs.signal_and_continue(child, signal.SIGTERM)
    assert child.wait(timeout=300) == 143
    assert runs.one_line(err.read_text()).startswith(
        "bigbatch train: stopped by SIGTERM after step 5 of 10; snapshot written to "
    )
    assert runs.snapshot_step(out) == 5
    done = runs.run(runs.argv(out, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    runs.assert_same_run(out, reference_run)


def test_two_sigints_during_a_snapshot_write_finish_it_and_stop(tmp_path, reference_run):
    """Both arrive while the snapshot of step 3 is half written (the child stops itself twice
    inside ``torch.save``): the write ends whole, then the run stops with it, at once (step 4
    is not taken). Before, the second one tore the write and the snapshot was lost."""
    out, err = tmp_path / "run", tmp_path / "err"
    torn = [sys.executable, str(runs.HERE / "torn_write_child.py"), *runs.argv(out)[3:]]
    child = runs.start(torn, err, STOP_IN_WRITE="1", FINISH_WRITE="1", STOP_TWICE="1")
    for _ in range(2):
        runs.wait_stopped(child, err)
        runs.signal_and_continue(child, signal.SIGINT)
    assert child.wait(timeout=300) == 130
    line = runs.one_line(err.read_text())
    assert line.startswith(
        f"bigbatch train: stopped by SIGINT after step 3 of 10; snapshot written to "
        f"{out / 'snapshot.pt'}. Resume with: "
    ), line
    assert runs.snapshot_step(out) == 3 and not list(out.glob(".*tmp*"))
    assert [int(r["step"]) for r in read_csv(str(out / "metrics.csv"))] == [1, 2, 3]
    done = runs.run(runs.argv(out, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    runs.assert_same_run(out, reference_run)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_final_evaluation_stops_it(signum, tmp_path, reference_run):
    """Micro-batch 32 is the final evaluation's second batch (training took 30). Before, the
    signal was noted and never acted on: the run went on and exited 0."""
    out, err = tmp_path / "run", tmp_path / "err"
    args = runs.argv(out)
    child = runs.start(args, err, STOP_AT="32")
    runs.wait_stopped(child, err)
    runs.signal_and_continue(child, signum)
    assert child.wait(timeout=300) == 128 + signum
    line = runs.one_line(err.read_text())
    name = signal.Signals(signum).name
    prefix = (
        f"bigbatch train: stopped by {name} during the final evaluation, after step 10 of 10: "
        f"the training is complete, in {out / 'snapshot.pt'}; model.pt and summary.json were "
        "not written. Evaluate and write them with: "
    )
    assert line.startswith(prefix), line
    assert shlex.split(line[len(prefix) :]) == ["bigbatch", *args[3:], "--resume"]
    assert not (out / "model.pt").exists() and not (out / "summary.json").exists()
    assert runs.snapshot_step(out) == 10
    done = runs.run(runs.argv(out, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == f"resuming from step 10 of 10 ({out / 'snapshot.pt'})\n"
    runs.assert_same_run(out, reference_run)
    got, want = (json.loads((o / "summary.json").read_text()) for o in (out, reference_run))
    for key in ("steps", "samples", "final_loss", "eval_loss", "metric", "skipped_steps"):
        assert got[key] == want[key], key

"""One run folder, one writer (Note [one writer] in bigbatch.app.folder), with real processes.

A first ``bigbatch train`` stops itself (SIGSTOP) at a known micro-batch while it holds the run
folder; a second process on the same ``--out`` must exit at once with one line naming the
first's PID, and leave every file as it was. The first then continues and ends exactly as an
uninterrupted run. A SIGKILLed run leaves no stale lock: the kernel released it.
"""

from __future__ import annotations

import glob
import os
import signal
import sys

import pytest
import runs

pytestmark = pytest.mark.slow

STOP_AT = "14"  # the second micro-batch of step 5; the snapshot of step 3 is on disk


@pytest.mark.parametrize("second", [[], ["--resume"]], ids=["fresh", "resume"])
def test_a_second_run_on_a_busy_folder_exits_at_once_and_touches_nothing(
    second, tmp_path, reference_run
):
    out, err = tmp_path / "run", tmp_path / "first.err"
    first = runs.start(runs.argv(out), err, STOP_AT=STOP_AT)
    runs.wait_stopped(first, err)
    before = runs.folder_state(out)
    assert {"metrics.csv", "snapshot.pt", ".lock"} <= set(before)
    done = runs.run(runs.argv(out, *second), timeout=120)
    assert done.returncode == 2
    line = runs.one_line(done.stderr)
    assert line == (
        f"bigbatch train: error: run folder {str(out)!r} is in use by another bigbatch run "
        f"(process {first.pid}): wait for it to end, or choose another --out."
    )
    assert runs.folder_state(out) == before  # not a byte changed, nothing added or removed
    runs.signal_and_continue(first)
    assert first.wait(timeout=300) == 0, err.read_text()[-3000:]
    runs.assert_same_run(out, reference_run)


def test_a_sigkilled_run_leaves_no_stale_lock(tmp_path, reference_run):
    out, err = tmp_path / "run", tmp_path / "first.err"
    first = runs.start(runs.argv(out), err, STOP_AT=STOP_AT)
    runs.wait_stopped(first, err)
    runs.kill(first)
    assert (out / ".lock").read_text().strip() == str(first.pid)  # the file stays, not the lock
    done = runs.run(runs.argv(out, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    runs.assert_same_run(out, reference_run)


def test_a_second_run_during_a_snapshot_write_does_not_break_the_first(tmp_path, reference_run):
    """The first run stops half-way through writing the snapshot of step 5 (its temporary file
    half written); a second run must not remove that file (only the lock holder cleans)."""
    out, err = tmp_path / "run", tmp_path / "first.err"
    torn = [sys.executable, str(runs.HERE / "torn_write_child.py"), *runs.argv(out)[3:]]
    first = runs.start(torn, err, STOP_IN_WRITE="2", FINISH_WRITE="1")
    runs.wait_stopped(first, err)
    [temp] = glob.glob(str(out / ".snapshot.pt.tmp.*"))
    before = runs.folder_state(out)
    for second in ([], ["--resume"]):
        done = runs.run(runs.argv(out, *second), timeout=120)
        assert done.returncode == 2
        assert f"(process {first.pid})" in runs.one_line(done.stderr)
    assert os.path.exists(temp) and runs.folder_state(out) == before
    runs.signal_and_continue(first)
    assert first.wait(timeout=300) == 0, err.read_text()[-3000:]
    assert not glob.glob(str(out / ".snapshot.pt.tmp.*"))
    runs.assert_same_run(out, reference_run)


def test_the_lock_is_released_when_the_run_ends(tmp_path):
    """A finished run, one that failed, and one stopped by SIGTERM each leave the folder free."""
    out, err = tmp_path / "run", tmp_path / "first.err"
    first = runs.start(runs.argv(out), err, STOP_AT=STOP_AT)
    runs.wait_stopped(first, err)
    runs.signal_and_continue(first, signal.SIGTERM)
    assert first.wait(timeout=300) == 128 + signal.SIGTERM, err.read_text()[-3000:]
    done = runs.run(runs.argv(out, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]

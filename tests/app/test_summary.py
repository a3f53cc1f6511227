"""What a run reports stays true across faults: the whole run's samples/s after a real kill and
resume, a torn last row of metrics.csv, the step peak under auto (the adopted attempt's), and the
micro-batch decisions of auto + --memory-budget after a resume."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import runs
import tasks
import torch

import bigbatch
from bigbatch.app.cli import main
from bigbatch.app.log import read_csv


@pytest.mark.slow
def test_summary_after_kill_and_resume_reports_the_whole_run(tmp_path):
    """Killed at step 5 (snapshot of step 3), resumed: 10 steps, 100 samples, and the time of
    steps 1-3 (from the first process) plus 4-10 (from the second), not the second's alone."""
    out, err = tmp_path / "run", tmp_path / "err"
    child = runs.start(runs.argv(out), err, STOP_AT="14")
    runs.wait_stopped(child, err)
    runs.kill(child)
    first_part = read_csv(str(out / "metrics.csv"))[:3]  # what the snapshot of step 3 covers
    done = runs.run(runs.argv(out, "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_csv(str(out / "metrics.csv"))
    assert rows[:3] == first_part
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["samples"]) == (10, 100)
    step_times = sum(float(r["time_s"]) for r in rows)
    assert summary["time_s"] == pytest.approx(step_times, rel=1e-9)
    assert summary["time_s"] > sum(float(r["time_s"]) for r in rows[3:])  # not the resumed part
    assert summary["samples_per_s"] == pytest.approx(100 / step_times, rel=1e-9)


def test_a_torn_last_row_is_dropped_on_resume(tmp_path, capsys, monkeypatch):
    """A run stopped at step 5 (snapshot of step 3) whose metrics.csv ends in half a row (a kill
    in the middle of a write) resumes to exactly one row per step, equal to an unbroken run."""
    clean, out = tmp_path / "clean", tmp_path / "run"
    assert main(runs.argv(clean, task="faulty")[3:]) == 0
    monkeypatch.setenv("NAN_AT", "14")
    assert main(runs.argv(out, task="faulty")[3:]) == 2
    monkeypatch.delenv("NAN_AT")
    lines = (out / "metrics.csv").read_text().splitlines(keepends=True)
    assert len(lines) == 5  # header and steps 1-4
    with open(out / "metrics.csv", "a") as csv:
        csv.write(lines[-1][: len(lines[-1]) // 2].replace("4,", "5,", 1))  # torn: no newline
    capsys.readouterr()
    assert main(runs.argv(out, "--resume", task="faulty")[3:]) == 0, capsys.readouterr().err
    runs.assert_same_run(out, clean)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["samples"] == 100


BUDGET = 30 * 2**20  # tasks.hungry: 16 samples take ~48 MiB, 8 take ~24 MiB


def test_the_step_peak_under_auto_is_the_adopted_attempts(tmp_path):
    torch.manual_seed(0)
    summary = bigbatch.fit(
        tasks.hungry(), batch_size=16, micro_batch_size="auto", memory_budget=BUDGET,
        steps=2, out=str(tmp_path), quiet=True,
    )  # fmt: skip
    first = read_csv(str(tmp_path / "metrics.csv"))[0]
    assert int(first["oom_retries"]) >= 1 and int(first["micro_batch_size"]) < 16
    assert int(first["step_peak_bytes"]) <= BUDGET < int(first["retry_peak_bytes"])
    assert summary.step_peak_bytes <= BUDGET < summary.retry_peak_bytes


AUTO = ["--batch-size", "16", "--micro-batch-size", "auto", "--memory-budget", str(BUDGET),
        "--steps", "8", "--save-every", "2", "--keep-snapshots", "8", "--seed", "3", "--quiet"]  # fmt: skip


@pytest.mark.slow
def test_resume_with_auto_and_a_budget_takes_the_same_decisions(tmp_path):
    """A fresh process resumed from the uninterrupted run's own snapshot of step 2 must take
    that run's micro-batch decisions at steps 3-8 and end with bitwise its weights. (Resuming
    from the run's own snapshot isolates the fresh process: a run killed at step 3 would have
    measured its steps 1-2 in another process, whose decisions may differ by noise alone.)
    Both runs must complete; the same decisions are not guaranteed, and the README says so: CPU
    peaks near --memory-budget vary between processes, so the resumed run can take another
    micro-batch at a step (the re-measure rule, Note [re-measure before shrinking], makes
    agreement the usual case): then the test is an expected failure, and with the same
    decisions the weights must be bitwise equal."""
    argv = [sys.executable, "-m", "bigbatch", "train", f"{runs.TASKS}:hungry", *AUTO]
    whole, out = tmp_path / "whole", tmp_path / "run"
    done = runs.run([*argv, "--out", str(whole)], fresh=True)  # CPU peaks as a user's process
    assert done.returncode == 0, done.stderr[-3000:]
    out.mkdir()
    shutil.copy(whole / "snapshot-00000002.pt", out / "snapshot.pt")
    shutil.copy(whole / "metrics.csv", out / "metrics.csv")  # cut to steps 1-2 on resume
    done = runs.run([*argv, "--out", str(out), "--resume"], fresh=True)
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = read_csv(str(out / "metrics.csv")), read_csv(str(whole / "metrics.csv"))
    assert [r["step"] for r in got] == [r["step"] for r in want]
    decisions = [[(r["micro_batch_size"], r["oom_retries"]) for r in rows] for rows in (got, want)]
    if decisions[0] != decisions[1]:
        pytest.xfail(f"another micro-batch at a step near the budget: {decisions}")
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    a, b = torch.load(out / "model.pt"), torch.load(whole / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)

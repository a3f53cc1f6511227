"""Exact resume, tested by really killing ``bigbatch train`` in a child process.

Each case runs the CLI on ``tasks.killable`` (dropout: a resumed run must replay the same random
masks) in a child process that stops itself (SIGSTOP) at a chosen point: inside a window, at the
first micro-batch after a step boundary, or half-way through writing a snapshot. The test then
SIGKILLs it -- no handler runs, nothing is flushed -- starts ``bigbatch train --resume`` and
compares the final ``model.pt`` bitwise with an uninterrupted run, and ``metrics.csv`` row by
row (one row per step, no step twice, the same losses).

Run: 50 samples, batch 10 cut 4+4+2 (3 micro-batches per step), 2 epochs = 10 steps = 30
micro-batches; snapshots after steps 3, 5 (end of epoch), 6, 9 and 10 (``--save-every 3``).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from runs import HERE, argv, assert_same_run, kill_when_stopped, snapshot_step, train_ok

from bigbatch.app.log import read_csv

pytestmark = pytest.mark.slow  # child processes killed with SIGKILL


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference runs, never killed: fixed micro-batch 4, and auto under simulated OOMs."""
    root = tmp_path_factory.mktemp("uninterrupted")
    train_ok(argv(root / "fixed"))
    train_ok(argv(root / "auto", micro="auto"), OOM_ABOVE="4")
    return root


KILL_POINTS = {
    # micro-batch 14 = the second of step 5 (steps 1-4 used 12): the snapshot of step 3 is redone from
    "mid-window after a snapshot": (14, 3),
    # micro-batch 16 = the first of step 6, just after the end-of-epoch snapshot of step 5
    "first micro-batch after a snapshot": (16, 5),
    # micro-batch 5 = the second of step 2: no snapshot yet, the resumed run starts over
    "mid-window before any snapshot": (5, None),
}


@pytest.mark.parametrize("point", KILL_POINTS, ids=list(KILL_POINTS))
def test_sigkill_then_resume_is_bitwise_equal(point, tmp_path, uninterrupted):
    stop_at, snapshot = KILL_POINTS[point]
    out, calls = tmp_path / "run", tmp_path / "calls.log"
    kill_when_stopped(argv(out), tmp_path / "err", KILL_LOG=str(calls), STOP_AT=str(stop_at))
    assert calls.read_text().split()[-1] == str(stop_at)  # killed where intended
    assert snapshot_step(out) == snapshot
    train_ok(argv(out, "--resume"))
    assert_same_run(out, uninterrupted / "fixed")


def test_sigkill_while_writing_a_snapshot_keeps_the_last_good_one(tmp_path, uninterrupted):
    out = tmp_path / "run"
    torn = argv(out, launcher=(str(HERE / "torn_write_child.py"),))
    # the 2nd write is the snapshot of step 5, killed with half of it on disk
    kill_when_stopped(torn, tmp_path / "err", STOP_IN_WRITE="2")
    [temp] = glob.glob(str(out / ".*tmp*"))
    assert 0 < os.path.getsize(temp) < os.path.getsize(out / "snapshot.pt")
    assert snapshot_step(out) == 3  # the previous snapshot, whole and readable
    train_ok(argv(out, "--resume"))
    assert_same_run(out, uninterrupted / "fixed")


def test_resume_keeps_the_adopted_auto_micro_batch(tmp_path, uninterrupted):
    """auto adopts micro-batch 2 at step 1 (10 and 5 fail); a resumed run must not search again."""
    ref = read_csv(str(uninterrupted / "auto" / "metrics.csv"))
    assert [r["oom_retries"] for r in ref] == ["2"] + ["0"] * 9
    assert {r["micro_batch_size"] for r in ref} == {"2"}
    out, calls = tmp_path / "run", tmp_path / "calls.log"
    # step 1 starts 7 micro-batches (10 and 5 fail, then 5 x 2), later steps 5 each:
    # micro-batch 30 is the third of step 6, after the snapshot of step 5
    stop = {"KILL_LOG": str(calls), "STOP_AT": "30", "OOM_ABOVE": "4"}
    kill_when_stopped(argv(out, micro="auto"), tmp_path / "err", **stop)
    saved = torch.load(out / "snapshot.pt", weights_only=True)
    assert (saved["step"], saved["engine"]["sizing"]["size"]) == (5, 2)
    train_ok(argv(out, "--resume", micro="auto"), OOM_ABOVE="4")
    assert_same_run(out, uninterrupted / "auto")

"""A really full disk at a snapshot or at ``model.pt``: one line saying what the file needs and
what is free, checked before anything is written or deleted (Note [atomic snapshot] in
bigbatch.app.folder); every snapshot on disk stays, and ``--resume`` finishes the run once
there is room.

The run folder is on a small tmpfs mounted for the test (as root; skipped elsewhere), and the
task itself fills the filesystem at a chosen micro-batch (``tasks.faulty``): 10 steps of 3
micro-batches (calls 1-30), then the final evaluation (calls 31-40).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import runs
import torch

from bigbatch.app.snapshot import read_snapshot

pytestmark = pytest.mark.slow  # mounts a tmpfs, runs children

FIELDS = r"needs (\d+\.\d+ KiB), (\d+ B|\d+\.\d+ KiB) free on its disk: "


def train(out: Path, *extra: str, **fill: str):
    return runs.run(runs.argv(out, "--save-every", "1", *extra, task="faulty"), **fill)


def test_a_snapshot_that_does_not_fit_keeps_every_snapshot(tmp_path):
    """At call 14 (step 5) the disk fills, leaving 8 KiB: a row of metrics.csv fits, the
    snapshot of step 5 does not. Refused before its temporary file is written or the
    snapshot of step 4 renamed, or the one of step 3 deleted."""
    with runs.tmpfs(tmp_path / "small") as mount:
        out, filler = mount / "run", mount / "filler"
        done = train(out, FILL_DISK_AT="14", FILL_DISK=str(filler), FILL_LEAVE="8192")
        assert done.returncode == 2
        line = runs.one_line(done.stderr)
        match = re.fullmatch(
            f"bigbatch train: error: {out / 'snapshot.pt'}: {FIELDS}the previous snapshot is "
            "kept; free space and run again with --resume",
            line,
        )
        assert match, line
        need, free = (runs.parse_size(g) for g in match.groups())
        assert free <= 8192 < need
        assert sorted(os.listdir(out)) == [
            ".lock", "metrics.csv", "snapshot-00000003.pt", "snapshot.pt", "tensorboard",
            "train.log",
        ]  # fmt: skip
        assert read_snapshot(str(out / "snapshot.pt")).step == 4
        assert read_snapshot(str(out / "snapshot-00000003.pt")).step == 3
        os.remove(filler)
        done = train(out, "--resume")
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith(f"resuming from step 4 of 10 ({out / 'snapshot.pt'})\n")
        assert read_snapshot(str(out / "snapshot.pt")).step == 10
        assert os.path.getsize(out / "snapshot.pt") <= need  # the estimate is an upper bound


def test_a_model_pt_that_does_not_fit_is_said_and_written_by_resume(tmp_path):
    """At call 31 (the final evaluation, after the snapshot of step 10) the disk fills."""
    reference = tmp_path / "reference"
    assert train(reference).returncode == 0
    with runs.tmpfs(tmp_path / "small") as mount:
        out, filler = mount / "run", mount / "filler"
        done = train(out, FILL_DISK_AT="31", FILL_DISK=str(filler))
        assert done.returncode == 2
        line = runs.one_line(done.stderr)
        assert re.fullmatch(
            f"bigbatch train: error: {out / 'model.pt'}: {FIELDS}model.pt was not written; the "
            "last snapshot holds the trained model: free space and run again with --resume",
            line,
        ), line
        assert not (out / "model.pt").exists() and not list(out.glob(".*tmp*"))
        assert read_snapshot(str(out / "snapshot.pt")).step == 10
        os.remove(filler)
        done = train(out, "--resume")
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("resuming from step 10 of 10")
        got, want = torch.load(out / "model.pt"), torch.load(reference / "model.pt")
        assert all(torch.equal(got[k], want[k]) for k in want)

"""NaN and inf never reach the weights or a snapshot (Note [non-finite runs] in train.loop).

The runs are the CLI's (``bigbatch.app.cli.main`` in this process: exit code and stderr as a user
sees them) on ``tasks.faulty``, whose loss is NaN at a micro-batch set by $NAN_AT, or on
``tasks.nan_data``, which holds a NaN sample. 50 samples, batch 10 cut 4+4+2 (3 micro-batches per
step), 10 steps, snapshots after steps 3, 5, 6, 9 and 10: a NaN at micro-batch 14 is in step 5.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import runs
import tasks
import torch

import bigbatch
from bigbatch.app.cli import main
from bigbatch.app.log import read_csv
from bigbatch.app.snapshot import read_snapshot


def train(capsys, out, *extra, task="faulty"):
    """``bigbatch train`` in this process; returns (exit code, stderr)."""
    code = main(runs.argv(out, *extra, task=task)[3:])
    return code, capsys.readouterr().err


def _steps(out):
    return [int(r["step"]) for r in read_csv(str(out / "metrics.csv"))]


def _assert_good_snapshot(out, step):
    snapshot = read_snapshot(str(out / "snapshot.pt"))  # loads as a resume does (weights_only)
    assert snapshot.step == step
    assert all(torch.isfinite(v).all() for v in snapshot.model.values())


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """``tasks.faulty`` without a fault: the run a resumed one must equal."""
    out = tmp_path_factory.mktemp("clean") / "run"
    assert main(runs.argv(out, task="faulty")[3:]) == 0
    return out


def test_a_nan_loss_stops_the_run_and_resume_continues_from_the_last_good_snapshot(
    tmp_path, capsys, monkeypatch, clean_run
):
    out = tmp_path / "run"
    monkeypatch.setenv("NAN_AT", "14")
    code, err = train(capsys, out)
    assert code == 2
    line = runs.one_line(err)
    assert line.startswith("bigbatch train: error: step 5: the window's loss is nan (count 10); ")
    assert f"The last good snapshot is {out / 'snapshot.pt'} (step 3): fix the cause" in line
    assert "run again with --resume, or pass --nonfinite skip." in line
    assert not (out / "model.pt").exists() and not (out / "summary.json").exists()
    _assert_good_snapshot(out, 3)
    assert _steps(out) == [1, 2, 3, 4]  # step 5 was never applied
    monkeypatch.delenv("NAN_AT")  # the cause removed
    code, err = train(capsys, out, "--resume")
    assert code == 0, err
    runs.assert_same_run(out, clean_run)


def test_nan_data_names_the_step(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("NAN_SAMPLE", "34")  # not shuffled: samples 30-39 are step 4
    code, err = train(capsys, out, "--no-shuffle", task="nan_data")
    assert code == 2
    line = runs.one_line(err)
    assert re.match(r"bigbatch train: error: step 4: the window's loss is nan ", line), line
    assert f"The last good snapshot is {out / 'snapshot.pt'} (step 3)" in line
    assert not (out / "model.pt").exists()
    _assert_good_snapshot(out, 3)


def test_a_nan_before_any_snapshot_says_there_is_none(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NAN_AT", "2")
    code, err = train(capsys, tmp_path / "run")
    assert code == 2
    assert runs.one_line(err).endswith(
        "No snapshot was written yet: fix the cause and start again."
    )
    assert os.listdir(tmp_path / "run") and not (tmp_path / "run" / "snapshot.pt").exists()


def test_skip_skips_and_counts(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("NAN_AT", "14")
    code, err = train(capsys, out, "--nonfinite", "skip")
    assert code == 0, err
    rows = read_csv(str(out / "metrics.csv"))
    assert [(r["skipped"], r["nonfinite"]) for r in rows] == [("0", "0")] * 4 + [("1", "1")] + [
        ("0", "0")
    ] * 5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps"] == 10
    assert all(torch.isfinite(v).all() for v in torch.load(out / "model.pt").values())


def test_summary_json_stays_valid_when_the_last_loss_is_nan(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("NAN_AT", "30")  # the last micro-batch of the last step
    code, err = train(capsys, out, "--nonfinite", "skip")
    assert code == 0, err

    def refuse(name):
        raise AssertionError(f"summary.json holds {name}, which is not JSON")

    summary = json.loads((out / "summary.json").read_text(), parse_constant=refuse)
    assert summary["final_loss"] is None and summary["skipped_steps"] == 1


def test_apply_never_writes_nan_weights(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("NAN_AT", "14")
    code, err = train(capsys, out, "--nonfinite", "apply")
    assert code == 2
    line = runs.one_line(err)
    assert line.startswith(
        "bigbatch train: error: step 5: the weights hold NaN / inf (nonfinite='apply'); a "
        "snapshot was not written. The last good snapshot is "
    ), line
    assert not (out / "model.pt").exists()
    _assert_good_snapshot(out, 3)


def test_steps_skipped_in_a_row_stop_the_run(tmp_path, capsys, monkeypatch):
    from bigbatch.app.loop import MAX_SKIPPED_IN_A_ROW

    out = tmp_path / "run"
    monkeypatch.setenv("NAN_FROM", "4")  # every step from step 2 on
    code, err = train(capsys, out, "--nonfinite", "skip", "--epochs", "5")
    assert code == 2
    last = 1 + MAX_SKIPPED_IN_A_ROW
    assert runs.one_line(err).startswith(
        f"bigbatch train: error: step {last}: the last {MAX_SKIPPED_IN_A_ROW} steps all had NaN"
    )
    assert not (out / "model.pt").exists()


def test_a_diverging_learning_rate_stops_before_the_weights_overflow(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = train(capsys, out, "--lr", "1e300")
    assert code == 2
    line = runs.one_line(err)
    assert re.match(r"bigbatch train: error: step \d+: the window's (loss|gradient norm) is", line)
    assert not (out / "model.pt").exists()
    for name in os.listdir(out):
        if name.startswith("snapshot"):
            assert all(
                torch.isfinite(v).all() for v in read_snapshot(str(out / name)).model.values()
            )


@pytest.mark.parametrize("lr", ["inf", "nan", "-1"])
def test_a_learning_rate_that_is_not_finite_is_refused_up_front(tmp_path, capsys, lr):
    out = tmp_path / "run"
    code, err = train(capsys, out, "--lr", lr)
    assert code == 2
    assert runs.one_line(err) == (
        f"bigbatch train: error: lr={float(lr)!r} is not allowed: use a positive number "
        "(finite), e.g. lr=3e-4."
    )
    assert not out.exists()


@pytest.mark.parametrize("keep", [1, 3])
def test_keep_snapshots_keeps_the_newest_n(tmp_path, keep):
    out = tmp_path / "run"
    torch.manual_seed(0)
    bigbatch.fit(
        tasks.classify(), batch_size=10, steps=10, save_every=1, keep_snapshots=keep,
        out=str(out), quiet=True,
    )  # fmt: skip
    names = sorted(n for n in os.listdir(out) if n.startswith("snapshot"))
    older = [f"snapshot-{step:08d}.pt" for step in range(11 - keep, 10)]
    assert names == sorted(["snapshot.pt", *older])
    for name in names:
        step = 10 if name == "snapshot.pt" else int(name[9:17])
        assert read_snapshot(str(out / name)).step == step

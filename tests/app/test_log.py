"""What a run records: tokens/s on the progress bar and in the CSV for a token loss, and
TensorBoard event files (tensorboard is installed in the test environment)."""

from __future__ import annotations

import os

import pytest
import tasks
import torch

import bigbatch
from bigbatch.app.log import read_csv


@pytest.mark.needs("rich")
def test_token_loss_reports_tokens_per_second(tmp_path, capsys):
    torch.manual_seed(0)
    task = tasks.tiny_lm()
    summary = bigbatch.fit(task, batch_size=8, micro_batch_size=3, steps=3, out=str(tmp_path))
    err = capsys.readouterr().err
    assert "tokens/s" in err and "samples/s" not in err  # the bar speaks in tokens
    rows = read_csv(os.path.join(tmp_path, "metrics.csv"))
    ids, labels = task.train_data.tensors
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))  # seed 0, epoch 0
    first = labels[order[:8], 1:]  # shifted: the first position is never a target
    assert float(rows[0]["count"]) == int((first != -100).sum())  # real tokens, not samples
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    assert summary.tokens == sum(float(r["count"]) for r in rows)


@pytest.mark.needs("rich")
def test_samples_loss_reports_samples_per_second(tmp_path, capsys):
    bigbatch.fit(tasks.classify(), batch_size=10, steps=2, out=str(tmp_path))
    err = capsys.readouterr().err
    assert "samples/s" in err and "tokens/s" not in err
    assert all(r["tokens_per_s"] == "" for r in read_csv(os.path.join(tmp_path, "metrics.csv")))


def test_tensorboard_event_file_holds_one_point_per_step(tmp_path):
    pytest.importorskip("tensorboard")  # in the test extra; optional for users
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    bigbatch.fit(tasks.classify(), batch_size=10, steps=4, out=str(tmp_path), quiet=True)
    folder = tmp_path / "tensorboard"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(folder))
    events = EventAccumulator(str(folder))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    rows = read_csv(os.path.join(tmp_path, "metrics.csv"))
    assert [e.value for e in loss] == pytest.approx([float(r["loss"]) for r in rows], rel=1e-6)
    assert {"train/lr", "train/samples_per_s", "train/peak_bytes"} <= set(events.Tags()["scalars"])


@pytest.mark.needs("matplotlib")
def test_the_plot_draws_the_memory_budget(tmp_path, monkeypatch):
    """Issue 37: the report's plot did not draw --memory-budget, what a step may add."""
    from bigbatch.app import report

    out = tmp_path / "run"
    bigbatch.fit(tasks.classify(), out=str(out), memory_budget="1GiB", steps=2, quiet=True)
    figures = []
    monkeypatch.setattr(report, "save_png", lambda fig, path: figures.append(fig) or path)
    report.report(str(out), str(tmp_path / "report.png"))
    bottom = figures[0].axes[1]
    drawn = [line for line in bottom.lines if line.get_label() == "memory budget"]
    assert drawn and list(drawn[0].get_ydata()) == [1024, 1024]  # MiB

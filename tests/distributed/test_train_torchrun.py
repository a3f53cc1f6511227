"""``bigbatch train`` under a real ``torchrun --nproc_per_node 2`` (gloo, CPU) equals one process.

The final ``model.pt`` of two ranks must equal the one-process run on the same effective batch
(cut differently) to float64 rounding; rank 0 alone writes the run folder; the process group is
left at the end; a batch the ranks cannot share is refused with a message naming the values.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torchrun_runs import (
    BIGBATCH,
    FORKED,
    HERE,
    TORCHRUN,
    launch,
    start_and_stop_rank0,
    wait_for_call,
)

from bigbatch.app.log import read_csv

pytestmark = pytest.mark.slow  # real torchrun ranks

TASK = f"{HERE.parent / 'app' / 'tasks.py'}:classify"  # float64 MLP, 50 samples, no dropout


def _train(launcher: list[str], out: Path, *flags: str) -> None:
    done = launch([*launcher, "train", TASK, "--out", str(out), "--quiet", "--seed", "3", *flags])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _max_relative_error(want: dict, got: dict) -> float:
    return max(float((got[k] - v).abs().max() / v.abs().max()) for k, v in want.items())


@pytest.mark.parametrize(
    ("batch_size", "micro_batch_size"),
    [("10", "3"), ("9", "auto")],  # 9 on 2 ranks: shares of 5 and 4; 50 = 5 x 9 + 5 at the end
)
def test_two_ranks_equal_one_process(tmp_path, batch_size, micro_batch_size):
    steps = ["--batch-size", batch_size, "--epochs", "2", "--lr", "0.01"]
    _train([sys.executable, "-m", "bigbatch"], tmp_path / "one", *steps, "--micro-batch-size", "4")
    # the child runs `bigbatch train` (cli.main) and then checks the process group was left
    child = [*TORCHRUN, str(HERE / "train_child.py")]
    _train(child, tmp_path / "two", *steps, "--micro-batch-size", micro_batch_size)

    one, two = (torch.load(tmp_path / d / "model.pt") for d in ("one", "two"))
    assert _max_relative_error(one, two) < 1e-10
    rows = read_csv(str(tmp_path / "two" / "metrics.csv"))
    want = read_csv(str(tmp_path / "one" / "metrics.csv"))
    assert [int(r["step"]) for r in rows] == list(range(1, len(want) + 1))  # one row per step
    assert [int(r["samples"]) for r in rows] == [int(r["samples"]) for r in want]
    assert all(r["tokens_per_s"] == "" for r in rows)  # the samples are global, the count too
    assert [float(r["loss"]) for r in rows] == pytest.approx([float(r["loss"]) for r in want])
    # rank 0 alone writes: one header (read_csv would choke on a second), one event file
    if importlib.util.find_spec("tensorboard") is not None:  # optional for users
        assert len(os.listdir(tmp_path / "two" / "tensorboard")) == 1
    assert (tmp_path / "two" / "summary.json").exists()
    for rank in (0, 1):
        assert (tmp_path / "two" / f"teardown-rank{rank}").read_text() == "left"


def test_a_batch_smaller_than_the_ranks_is_refused(tmp_path):
    # 50 samples at 7: the last batch of the epoch holds 1 sample for 2 ranks
    done = launch([*FORKED, BIGBATCH, "train", TASK, "--batch-size", "7", "--epochs", "1",
                 "--out", str(tmp_path), "--quiet"])  # fmt: skip
    assert done.returncode != 0
    assert (
        "bigbatch train: error: the last batch of each epoch holds 1 sample(s) (50 samples at "
        "batch_size=7), fewer than the 2 ranks: every rank needs at least one. Use e.g. "
        "--batch-size 6" in done.stderr
    )
    assert not (tmp_path / "metrics.csv").exists()


def test_killed_mid_window_resumes_bitwise_equal(tmp_path):
    """Dropout, and ranks that draw different amounts of randomness (batch 9: shares of 5 and 4):
    rank 0 is killed mid-window, both workers SIGKILLed, and ``--resume`` under torchrun ends
    bitwise equal to the uninterrupted two-rank run (each rank gets its own random state back)."""
    task = f"{HERE.parent / 'app' / 'tasks.py'}:killable"
    flags = ["train", task, "--quiet", "--seed", "3", "--batch-size", "9", "--micro-batch-size",
             "4", "--epochs", "2", "--lr", "0.05", "--save-every", "3"]  # fmt: skip
    whole, run = tmp_path / "whole", tmp_path / "run"
    done = launch([*FORKED, BIGBATCH, *flags, "--out", str(whole)])
    assert done.returncode == 0, done.stderr[-3000:]

    # rank 0 starts micro-batches 4+1 per step: number 8 is the second of step 4 (snapshot: 3)
    proc, workers = start_and_stop_rank0([*flags, "--out", str(run)], tmp_path, stop_at=8)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=60) != 0
    assert torch.load(run / "snapshot.pt", weights_only=True)["step"] == 3

    done = launch([*FORKED, BIGBATCH, *flags, "--out", str(run), "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    want, got = torch.load(whole / "model.pt"), torch.load(run / "model.pt")
    assert all(torch.equal(want[k], got[k]) for k in want)
    rows, ref = read_csv(str(run / "metrics.csv")), read_csv(str(whole / "metrics.csv"))
    assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], r["loss"]) for r in ref]


def test_sigterm_to_the_launcher_and_every_rank_snapshots_and_resumes(tmp_path):
    """What pkill, SLURM and Kubernetes do: SIGTERM to every process of the job. Each rank gets
    it twice, from the sender and from torchrun forwarding its own; the second is a copy of the
    first, so the ranks finish the step in flight, snapshot it and stop (143), and ``--resume``
    continues. Before, rank 0 took torchrun's copy as a second signal and stopped at once: no
    snapshot of step 4, the run set back to step 3's. The order is fixed: rank 0 stops itself
    at micro-batch 7 (step 4's first: 4 + 1 per step), the sender's SIGTERM reaches both ranks,
    rank 0 runs on to micro-batch 8 and stops there, the launcher gets SIGTERM and forwards it,
    then rank 0 continues and handles the copy."""
    task = f"{HERE.parent / 'app' / 'tasks.py'}:killable"
    flags = ["train", task, "--quiet", "--seed", "3", "--batch-size", "9", "--micro-batch-size",
             "4", "--epochs", "2", "--lr", "0.05", "--save-every", "3", "--out", str(tmp_path)]  # fmt: skip
    err = tmp_path / "stderr"
    proc, (rank0, rank1) = start_and_stop_rank0(flags, tmp_path, 7, err, later=(8,))
    for pid in (rank0, rank1):  # the sender's signal (rank 0 handles it as it continues)
        os.kill(pid, signal.SIGTERM)
    os.kill(rank0, signal.SIGCONT)
    wait_for_call(tmp_path, 0, 8)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher forwards it to both ranks
    deadline = time.monotonic() + 60
    while err.read_text().count("via signal SIGTERM") < 2:  # torchrun's log: both forwarded
        assert time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.05)
    os.kill(rank0, signal.SIGCONT)
    proc.wait(timeout=120)
    assert "stopped by SIGTERM after step 4 of 12; snapshot written to" in err.read_text()
    assert "interrupted" not in err.read_text()
    assert torch.load(tmp_path / "snapshot.pt", weights_only=True)["step"] == 4
    done = launch([*FORKED, BIGBATCH, *flags, "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from step 4 of 12" in done.stdout
    assert [int(r["step"]) for r in read_csv(str(tmp_path / "metrics.csv"))] == list(range(1, 13))

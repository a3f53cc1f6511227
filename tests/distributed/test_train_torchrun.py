"""``bigbatch train`` under a real ``torchrun --nproc_per_node 2`` (gloo, CPU) equals one process.

The final ``model.pt`` of two ranks must equal the one-process run on the same effective batch
(cut differently) to float64 rounding; rank 0 alone writes the run folder; the process group is
left at the end; a batch the ranks cannot share is refused with a message naming the values.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bigbatch.train.log import read_csv

pytestmark = pytest.mark.slow  # real torchrun ranks

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"
TASK = f"{HERE.parent / 'train' / 'tasks.py'}:classify"  # float64 MLP, 50 samples, no dropout
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's variables (torchrun sets its own), plus ``extra``."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(OMP_NUM_THREADS="1", **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=120)


def _train(launcher: list[str], out: Path, *flags: str) -> None:
    done = _run([*launcher, "train", TASK, "--out", str(out), "--quiet", "--seed", "3", *flags])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def start_and_stop_rank0(
    bigbatch_args: list[str], tmp_path: Path, stop_at: int, stderr: Path | None = None
) -> tuple[subprocess.Popen, list[int]]:
    """Start ``torchrun ... -m bigbatch *bigbatch_args`` on a ``tasks.killable`` task and wait
    until rank 0 has stopped itself (SIGSTOP) at its ``stop_at``-th micro-batch; return the
    launcher and the two workers' PIDs (rank 0 first; torchrun starts each in its own session).
    """
    env = _env(KILL_LOG=str(tmp_path / "calls-{rank}.log"), STOP_AT=str(stop_at))
    err = open(stderr, "w") if stderr is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen([*TORCHRUN, "-m", "bigbatch", *bigbatch_args], env=env,
                            stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    logs = [tmp_path / f"calls-{rank}.log" for rank in (0, 1)]
    deadline = time.monotonic() + 120
    while not (logs[0].exists() and logs[0].read_text().split()[-1:] == [str(stop_at)]):
        assert proc.poll() is None, "the run ended before the kill point"
        assert time.monotonic() < deadline, "the run never reached the kill point"
        time.sleep(0.05)
    while not logs[1].exists():  # rank 1 has started its first micro-batch too
        assert time.monotonic() < deadline, "rank 1 never started"
        time.sleep(0.05)
    return proc, [int(log.read_text().split()[0]) for log in logs]


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
    done = _run([*TORCHRUN, "-m", "bigbatch", "train", TASK, "--batch-size", "7", "--epochs", "1",
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
    task = f"{HERE.parent / 'train' / 'tasks.py'}:killable"
    flags = ["train", task, "--quiet", "--seed", "3", "--batch-size", "9", "--micro-batch-size",
             "4", "--epochs", "2", "--lr", "0.05", "--save-every", "3"]  # fmt: skip
    whole, run = tmp_path / "whole", tmp_path / "run"
    done = _run([*TORCHRUN, "-m", "bigbatch", *flags, "--out", str(whole)])
    assert done.returncode == 0, done.stderr[-3000:]

    # rank 0 starts micro-batches 4+1 per step: number 8 is the second of step 4 (snapshot: 3)
    proc, workers = start_and_stop_rank0([*flags, "--out", str(run)], tmp_path, stop_at=8)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=60) != 0
    assert torch.load(run / "snapshot.pt", weights_only=True)["step"] == 3

    done = _run([*TORCHRUN, "-m", "bigbatch", *flags, "--out", str(run), "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    want, got = torch.load(whole / "model.pt"), torch.load(run / "model.pt")
    assert all(torch.equal(want[k], got[k]) for k in want)
    rows, ref = read_csv(str(run / "metrics.csv")), read_csv(str(whole / "metrics.csv"))
    assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], r["loss"]) for r in ref]

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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bigbatch.train.log import read_csv

pytestmark = pytest.mark.slow  # child processes killed with SIGKILL

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TASK = f"{HERE / 'tasks.py'}:killable"
SETTINGS = ["--batch-size", "10", "--epochs", "2", "--lr", "0.05", "--save-every", "3",
            "--seed", "3", "--quiet"]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)]), **extra}


def _argv(out: Path, micro: str, *extra: str, launcher: tuple[str, ...] = ("-m", "bigbatch")):
    """``bigbatch train`` on the killable task with SETTINGS (or ``launcher`` instead of ``-m``)."""
    return [sys.executable, *launcher, "train", TASK, *SETTINGS, "--micro-batch-size", micro,
            "--out", str(out), *extra]  # fmt: skip


def _train(out: Path, micro: str, *extra: str, **env: str) -> None:
    argv = _argv(out, micro, *extra)
    done = subprocess.run(argv, env=_env(**env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _kill_when_stopped(argv: list[str], env: dict[str, str], log: Path) -> None:
    """Start ``argv``; when it has stopped itself, SIGKILL it. Fails if it ends on its own."""
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 300
    while True:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the child never reached the kill point: {log.read_text()[-3000:]}")
        time.sleep(0.02)
    assert os.WIFSTOPPED(status), (
        f"the child ended before the kill point: {log.read_text()[-3000:]}"
    )
    os.kill(proc.pid, signal.SIGKILL)
    _, status = os.waitpid(proc.pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    proc.returncode = -signal.SIGKILL  # reaped above


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference runs, never killed: fixed micro-batch 4, and auto under simulated OOMs."""
    root = tmp_path_factory.mktemp("uninterrupted")
    _train(root / "fixed", "4")
    _train(root / "auto", "auto", OOM_ABOVE="4")
    return root


def _snapshot_step(out: Path) -> int | None:
    path = out / "snapshot.pt"
    return int(torch.load(path, weights_only=True)["step"]) if path.exists() else None


def _assert_same_run(got: Path, want: Path) -> None:
    """model.pt bitwise equal; metrics.csv one row per step, equal losses and micro-batches."""
    a, b = torch.load(got / "model.pt"), torch.load(want / "model.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ from the uninterrupted run"
    rows, ref = read_csv(str(got / "metrics.csv")), read_csv(str(want / "metrics.csv"))
    assert [int(r["step"]) for r in rows] == list(range(1, 11))
    for key in ("loss", "grad_norm", "lr", "samples", "micro_batch_size", "oom_retries"):
        assert [r[key] for r in rows] == [r[key] for r in ref], key
    assert not glob.glob(str(got / ".*tmp*")), "a stale temporary file was left"


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
    stop_at, snapshot_step = KILL_POINTS[point]
    out, calls = tmp_path / "run", tmp_path / "calls.log"
    env = _env(KILL_LOG=str(calls), STOP_AT=str(stop_at))
    _kill_when_stopped(_argv(out, "4"), env, tmp_path / "err")
    assert calls.read_text().split()[-1] == str(stop_at)  # killed where intended
    assert _snapshot_step(out) == snapshot_step
    _train(out, "4", "--resume")
    _assert_same_run(out, uninterrupted / "fixed")


def test_sigkill_while_writing_a_snapshot_keeps_the_last_good_one(tmp_path, uninterrupted):
    out = tmp_path / "run"
    argv = _argv(out, "4", launcher=(str(HERE / "torn_write_child.py"),))
    # the 2nd write is the snapshot of step 5, killed with half of it on disk
    _kill_when_stopped(argv, _env(STOP_IN_WRITE="2"), tmp_path / "err")
    [temp] = glob.glob(str(out / ".*tmp*"))
    assert 0 < os.path.getsize(temp) < os.path.getsize(out / "snapshot.pt")
    assert _snapshot_step(out) == 3  # the previous snapshot, whole and readable
    _train(out, "4", "--resume")
    _assert_same_run(out, uninterrupted / "fixed")


def test_resume_keeps_the_adopted_auto_micro_batch(tmp_path, uninterrupted):
    """auto adopts micro-batch 2 at step 1 (10 and 5 fail); a resumed run must not search again."""
    ref = read_csv(str(uninterrupted / "auto" / "metrics.csv"))
    assert [r["oom_retries"] for r in ref] == ["2"] + ["0"] * 9
    assert {r["micro_batch_size"] for r in ref} == {"2"}
    out, calls = tmp_path / "run", tmp_path / "calls.log"
    # step 1 starts 7 micro-batches (10 and 5 fail, then 5 x 2), later steps 5 each:
    # micro-batch 30 is the third of step 6, after the snapshot of step 5
    env = _env(KILL_LOG=str(calls), STOP_AT="30", OOM_ABOVE="4")
    _kill_when_stopped(_argv(out, "auto"), env, tmp_path / "err")
    saved = torch.load(out / "snapshot.pt", weights_only=True)
    assert (saved["step"], saved["engine"]["sizing"]["size"]) == (5, 2)
    _train(out, "auto", "--resume", OOM_ABOVE="4")
    _assert_same_run(out, uninterrupted / "auto")

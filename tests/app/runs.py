"""``bigbatch train`` in child processes, for the tests that provoke real faults.

The children are forked from a parent that has imported torch and bigbatch (``forks.py``):
real processes, without paying for an interpreter's start-up each time.

A child runs the CLI on a task of ``tasks.py``; ``tasks.killable`` stops itself (SIGSTOP) at the
micro-batch $STOP_AT names, so a test knows where the child is when it signals, kills or races
it. The common run: 50 samples, batch 10 cut 4+4+2 (3 micro-batches per step), 2 epochs = 10
steps = 30 micro-batches; snapshots after steps 3, 5 (end of epoch), 6, 9 and 10.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forks
import pytest
import torch
from mounts import tmpfs  # noqa: F401  (runs.tmpfs for the run tests)

from bigbatch.app.log import read_csv

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TASKS = HERE / "tasks.py"
SETTINGS = ["--batch-size", "10", "--epochs", "2", "--lr", "0.05", "--save-every", "3",
            "--seed", "3", "--quiet"]  # fmt: skip


def env(**extra: str) -> dict[str, str]:
    """The environment of a child: this checkout's bigbatch and the test tasks importable."""
    base = {k: v for k, v in os.environ.items() if k not in ("STOP_AT", "KILL_LOG", "NAN_AT")}
    return {**base, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)]), **extra}


def argv(
    out: Path, *extra: str, task: str = "killable", micro: str = "4",
    launcher: tuple[str, ...] = ("-m", "bigbatch"), tasks: Path = TASKS,
) -> list[str]:  # fmt: skip
    """``python -m bigbatch train TASK SETTINGS --micro-batch-size micro --out out extra...``
    (``launcher`` instead of ``-m bigbatch``, e.g. a script that wraps the CLI)."""
    return [sys.executable, *launcher, "train", f"{tasks}:{task}", *SETTINGS,
            "--micro-batch-size", micro, "--out", str(out), *extra]  # fmt: skip


def train_ok(args: list[str], **extra_env: str) -> None:
    """Run a child to its end and require exit code 0."""
    done = run(args, **extra_env)
    assert done.returncode == 0, done.stderr[-3000:]


def kill_when_stopped(args: list[str], err: Path, **extra_env: str) -> None:
    """Start a child; when it has stopped itself (SIGSTOP), SIGKILL it."""
    proc = start(args, err, **extra_env)
    wait_stopped(proc, err)
    kill(proc)


def run(
    args: list[str], timeout: float = 300, fresh: bool = False, **extra_env: str
) -> subprocess.CompletedProcess:
    """Run a child to its end; return it (exit code, stdout, stderr). ``fresh``: see ``forks``."""
    return forks.run(args, env(**extra_env), timeout=timeout, fresh=fresh)


def start(args: list[str], err: Path, **extra_env: str) -> forks.Child | subprocess.Popen:
    """Start a child whose stderr goes to the file ``err``."""
    return forks.python(args, env(**extra_env), stderr=str(err))


def wait_stopped(proc: forks.Child | subprocess.Popen, err: Path, timeout: float = 300) -> None:
    """Wait until the child has stopped itself (SIGSTOP); fail if it ends or never stops."""
    deadline = time.monotonic() + timeout
    while not forks.stopped(proc.pid):
        if proc.poll() is not None:
            pytest.fail(f"the child ended before its stop: {err.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the child never reached its stop: {err.read_text()[-3000:]}")
        time.sleep(0.02)


def signal_and_continue(proc: forks.Child | subprocess.Popen, *signals: int) -> None:
    """Send ``signals`` to a stopped child, then SIGCONT: it handles them as it resumes."""
    for signum in signals:
        os.kill(proc.pid, signum)
    os.kill(proc.pid, signal.SIGCONT)


def kill(proc: forks.Child | subprocess.Popen) -> None:
    """SIGKILL the child (no handler runs, nothing is flushed) and reap it."""
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def folder_state(out: Path) -> dict[str, bytes]:
    """Every file under ``out`` (relative name -> contents): what a run may not touch."""
    return {
        str(path.relative_to(out)): path.read_bytes()
        for path in sorted(out.rglob("*"))
        if path.is_file()
    }


def snapshot_step(out: Path) -> int | None:
    """The step of ``out/snapshot.pt`` (loaded as a resume would), or ``None`` without one."""
    path = out / "snapshot.pt"
    return int(torch.load(path, weights_only=True)["step"]) if path.exists() else None


def one_line(stderr: str) -> str:
    """The one line a failed run printed (asserted: one line, no traceback)."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def assert_same_run(got: Path, want: Path, steps: int = 10) -> None:
    """model.pt bitwise equal; metrics.csv one row per step, the same losses and micro-batches."""
    a, b = torch.load(got / "model.pt"), torch.load(want / "model.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ from the uninterrupted run"
    rows, ref = read_csv(str(got / "metrics.csv")), read_csv(str(want / "metrics.csv"))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    for key in ("loss", "grad_norm", "lr", "samples", "micro_batch_size", "oom_retries"):
        assert [r[key] for r in rows] == [r[key] for r in ref], key
    assert not list(got.glob(".*tmp*")), "a stale temporary file was left"


def parse_size(text: str) -> float:
    """Bytes in ``"12.50 KiB"`` or ``"0 B"`` (``format_bytes``'s words)."""
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]

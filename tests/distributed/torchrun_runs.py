"""``bigbatch train`` under a real ``torchrun --nproc_per_node 2``: the launcher, the children's
environment, and stopping rank 0 at a chosen micro-batch (shared by the torchrun trainer tests).

``TORCHRUN`` starts each rank as torchrun does by default, a new interpreter (``subprocess``).
``FORKED`` is torchrun with its own ``--run-path --start-method fork``: the same launcher, agent,
rendezvous and failure handling, each rank a process that the agent forks and that runs the
script with ``runpy`` (the launcher is forked from the test worker's fork server, which has
imported torch and bigbatch, so a rank starts without two seconds of imports); these runs also
check that ``--run-path`` ends at all (its agent waits for each rank's return value, which the
``os._exit`` of Note [gloo exit] never gave: it hung). ``BIGBATCH`` is ``-m bigbatch`` as the
path that ``--run-path`` takes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import forks

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
FORKED = [*TORCHRUN, "--run-path", "--start-method", "fork"]
BIGBATCH = str(SRC / "bigbatch" / "__main__.py")


def env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's variables (torchrun sets its own), plus ``extra``."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(OMP_NUM_THREADS="1", **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def launch(args: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``args`` (``TORCHRUN ...``) to its end: the launcher is forked (``forks.py``), the ranks
    are the processes torchrun starts (new interpreters, or forked under ``FORKED``)."""
    forks.needs_the_command_line()  # every launch here runs bigbatch's command line
    return forks.run(args, env(**extra), timeout=120)


def start_and_stop_rank0(
    bigbatch_args: list[str], tmp_path: Path, stop_at: int, stderr: Path | None = None,
    later: tuple[int, ...] = (),
) -> tuple[forks.Child, list[int]]:  # fmt: skip
    """Start ``FORKED BIGBATCH *bigbatch_args`` on a ``tasks.killable`` task and wait
    until rank 0 has stopped itself (SIGSTOP) at its ``stop_at``-th micro-batch; return the
    launcher and the two workers' PIDs (rank 0 first; torchrun starts each in its own session).
    Rank 0 stops itself again at the micro-batches ``later`` (``wait_for_call`` waits there).
    """
    stops = ",".join(map(str, (stop_at, *later)))
    child_env = env(KILL_LOG=str(tmp_path / "calls-{rank}.log"), STOP_AT=stops)
    err = str(stderr) if stderr is not None else None
    forks.needs_the_command_line()
    proc = forks.python([*FORKED, BIGBATCH, *bigbatch_args], child_env, stderr=err)
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


def wait_for_call(tmp_path: Path, rank: int, call: int, timeout: float = 120) -> None:
    """Wait until ``rank`` has started its ``call``-th micro-batch (``start_and_stop_rank0``)."""
    log, deadline = tmp_path / f"calls-{rank}.log", time.monotonic() + timeout
    while log.read_text().split()[-1:] != [str(call)]:
        assert time.monotonic() < deadline, f"rank {rank} never reached micro-batch {call}"
        time.sleep(0.05)

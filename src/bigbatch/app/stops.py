"""Why a run stopped, in one line each: NaN / inf values, no memory left, a signal.

Each line names the step, what is kept on disk and what to do next (the settings to change, or
the command that continues); ``fit`` raises them, the CLI prints them (Note [error boundary]).
"""

from __future__ import annotations

import shlex
import signal
import sys

from bigbatch.app import resume
from bigbatch.app.config import TrainConfig, resolve_batch
from bigbatch.core._units import format_bytes
from bigbatch.core.oom import MemoryBudgetExceeded


class NonFiniteRun(FloatingPointError):
    """The run stopped on NaN / inf values (Note [non-finite runs] in ``train.loop``)."""


class OutOfMemoryRun(MemoryError):
    """A step ran out of memory or over ``memory_budget``; the message names what to change."""


def last_good(out: str, snapshot_step: int | None) -> str:
    """Where a run stopped on NaN / inf continues from, and how."""
    path = resume.latest_path(out)
    if path is None:
        return "No snapshot was written yet: fix the cause and start again."
    last = f" (step {snapshot_step})" if snapshot_step is not None else ""
    return (f"The last good snapshot is {path}{last}: fix the cause (data, learning rate, "
            "clipping) and run again with --resume, or pass --nonfinite skip.")  # fmt: skip


def out_of_memory_line(config: TrainConfig, step: int, exc: BaseException) -> str:
    """What ran out and which settings help, in the words of the flags (and the TOML keys)."""
    budget = config.memory_budget is not None
    if isinstance(exc, MemoryBudgetExceeded) and exc.used_bytes is not None:
        cause = (f"micro-batch {exc.micro_batch_size} used {format_bytes(exc.used_bytes)}, over "
                 f"--memory-budget {format_bytes(exc.budget_bytes or 0)}")  # fmt: skip
    elif config.micro_batch_size == "auto" and isinstance(exc, MemoryError):  # auto's floor
        return (f"step {step}: out of memory{' or over --memory-budget' if budget else ''} with "
                "--micro-batch-size auto down to 1: a single sample does not fit. "
                f"{'Use a larger --memory-budget, add' if budget else 'Add'} "
                "--gradient-checkpointing, free memory, or use a smaller model or sequence "
                "length.")  # fmt: skip
    else:
        cause = f"out of memory at micro-batch {resolve_batch(config)[1]} ({exc})"
    return (f"step {step}: {cause}. Use --micro-batch-size auto (the largest that fits), a "
            "smaller --micro-batch-size, --gradient-checkpointing, or a larger "
            "--memory-budget.")  # fmt: skip


def stopped_line(signum: int, step: int, total_steps: int, out: str, final: bool = False) -> str:
    """A run stopped by a signal after ``step`` (Note [clean stop] in ``train.signals``), or
    during the ``final`` evaluation: what is on disk and the command that continues."""
    args = sys.argv[1:]
    command = "the same call with resume=True"
    if args[:1] == ["train"]:  # the command line: say the command to type, quoted for a shell
        command = shlex.join(["bigbatch", *args, *([] if "--resume" in args else ["--resume"])])
    name, path = signal.Signals(signum).name, resume.latest_path(out)
    where = f"after step {step} of {total_steps}"
    if final:
        return (f"stopped by {name} during the final evaluation, {where}: the training is "
                f"complete, in {path}; model.pt and summary.json were not written. Evaluate and "
                f"write them with: {command}")  # fmt: skip
    return f"stopped by {name} {where}; snapshot written to {path}. Resume with: {command}"

"""How a run stops: on a signal, cleanly, after a snapshot; and why it stopped, in one line.

``StopSignals`` turns SIGINT / SIGTERM into a stop after the step in flight (Note [clean stop]);
``Stopped`` is that stop, with the exit code a shell expects. The errors that end a run say why
in one line each, naming the step, what is kept on disk and what to do next: NaN / inf
(``NonFiniteRun``, Note [non-finite runs]), no memory left (``OutOfMemoryRun``). ``fit`` raises
them, the CLI prints them (Note [error boundary] in ``app.cli``).
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

import torch

from bigbatch.app.settings import TrainConfig
from bigbatch.app.snapshot import latest_path
from bigbatch.core._units import format_bytes
from bigbatch.core.oom import MemoryBudgetExceeded
from bigbatch.distributed import launch as distributed


class Stopped(Exception):
    """The run stopped on a signal after writing a snapshot; ``exit_code`` is 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """While the ``with`` block runs, the first SIGINT / SIGTERM is noted, not raised.

    Note [clean stop]
        The first SIGINT or SIGTERM does not interrupt the optimizer step in flight: the trainer
        finishes it, writes a snapshot, prints one line saying how to resume and exits with 128 +
        the signal's number (130 for SIGINT, 143 for SIGTERM), the code a shell expects. A second
        SIGINT (a person at the keyboard) stops at once (``KeyboardInterrupt``), losing only the
        steps since the last snapshot. A second SIGTERM does not: it is a copy of the same request
        (``pkill``, SLURM, Kubernetes and systemd signal every process of a job, and torchrun
        forwards the signal it gets to each rank, so a rank often receives two), and whoever sends
        SIGTERM escalates with SIGKILL when it stops waiting. Under torchrun no signal stops a rank
        at once: a terminal's Ctrl-C reaches the launcher, which forwards it to the ranks and
        SIGKILLs those still running 30 s later. Nothing stops at once while a file of the run
        folder is being written (``StopSignals.writing``): a write torn by an exception would lose
        the snapshot the first signal asked for, so further signals wait for the write to end and
        the run then stops with that snapshot (a ``kill -9`` is always safe: Note [atomic snapshot]
        in ``app.snapshot``). A signal during the final evaluation stops it at the next batch; the
        training is complete and snapshotted, and ``--resume`` evaluates and writes ``model.pt``.
        Under torchrun the ranks agree after each step, with one small all-reduce, on whether any of
        them was signalled, so they all stop after the same step. Under ``--local-steps`` λ > 1 they
        agree only at a round's end (the ranks hold the same model only there), so the run finishes
        the round in flight, up to λ - 1 more steps, before its snapshot (Note [local rounds] in
        ``app.rounds``); that all-reduce also carries the round's own sums.

    Attributes:
        signum: the first signal received (0: none).
        again: a second signal arrived while a file was being written (``writing``).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")  # where the ranks' agreement runs (NCCL: cuda)
        self.signum, self.again, self._writing = 0, False, False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum
        elif signum != signal.SIGINT or distributed.in_group():  # a copy of the first signal
            return  # (Note [clean stop]): pkill, SLURM, torchrun forwarding it
        elif self._writing:
            self.again = True  # the write ends first (Note [clean stop])
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A file write that no signal interrupts: a second signal during it is kept for after."""
        self._writing = True
        try:
            yield
        finally:
            self._writing = False

    def requested(self, sums: Sequence[float] = ()) -> tuple[int, list[float]]:
        """The signal to stop on (0: none), the same on every rank, and ``sums`` summed over the
        ranks, in the same all-reduce (one per agreement)."""
        if not distributed.in_group():
            return self.signum, [float(s) for s in sums]
        flags = [float(self.signum == signal.SIGINT), float(self.signum == signal.SIGTERM)]
        agreed = torch.tensor([*flags, *sums], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(agreed)
        interrupted, terminated, *summed = agreed.tolist()
        return int(signal.SIGTERM if terminated else signal.SIGINT if interrupted else 0), summed


class NonFiniteRun(FloatingPointError):
    """The run stopped on NaN / inf values.

    Note [non-finite runs]
        With ``nonfinite="raise"`` (the default) the engine refuses a window whose loss or gradient
        is NaN / inf before the optimizer steps, so the weights stay those of the last good step:
        the trainer stops with one line naming the step and the last good snapshot, writes no
        ``model.pt``, and ``--resume`` continues from that snapshot. With ``"skip"`` such windows
        are skipped (``skipped`` in ``metrics.csv``) and with ``"apply"`` they are applied, but a
        run whose last ``MAX_SKIPPED_IN_A_ROW`` (``app.loop``) steps were all skipped for non-finite
        values stops too (fp16 skips steps itself, as its loss scaler does, and is held to the same
        limit), and a snapshot or ``model.pt`` is never written from weights that are not finite.
    """


class OutOfMemoryRun(MemoryError):
    """A step ran out of memory or over ``memory_budget``; the message names what to change."""


def out_of_memory_line(config: TrainConfig, step: int, exc: BaseException, lm: bool = False) -> str:
    """What ran out and which settings help, in the words of the flags (and the TOML keys);
    ``lm``: the model has an output layer the chunked head could defer."""
    over = config.memory_budget is not None
    # the chunked head cuts a language model's largest tensors (its logits), when not in use
    head = "--chunked-head, " if lm and not config.chunked_head else ""
    if isinstance(exc, MemoryBudgetExceeded) and exc.used_bytes is not None:
        cause = (
            f"micro-batch {exc.micro_batch_size} used {format_bytes(exc.used_bytes)}, over "
            f"--memory-budget {format_bytes(exc.budget_bytes or 0)}"
        )
    elif "auto" in (config.micro_batch_size, config.micro_batch_tokens) and isinstance(
        exc, MemoryError
    ):  # auto's floor: the engine's line says what one sample used
        return (
            f"step {step}: {exc} With the command line: "
            f"{'a larger --memory-budget, ' if over else ''}{head}--gradient-checkpointing."
        )
    else:
        cause = f"out of memory at micro-batch {config.batching.micro_batch_size} ({exc})"
    return (
        f"step {step}: {cause}. Use --micro-batch-size auto (the largest that fits), a "
        f"smaller --micro-batch-size, {head}--gradient-checkpointing, or a larger "
        "--memory-budget."
    )


def stopped(signum: int, step: int, total_steps: int, out: str, final: bool = False) -> Stopped:
    """The error for a run stopped by a signal after ``step`` (Note [clean stop]), or
    during the ``final`` evaluation: what is on disk and the command that continues."""
    args = sys.argv[1:]
    command = "the same call with resume=True"
    if args[:1] == ["train"]:  # the command line: say the command to type, quoted for a shell
        command = shlex.join(["bigbatch", *args, *([] if "--resume" in args else ["--resume"])])
    name, path = signal.Signals(signum).name, latest_path(out)
    where = f"after step {step} of {total_steps}"
    if final:
        return Stopped(
            f"stopped by {name} during the final evaluation, {where}: the training is "
            f"complete, in {path}; model.pt and summary.json were not written. "
            f"Evaluate and write them with: {command}",
            signum,
        )
    return Stopped(
        f"stopped by {name} {where}; snapshot written to {path}. Resume with: {command}", signum
    )

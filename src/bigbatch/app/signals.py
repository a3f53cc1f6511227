"""Stopping a run cleanly: SIGINT (Ctrl-C) and SIGTERM (schedulers, ``kill``) during training.

Note [clean stop]
    The first SIGINT or SIGTERM does not interrupt the optimizer step in flight: the trainer
    finishes it, writes a snapshot, prints one line saying how to resume and exits with
    128 + the signal's number (130 for SIGINT, 143 for SIGTERM), the code a shell expects. A
    second SIGINT (or SIGTERM) stops at once (``KeyboardInterrupt``), losing only the steps
    since the last snapshot, except while a file of the run folder is being written
    (``StopSignals.writing``): a write torn by an exception would lose the snapshot the first
    signal asked for, so further signals wait for the write to end and the run then stops
    with that snapshot (a ``kill -9`` is always safe: Note [atomic snapshot] in
    ``train.resume``). A signal during the final evaluation stops it at the next batch; the
    training is complete and snapshotted, and ``--resume`` evaluates and writes ``model.pt``.
    Under torchrun the ranks agree after each step, with one small all-reduce, on whether any
    of them was signalled, so they all stop after the same step. Under ``--local-steps`` λ > 1
    they agree only at a round's end (the ranks hold the same model only there), so the run
    finishes the round in flight, up to λ - 1 more steps, before its snapshot (Note [local
    rounds] in ``train.rounds``); that all-reduce also carries the round's own sums.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

import torch

from bigbatch.distributed import launch as distributed

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """The run stopped on a signal after writing a snapshot; ``exit_code`` is 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """While the ``with`` block runs, the first SIGINT / SIGTERM is noted, not raised (Note above).

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
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum
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
        signum = signal.SIGTERM if terminated else signal.SIGINT if interrupted else 0
        return int(signum), summed

"""What a run records, once per optimizer step (never per micro-batch).

``RunLog.step(row)`` appends one row to ``DIR/metrics.csv``, writes the numbers to TensorBoard
when it is installed (``DIR/tensorboard``), and advances the progress bar (rich, on stderr):
loss, samples/s (tokens/s when the loss counts tokens), micro-batch x accumulation steps and
peak memory. Under ``--local-steps`` λ > 1 a step's loss, grad norm and count are rank 0's own
share, and ``round_loss`` / ``round_count`` (at a round's last step) the whole round's over every
rank (Note [local rounds] in ``train.rounds``).
"""

from __future__ import annotations

import csv
import os
from typing import Any

from bigbatch.core._units import format_bytes

COLUMNS = [
    "step", "epoch", "loss", "lr", "grad_norm", "samples", "count", "micro_batch_size",
    "micro_batches", "oom_retries", "skipped", "nonfinite", "time_s", "samples_per_s",
    "tokens_per_s", "peak_bytes", "step_peak_bytes", "retry_peak_bytes", "eval_loss", "metric",
    "round_loss", "round_count",
]  # fmt: skip
METRICS_CSV = "metrics.csv"


class RunLog:
    """The per-step log of one run: CSV, optional TensorBoard and a progress bar.

    Args:
        out: the run folder.
        total_steps: optimizer steps the run will take (the bar's length).
        start_step: steps already done (a resumed run; later CSV rows are dropped).
        quiet: no progress bar.
    """

    def __init__(
        self, out: str, total_steps: int, start_step: int = 0, quiet: bool = False
    ) -> None:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, METRICS_CSV)
        truncate_csv(path, start_step)
        new = not os.path.exists(path)
        self._file = open(path, "a", newline="")  # noqa: SIM115 - closed in close()
        self._csv = csv.DictWriter(self._file, COLUMNS, extrasaction="ignore")
        if new:
            self._csv.writeheader()
        self._tensorboard = _tensorboard_writer(out)
        self._bar = None if quiet else _ProgressBar(total_steps, start_step)

    def step(self, row: dict[str, Any]) -> None:
        """Record one optimizer step (``row`` keys from ``COLUMNS``)."""
        self._csv.writerow(row)
        self._file.flush()
        if self._tensorboard is not None:
            for key in (
                "loss",
                "lr",
                "grad_norm",
                "samples_per_s",
                "tokens_per_s",
                "peak_bytes",
                "metric",
                "round_loss",
            ):
                if row.get(key) not in (None, ""):
                    self._tensorboard.add_scalar(f"train/{key}", float(row[key]), int(row["step"]))
        if self._bar is not None:
            self._bar.update(row)

    def close(self) -> None:
        """Flush and close everything (the bar stays on screen)."""
        if self._bar is not None:
            self._bar.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        self._file.close()


class NullLog:
    """The log of ranks other than 0: records nothing (rank 0 alone writes the run folder)."""

    def step(self, row: dict[str, Any]) -> None:
        """Ignore one optimizer step's row."""

    def close(self) -> None:
        """Nothing to close."""


def read_csv(path: str) -> list[dict[str, str]]:
    """The whole rows of a ``metrics.csv``, in order (empty when there is no file).

    A row cut short by a kill (a torn last line) or damaged is left out; so are rows whose step
    is not a number.

    Raises:
        ValueError: the file lacks a column bigbatch writes (the message names the file and
            the columns), e.g. it is not a ``metrics.csv`` of ``bigbatch train``.
    """
    if not os.path.exists(path):
        return []
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        missing = [
            c for c in ("step", "loss", "samples", "count") if c not in (reader.fieldnames or [])
        ]
        if missing:
            raise ValueError(
                f"{path} lacks the column(s) {', '.join(missing)}: it is not the metrics.csv of a "
                "`bigbatch train` run (or it was written by another version)."
            )
        return [row for row in reader if _whole(row)]


def _whole(row: dict[str, Any]) -> bool:
    if None in row or any(v is None for v in row.values()):  # too many or too few fields
        return False
    try:
        int(row["step"])
        float(row["loss"])
    except ValueError:
        return False
    return True


def truncate_csv(path: str, last_step: int) -> None:
    """Keep exactly the rows of steps 1..``last_step``: a resumed run redoes the steps its
    snapshot did not hold (a torn last row, left by a kill mid-write, goes too)."""
    if last_step == 0:
        if os.path.exists(path):
            os.remove(path)
        return
    kept = [r for r in read_csv(path) if int(r["step"]) <= last_step]
    temp = path + ".tmp"
    with open(temp, "w", newline="") as file:
        writer = csv.DictWriter(file, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(kept)
    os.replace(temp, path)  # a kill now leaves the old file or the new one


def speed_text(row: dict[str, Any]) -> str:
    """``"1,234 samples/s"`` or ``"56,789 tokens/s"`` (when the loss counts tokens)."""
    if row.get("tokens_per_s") not in (None, ""):
        return f"{float(row['tokens_per_s']):,.0f} tokens/s"
    return f"{float(row['samples_per_s']):,.0f} samples/s"


class _ProgressBar:
    def __init__(self, total: int, done: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), console=Console(stderr=True),
        )  # fmt: skip
        self._task = self._progress.add_task("train", total=total, completed=done, info="")
        self._progress.start()

    def update(self, row: dict[str, Any]) -> None:
        micro = f"{row['micro_batch_size']} x {row['micro_batches']}"
        info = (
            f"loss {float(row['loss']):.4f} | {speed_text(row)} | micro-batch {micro} | "
            f"peak {format_bytes(float(row['peak_bytes']))}"
        )
        self._progress.update(self._task, completed=int(row["step"]), info=info)

    def close(self) -> None:
        self._progress.stop()


def _tensorboard_writer(out: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # optional: pip install tensorboard
        return None
    return SummaryWriter(os.path.join(out, "tensorboard"))

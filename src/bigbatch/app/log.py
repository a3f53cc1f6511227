"""The log: what a run records, once per optimizer step (never per micro-batch).

``RunLog.step(row)`` appends one row to ``DIR/metrics.csv``, writes the numbers to TensorBoard
when it is installed (``DIR/tensorboard``) and shows the progress (Note [progress]). Under
``--local-steps`` λ > 1 a step's loss, grad norm and count are rank 0's own share, and
``round_loss`` / ``round_count`` / ``round_skipped`` (at a round's last step) the whole round's
over every rank (Note [local rounds] in ``app.rounds``). Files are opened with
``folder.no_follow`` (Note [no links] in ``app.folder``). ``read_csv`` reads the log back.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from bigbatch.app.folder import no_follow, replace_file
from bigbatch.core._units import format_bytes

COLUMNS = [
    "step",
    "epoch",
    "loss",
    "lr",
    "grad_norm",
    "samples",
    "count",
    "micro_batch_size",
    "micro_batch_tokens",
    "micro_batches",
    "oom_retries",
    "skipped",
    "nonfinite",
    "time_s",
    "samples_per_s",
    "tokens_per_s",
    "peak_bytes",
    "step_peak_bytes",
    "retry_peak_bytes",
    "eval_loss",
    "metric",
    "round_loss",
    "round_count",
    "round_skipped",
    "padding",
    "terms",
    "graphs",
    "input_tokens",
    "computed_tokens",
    "model_tflops",
    "recompute_tflops",
    "tflops_per_s",
    "mfu",
    "peak",
    "bytes_per_token",
    "memory_budget",
]
TENSORBOARD = (
    "loss",
    "lr",
    "grad_norm",
    "samples_per_s",
    "tokens_per_s",
    "peak_bytes",
    "metric",
    "round_loss",
    "mfu",
)
METRICS_CSV = "metrics.csv"
LINES_PER_RUN = 20


class RunLog:
    """The per-step log of one run: CSV, train.log, optional TensorBoard, progress on stderr.

    Note [progress]
        A progress line (step, loss, samples/s or tokens/s, micro-batch x steps, peak memory, time
        left) goes to ``DIR/train.log`` every ``log_every`` steps (0: about ``LINES_PER_RUN`` lines
        a run) and at the last step, so a run under nohup, Slurm or a pipe can be followed with
        ``tail -f``. On stderr: a bar when stderr is a terminal, else the same lines (a bar's frames
        in a file are noise, and its last frame is cut to 80 columns). The bar is transient: when it
        ends, the last line is printed whole, wrapped by the terminal, not cut to its width.

    Args:
        out: the run folder.
        total_steps: optimizer steps the run will take (the bar's length).
        start_step: steps already done (a resumed run; later CSV rows are dropped).
        quiet: nothing on stderr (the files are written all the same).
        every: a progress line every N steps (0: about ``LINES_PER_RUN`` in the run).
    """

    def __init__(
        self, out: str, total_steps: int, start_step: int = 0, quiet: bool = False, every: int = 0
    ) -> None:
        path = os.path.join(out, METRICS_CSV)
        # keep exactly the header and the rows of steps 1..start_step: a resumed run redoes the
        # steps its snapshot did not hold (a torn last row, left by a kill mid-write, goes too);
        # from step 0 whatever the file held goes. A kill leaves the old file or the new one.
        text = io.StringIO()
        writer = csv.DictWriter(text, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        rows = read_csv(path) if start_step else []
        writer.writerows(r for r in rows if int(r["step"]) <= start_step)
        replace_file(path, text.getvalue().encode())
        self._file = open(path, "a", newline="", opener=no_follow)
        self._csv = csv.DictWriter(self._file, COLUMNS, extrasaction="ignore")
        self._text = open(os.path.join(out, "train.log"), "a", opener=no_follow)
        self._write(f"{'resumed after' if start_step else 'started at'} step {start_step}")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard: Any = SummaryWriter(os.path.join(out, "tensorboard"))
        except ImportError:  # optional: pip install tensorboard
            self._tensorboard = None
        self._total, self._every = total_steps, every or math.ceil(total_steps / LINES_PER_RUN)
        self._start, self._first, self._line = time.monotonic(), start_step, ""
        self._bar = None if quiet else _progress_bar(total_steps, start_step)
        self._echo = not quiet and self._bar is None

    def step(self, row: dict[str, Any]) -> None:
        """Record one optimizer step (``row`` keys from ``COLUMNS``)."""
        self._csv.writerow(row)
        self._file.flush()
        step = int(row["step"])
        for key in TENSORBOARD if self._tensorboard is not None else ():
            if row.get(key) not in (None, ""):
                self._tensorboard.add_scalar(f"train/{key}", float(row[key]), step)
        left = (time.monotonic() - self._start) / (step - self._first) * (self._total - step)
        self._line = progress_line(row, self._total, left)
        if self._bar is not None:
            info = self._line.split(" | ", 1)[-1]
            self._bar.update(self._bar.task_ids[0], completed=step, info=info)
        if step % self._every == 0 or step == self._total:
            self._write(self._line)
            if self._echo:
                print(self._line, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Flush and close everything; the bar gives way to the last line, whole."""
        if self._bar is not None:
            self._bar.stop()
            if self._line:
                print(self._line, file=sys.stderr, flush=True)
        for file in (self._tensorboard, self._file, self._text):
            if file is not None:
                file.close()

    def _write(self, line: str) -> None:
        self._text.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        self._text.flush()


def progress_line(row: dict[str, Any], total_steps: int, left_s: float) -> str:
    """``step 3/10 | loss 0.6931 | 1,234 samples/s | micro-batch 4 x 3 | peak 1.2 MiB | ...``."""
    unit, left = "tokens" if row.get("tokens_per_s") not in (None, "") else "samples", round(left_s)
    speed = f"{float(row[unit + '_per_s']):,.0f} {unit}/s"
    evaluated = row.get("eval_loss") not in (None, "")
    return " | ".join(
        [
            f"step {row['step']}/{total_steps}",
            f"loss {float(row['loss']):.4f}",
            speed,
            f"micro-batch {in_units(row.get('micro_batch_tokens'), row['micro_batch_size'])} x "
            f"{row['micro_batches']}",
            f"peak {format_bytes(float(row['peak_bytes']))}",
            *(
                [f"padding {float(row['padding']):.0%}"]
                if row.get("padding") not in (None, "")
                else []
            ),
            *([f"MFU {float(row['mfu']):.1%}"] if row.get("mfu") not in (None, "") else []),
            *([row["terms"]] if row.get("terms") else []),
            *([f"eval loss {float(row['eval_loss']):.4f}"] if evaluated else []),
            f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d} left",
        ]
    )


def in_units(tokens: Any, size: Any) -> str:
    """A micro-batch in its unit: ``"1,024 tokens"`` (a token budget) or ``"8"`` (samples)."""
    return f"{int(tokens):,} tokens" if tokens not in (None, "") else str(size)


def read_csv(path: str) -> list[dict[str, str]]:
    """The whole rows of a ``metrics.csv``, in order (empty when there is no file).

    A row cut short by a kill (a torn last line) or damaged is left out; so are rows whose step
    or loss is not a number. Columns that older versions did not write are simply absent.

    Raises:
        ValueError: the file lacks a column every version writes (the message names the file
            and the columns), e.g. it is not a ``metrics.csv`` of ``bigbatch train``.
    """
    if not os.path.exists(path):
        return []
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        fields = reader.fieldnames or []
        missing = [c for c in ("step", "loss", "samples", "count") if c not in fields]
        if missing:
            raise ValueError(
                f"{path} lacks the column(s) {', '.join(missing)}: it is not the "
                "metrics.csv of a `bigbatch train` run (or of another version)."
            )
        return [row for row in reader if _readable(row)]


def _readable(row: dict[str, Any]) -> bool:
    try:  # a row with too few fields holds None, one with too many a None key
        int(row["step"]), float(row["loss"])
    except (TypeError, ValueError):
        return False
    return None not in row and None not in row.values()


@contextlib.contextmanager
def progress_lines(title: str) -> Iterator[Callable[[str, int, int], None]]:
    """``progress(line, done, total)`` for long work (``bigbatch plan``): a transient bar showing
    the line on stderr when it is a terminal, else the line itself (Note [progress])."""
    bar = _progress_bar(0, 0, title)

    def show(line: str, done: int, total: int) -> None:
        if bar is None:
            print(f"{title}: {line}", file=sys.stderr, flush=True)
        else:
            bar.update(bar.task_ids[0], completed=done, total=total, info=line)

    try:
        yield show
    finally:
        if bar is not None:
            bar.stop()


def _progress_bar(total: int, done: int, what: str = "step") -> Any:
    """A transient bar on stderr when it is a terminal (Note [progress]), else ``None``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        return None
    bar = Progress(
        TextColumn(what),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        transient=True,
    )
    bar.add_task("train", total=total, completed=done, info="")
    bar.start()
    return bar

"""The end of a run: the summary (a table on screen, ``summary.json``) and the PNG plot.

``bigbatch report DIR`` reads ``DIR/metrics.csv`` and ``DIR/summary.json`` and draws the loss
curve and the peak memory over optimizer steps into ``DIR/report.png``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

from bigbatch.app.log import METRICS_CSV, read_csv
from bigbatch.core._units import format_bytes

SUMMARY_JSON = "summary.json"
REPORT_PNG = "report.png"


@dataclass(frozen=True)
class Summary:
    """What a run did, the numbers the seed comparisons quote.

    Attributes:
        steps: optimizer steps taken.
        samples: training samples seen.
        tokens: items the loss counted, when that is not the samples (tokens); else ``None``.
        time_s: training time in seconds, summed over resumes.
        samples_per_s: ``samples / time_s``.
        tokens_per_s: ``tokens / time_s`` or ``None``.
        peak_bytes: highest memory in use during a step (CUDA allocator, or CPU resident set).
        step_peak_bytes: highest memory a step added above what was in use before it; for a
            step redone after running out of memory, the attempt that succeeded.
        final_loss: the last step's loss (under ``--local-steps`` λ > 1: the last round's, over
            every rank).
        eval_loss: loss on the task's eval data at the end (``None`` without eval data).
        metric: the task's metric on the eval data at the end (``None`` without one).
        batch_size: effective batch.
        micro_batch_size: the last micro-batch size used.
        out: the run folder.
        retry_peak_bytes: highest memory a step added counting the attempts that ran out of
            memory and were redone smaller (``None`` when no step was redone).
        skipped_steps: optimizer steps skipped (fp16 overflow, or ``nonfinite="skip"``).
    """

    steps: int
    samples: int
    tokens: float | None
    time_s: float
    samples_per_s: float
    tokens_per_s: float | None
    peak_bytes: int
    step_peak_bytes: int
    final_loss: float
    eval_loss: float | None
    metric: float | None
    batch_size: int
    micro_batch_size: int | None
    out: str
    retry_peak_bytes: int | None = None
    skipped_steps: int = 0


def summarize(
    out: str,
    time_s: float,
    batch_size: int,
    evaluation: tuple[float | None, float | None],
    write: bool = True,
) -> Summary:
    """Build the run's ``Summary`` from ``out/metrics.csv`` and write ``out/summary.json``
    (``write=False``: only read, as ranks other than 0 do)."""
    rows = read_csv(os.path.join(out, METRICS_CSV))
    samples = sum(int(r["samples"]) for r in rows)
    count = sum(float(r["count"]) for r in rows)
    tokens = count if any(r["tokens_per_s"] for r in rows) else None
    ends = [r for r in rows if r.get("round_loss")]  # local rounds: a row's count is rank 0's
    if ends:
        tokens = sum(float(r["round_count"]) for r in ends) if tokens is not None else None
    time_s = max(time_s, 1e-9)
    retried = [int(r["retry_peak_bytes"]) for r in rows if r.get("retry_peak_bytes")]
    summary = Summary(
        steps=len(rows),
        samples=samples,
        tokens=tokens,
        time_s=time_s,
        samples_per_s=samples / time_s,
        tokens_per_s=None if tokens is None else tokens / time_s,
        peak_bytes=max((int(r["peak_bytes"]) for r in rows), default=0),
        step_peak_bytes=max((int(r["step_peak_bytes"]) for r in rows), default=0),
        final_loss=float(ends[-1]["round_loss"] if ends else rows[-1]["loss"])
        if rows
        else float("nan"),
        eval_loss=evaluation[0],
        metric=evaluation[1],
        batch_size=batch_size,
        micro_batch_size=int(rows[-1]["micro_batch_size"]) if rows else None,
        out=out,
        retry_peak_bytes=max(retried) if retried else None,
        skipped_steps=sum(int(r.get("skipped") or 0) for r in rows),
    )
    if write:
        plain = {k: _json_number(v) for k, v in dataclasses.asdict(summary).items()}
        with open(os.path.join(out, SUMMARY_JSON), "w") as file:
            json.dump(plain, file, indent=2, allow_nan=False)  # valid JSON: NaN becomes null
    return summary


def _json_number(value: object) -> object:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def load_summary(out: str) -> Summary:
    """Read ``out/summary.json``.

    Raises:
        FileNotFoundError: ``out`` is not a finished run folder.
        ValueError: the file is not a summary of this version of bigbatch (named).
    """
    path = os.path.join(out, SUMMARY_JSON)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} does not exist: give the --out folder of a finished `bigbatch train` run."
        )
    try:
        with open(path) as file:
            return Summary(**json.load(file))
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"{path} is not a bigbatch summary ({exc}); run `bigbatch train` again to write it."
        ) from None


def summary_rows(summary: Summary) -> list[tuple[str, str]]:
    """The summary as (name, value) lines, for a table."""
    rows = [
        ("optimizer steps", f"{summary.steps:,}"),
        ("effective batch", f"{summary.batch_size:,} (micro-batch {summary.micro_batch_size})"),
        ("time", f"{summary.time_s:.1f} s"),
        ("samples/s", f"{summary.samples_per_s:,.1f}"),
    ]
    if summary.tokens_per_s is not None:
        rows.append(("tokens/s", f"{summary.tokens_per_s:,.0f}"))
    rows += [
        ("peak memory", format_bytes(summary.peak_bytes)),
        ("peak added by a step", format_bytes(summary.step_peak_bytes)),
    ]
    if summary.retry_peak_bytes is not None:
        rows.append(("... with redone attempts", format_bytes(summary.retry_peak_bytes)))
    if summary.skipped_steps:
        rows.append(("skipped steps", f"{summary.skipped_steps:,}"))
    final = summary.final_loss
    rows.append(("final loss", f"{final:.4f}" if final is not None else "nan"))
    if summary.eval_loss is not None:
        rows.append(("eval loss", f"{summary.eval_loss:.4f}"))
    if summary.metric is not None:
        rows.append(("eval metric", f"{summary.metric:.4f}"))
    return rows


def print_summary(summary: Summary, title: str = "bigbatch train") -> None:
    """Print the summary as a table (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{title}: {summary.out}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in summary_rows(summary):
        table.add_row(name, value)
    Console().print(table)


def plot_run(out: str, path: str | None = None) -> str:
    """Draw the loss and the peak memory over optimizer steps; return the PNG's path.

    Raises:
        FileNotFoundError: ``out`` has no ``metrics.csv``.
    """
    rows = read_csv(os.path.join(out, METRICS_CSV))
    if not rows:
        raise FileNotFoundError(
            f"{os.path.join(out, METRICS_CSV)} is missing or empty: give the --out folder of a "
            "`bigbatch train` run."
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, constrained_layout=True)
    ends = [r for r in rows if r.get("round_loss")]  # local rounds (Note [local rounds])
    label = "train loss (rank 0's share)" if ends else "train loss"
    top.plot(steps, [float(r["loss"]) for r in rows], color="tab:blue", label=label)
    if ends:
        round_steps = [int(r["step"]) for r in ends]
        round_loss = [float(r["round_loss"]) for r in ends]
        top.plot(round_steps, round_loss, "s-", color="tab:green", label="round loss (all ranks)")
    evals = [r for r in rows if r["eval_loss"]]
    if evals:
        eval_steps = [int(r["step"]) for r in evals]
        eval_loss = [float(r["eval_loss"]) for r in evals]
        top.plot(eval_steps, eval_loss, "o-", color="tab:orange", label="eval loss")
    top.set_ylabel("loss")
    top.set_title(f"bigbatch run {os.path.basename(os.path.abspath(out))}: loss per optimizer step")
    top.legend()
    top.grid(alpha=0.3)
    mib = 2.0**20
    bottom.plot(
        steps, [int(r["peak_bytes"]) / mib for r in rows], color="tab:red", label="peak in use"
    )
    bottom.plot(
        steps,
        [int(r["step_peak_bytes"]) / mib for r in rows],
        color="tab:purple",
        label="added by the step",
    )
    bottom.set_ylabel("memory (MiB)")
    bottom.set_xlabel("optimizer step")
    bottom.set_ylim(bottom=0)
    bottom.legend()
    bottom.grid(alpha=0.3)
    path = path or os.path.join(out, REPORT_PNG)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""What the command line shows: the end of a run, its report, and the tables of plan and check.

The end of a run is its ``Summary``: a table on screen and ``DIR/summary.json``. ``bigbatch
report DIR`` reads ``DIR/metrics.csv`` (and ``DIR/summary.json`` when the run finished) and draws
the loss curve and the peak memory over optimizer steps into ``DIR/report.png`` (Note [partial
reports]). The library returns values (``Plan``, ``CheckReport``); ``print_plan`` and
``print_check`` turn them into text with ``rich`` (``print_table``, the one table maker, which
the demo uses too).
"""

from __future__ import annotations

import io
import json
import math
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bigbatch.app.folder import lock_holder, replace_file
from bigbatch.app.log import METRICS_CSV, in_units, read_csv
from bigbatch.core._units import format_bytes
from bigbatch.memory._candidates import Candidate
from bigbatch.memory.planner import Plan
from bigbatch.verifier._check import CheckReport

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
        micro_batch_size: the last micro-batch size used (a token budget: ``micro_batch_tokens``).
        out: the run folder.
        retry_peak_bytes: highest memory a step added counting the attempts that ran out of
            memory and were redone smaller (``None`` when no step was redone).
        skipped_steps: optimizer steps skipped (fp16 overflow, or ``nonfinite="skip"``); under
            ``--local-steps`` λ > 1, the inner steps skipped on every rank, summed.
        padding: the share of the tokens computed that were padding (token windows), else
            ``None``.
        terms: the last step's named loss terms (``"lm=2.31 aux=0.052"``), else empty.
        compiled_graphs: graphs ``torch.compile`` built (its recompiles), else ``None``.
        micro_batch_tokens: the last token budget used (token windows), else ``None``.
        mfu: the model FLOPs utilisation over the run's steps (text; Note [step ledger] in
            ``bigbatch.core.ledger``), against ``peak``, else ``None``.
        peak: the peak FLOP/s the MFU is against: ``"given"`` or how it was measured.
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
    padding: float | None = None
    terms: str = ""
    compiled_graphs: int | None = None
    micro_batch_tokens: int | None = None
    mfu: float | None = None
    peak: str | None = None


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
    col, ends = _column(rows), _column([r for r in rows if r.get("round_loss")])  # local rounds
    counted = ends("round_count") or col("count")  # under local rounds a row's count is rank 0's
    tokens = sum(counted) if col("tokens_per_s") else None
    time_s, samples, losses = max(time_s, 1e-9), int(sum(col("samples"))), ends("round_loss")
    summary = Summary(
        steps=len(rows),
        samples=samples,
        tokens=tokens,
        time_s=time_s,
        samples_per_s=samples / time_s,
        tokens_per_s=None if tokens is None else tokens / time_s,
        peak_bytes=int(max(col("peak_bytes"), default=0)),
        step_peak_bytes=int(max(col("step_peak_bytes"), default=0)),
        final_loss=(losses or col("loss") or [math.nan])[-1],
        eval_loss=evaluation[0],
        metric=evaluation[1],
        batch_size=batch_size,
        micro_batch_size=_whole(col("micro_batch_size")[-1:]),
        out=out,
        retry_peak_bytes=_whole(col("retry_peak_bytes")),
        skipped_steps=int(sum(ends("round_skipped") or col("skipped"))),  # every rank's
        padding=statistics.fmean(col("padding")) if col("padding") else None,
        terms=(rows[-1].get("terms") or "") if rows else "",
        compiled_graphs=_whole(col("graphs")[-1:]),
        micro_batch_tokens=_whole(col("micro_batch_tokens")[-1:]),
        mfu=_mfu(rows),
        peak=(rows[-1].get("peak") or None) if rows else None,
    )
    if write:
        _write_summary(out, summary)
    return summary


def _mfu(rows: list[dict[str, str]]) -> float | None:
    """The run's MFU: its model FLOPs over the time at the peak, ``Σ f / Σ (f / mfu)``."""
    steps = [(float(r["model_tflops"]), float(r["mfu"])) for r in rows if r.get("mfu")]
    at_peak = sum(f / m for f, m in steps if m > 0)
    return sum(f for f, _ in steps) / at_peak if at_peak else None


def _write_summary(out: str, summary: Summary) -> None:
    """Write ``out/summary.json``, NaN and inf as null: it stays JSON."""
    plain = {
        k: v if not isinstance(v, float) or math.isfinite(v) else None
        for k, v in asdict(summary).items()
    }
    replace_file(os.path.join(out, SUMMARY_JSON), json.dumps(plain, indent=2).encode())


def report(out: str, png: str | None = None) -> tuple[Summary, str | None, str]:
    """``bigbatch report``: the summary, why it is partial (``None``: the run finished) and the
    plot's path.

    Note [partial reports]
        A run folder may hold a run still in progress (another process holds its lock), or one that
        stopped before its end (a crash, a kill, a Ctrl-C: no ``summary.json``, or one that counts
        other steps than ``metrics.csv``). Its report is then computed from the rows written so far
        and says so, on screen and in the plot's title. Files are replaced atomically; a report that
        fails removes the ``DIR/report.png`` it would have replaced, so no plot is left that does
        not match the folder. Rows and columns are read leniently (columns older versions did not
        write are left out); what cannot be read at all is one line naming the file.

    Raises:
        FileNotFoundError: ``out`` is not a run folder, or holds no steps.
        ValueError: ``metrics.csv`` or ``summary.json`` cannot be read (the message names it).
    """
    if not os.path.isdir(out):
        what = "is a file, not a folder" if os.path.exists(out) else "does not exist"
        raise FileNotFoundError(f"run folder {out!r} {what}: give the --out folder of a run.")
    default, metrics = os.path.join(out, REPORT_PNG), os.path.join(out, METRICS_CSV)
    path = png or default
    try:
        rows = read_csv(metrics)
        if not rows:
            raise FileNotFoundError(
                f"{metrics} is missing or empty: give the --out folder of a "
                "`bigbatch train` run that took a step."
            )
        summary, partial = _summary_so_far(out, rows)
        return summary, partial, plot_run(out, path, rows, partial)
    except BaseException:
        if path == default and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)  # a plot that does not match the folder is worse than none
        raise


def _summary_so_far(out: str, rows: list[dict[str, str]]) -> tuple[Summary, str | None]:
    """The finished run's ``summary.json``, else a summary of the rows so far and why."""
    holder, path = lock_holder(out), os.path.join(out, SUMMARY_JSON)
    if holder is None and os.path.exists(path):
        try:
            with open(path) as file:
                summary = Summary(**json.load(file))
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"{path} is not a bigbatch summary ({exc}); run `bigbatch train` again to write it."
            ) from None
        if summary.steps == len(rows):
            return summary, None
    col = _column(rows)
    evaluation = (next(reversed(col("eval_loss")), None), next(reversed(col("metric")), None))
    summary = summarize(out, sum(col("time_s")), _whole(col("samples")) or 0, evaluation, False)
    if holder is not None:
        return summary, f"the run is still running (process {holder}), at step {len(rows)}"
    return summary, (
        f"the run stopped at step {len(rows)} before its end (a crash, a kill or "
        "Ctrl-C): `bigbatch train ... --resume` continues it"
    )


def print_summary(summary: Summary, title: str = "bigbatch train") -> None:
    """Print the summary as a table of (name, value) lines, those with a value."""
    s, retried = summary, summary.retry_peak_bytes
    rows: list[tuple[str, Any]] = [
        ("optimizer steps", f"{s.steps:,}"),
        (
            "effective batch",
            f"{s.batch_size:,} (micro-batch {in_units(s.micro_batch_tokens, s.micro_batch_size)})",
        ),
        ("time", f"{s.time_s:.1f} s"),
        ("samples/s", f"{s.samples_per_s:,.1f}"),
        ("tokens/s", None if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}"),
        ("padding computed", None if s.padding is None else f"{s.padding:.1%}"),
        ("MFU", None if s.mfu is None else f"{s.mfu:.1%} (peak {s.peak})"),
        ("compiled graphs", s.compiled_graphs and f"{s.compiled_graphs}"),
        ("peak memory", format_bytes(s.peak_bytes)),
        ("peak added by a step", format_bytes(s.step_peak_bytes)),
        ("... with redone attempts", retried and format_bytes(retried)),
        ("skipped steps", s.skipped_steps and f"{s.skipped_steps:,}"),
        ("final loss", "nan" if s.final_loss is None else f"{s.final_loss:.4f}"),
        ("final terms", s.terms),
        ("eval loss", None if s.eval_loss is None else f"{s.eval_loss:.4f}"),
        ("eval metric", None if s.metric is None else f"{s.metric:.4f}"),
    ]
    lines = [(f"[bold]{name}", value) for name, value in rows if value]
    print_table(f"{title}: {s.out}", ["", ""], lines, show_header=False)


def plot_run(out: str, path: str, rows: list[dict[str, str]], partial: str | None = None) -> str:
    """Draw the loss and the peak memory over optimizer steps into ``path``; return it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    local = any(_number(r, "round_loss") is not None for r in rows)  # Note [local rounds]
    for axes, key, style, color, label in [
        (top, "loss", "-", "tab:blue", "train loss (rank 0's share)" if local else "train loss"),
        (top, "round_loss", "s-", "tab:green", "round loss (all ranks)"),
        (top, "eval_loss", "o-", "tab:orange", "eval loss"),
        (bottom, "peak_bytes", "-", "tab:red", "peak in use"),
        (bottom, "step_peak_bytes", "-", "tab:purple", "added by the step"),
    ]:
        scale = 2.0**20 if axes is bottom else 1.0
        points = [(int(r["step"]), v / scale) for r in rows if (v := _number(r, key)) is not None]
        if points:
            axes.plot(*zip(*points, strict=True), style, color=color, label=label)
    if budget := _column(rows)("memory_budget"):  # what a step may add (--memory-budget)
        bottom.axhline(budget[-1] / 2**20, ls="--", color="tab:purple", label="memory budget")
    state = partial and ("still running" if "running" in partial else "stopped before its end")
    state = f" (partial: {state})" if state else ""
    name = os.path.basename(os.path.abspath(out))
    top.set(ylabel="loss", title=f"bigbatch run {name}{state}: loss per optimizer step")
    bottom.set(ylabel="memory (MiB)", xlabel="optimizer step", ylim=(0, None))
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
        if axes.lines:
            axes.legend()
    return save_png(fig, path)


def save_png(fig: Any, path: str) -> str:
    """Write a matplotlib ``Figure`` as a PNG that replaces ``path`` whole (Note [whole files])."""
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format="png")
    return replace_file(path, image.getvalue())


def _number(row: dict[str, str], key: str) -> float | None:
    """The cell as a number; ``None`` when the column is absent (an older version) or empty."""
    try:
        return float(row.get(key) or "")
    except ValueError:
        return None


def _column(rows: list[dict[str, str]]) -> Callable[[str], list[float]]:
    return lambda key: [v for r in rows if (v := _number(r, key)) is not None]


def _whole(values: list[float]) -> int | None:
    """The largest of ``values`` as an integer (``None`` when there is none)."""
    return int(max(values)) if values else None


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    right: int = 1,
    width: int = 100,
    **options: Any,
) -> Any:
    """Print ``rows`` under ``columns`` (those from index ``right`` on right-justified and not
    wrapped) as a rich ``Table(title, **options)``, at least ``width`` columns wide; return the
    console, for the lines that follow the table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, **options)
    for i, name in enumerate(columns):
        table.add_column(name, justify="right" if i >= right else "left", no_wrap=i >= right)
    for row in rows:
        table.add_row(*row)
    console = Console(width=max(width, Console().width))
    console.print(table)
    return console


def print_plan(result: Plan) -> None:
    """Every configuration as a table, then the margin, the memory fits, the choice and why."""
    budget, usable = format_bytes(result.memory_budget), format_bytes(result.usable_bytes)
    title = f"bigbatch plan: batch {result.batch_size} on {result.device}, budget {budget}, "
    columns = [
        "micro-batch",
        "token budget",
        "padding",
        "steps",
        "checkpointing",
        "peak MiB",
        "saved MiB",
        "ms/step",
        "spread (ms)",
        "samples/s",
        "fits",
    ]
    rows = [_plan_row(result, c) for c in result.candidates]
    console = print_table(title + f"safety margin {result.margin:.0%}", columns, rows, 0, 160)
    lines = [
        "ms/step: the median of the timed steps, taken in alternating rounds; spread: their "
        "interquartile range (a tie needs overlapping spreads and at most 5% between medians)",
        "! saves nothing measurable: within 2% of the same micro-batch without checkpointing"
        if any(c.saves_nothing for c in result.candidates)
        else "",
        f"safety margin {result.margin:.0%}: a configuration fits when its peak is within "
        f"{usable} of the {budget} budget",
        *(
            f"memory fit, {fit.label}: peak ≈ {format_bytes(fit.base_bytes)} + "
            f"{format_bytes(fit.bytes_per_sample)} x {'token' if fit.tokens else 'micro-batch'}; "
            "largest that fits: "
            f"{'any' if (n := fit.largest_fitting(result.usable_bytes)) >= 2**31 else n}"
            for fit in result.fits
        ),
        *(f"not tried: {skipped}" for skipped in result.skipped),
        f"choice: {result.choice.describe()} (headroom {format_bytes(result.headroom_bytes)})",
        f"runner-up: {result.runner_up.describe()}" if result.runner_up is not None else "",
        f"why: {result.reason}",
    ]
    for line in filter(None, lines):
        console.print(line, markup=False)


def _plan_row(result: Plan, c: Candidate) -> tuple[str, ...]:
    """One table row: what was measured (or predicted) and how it compares."""
    peak = f"{c.peak_bytes / 2**20:,.1f}" + ("" if c.measured else " (fit)")
    saved = "-" if c.saved_bytes is None else f"{c.saved_bytes / 2**20:,.1f}"
    spread = c.spread_seconds and tuple(t * 1000 for t in c.spread_seconds)
    over = "no (margin)" if c.peak_bytes <= result.memory_budget else "no"
    fits = "OOM" if c.out_of_memory else "yes" if c.fits else over
    mark = {id(result.choice): " <- chosen", id(result.runner_up): " <- runner-up"}
    return (
        f"≤{c.micro_batch_size} rows" if c.micro_batch_tokens else str(c.micro_batch_size),
        f"{c.micro_batch_tokens:,} tokens" if c.micro_batch_tokens else "-",
        "-" if c.padding is None else f"{c.padding:.0%}",
        str(c.gradient_accumulation_steps),
        c.label,
        "-" if c.out_of_memory else peak,
        saved + ("!" if c.saves_nothing else ""),
        f"{c.seconds_per_step * 1000:,.1f}" if c.seconds_per_step else "-",
        "-" if not spread else f"{spread[0]:,.1f}-{spread[1]:,.1f}",
        f"{c.samples_per_s:,.1f}" if c.samples_per_s else "-",
        fits + mark.get(id(c), ""),
    )


def print_check(report: CheckReport, title: str) -> None:
    """Each named term's difference (when not exact), the parameters that differ most, then the
    verdict and each diagnosis."""
    terms = [(f"term {name!r}", diff) for name, diff in report.term_differences.items()]
    rows = [(name, f"{diff:.2e}") for name, diff in [*terms, *report.worst(10)]]
    column = "term / parameter" if terms else "parameter"
    print_table(title, [column, "relative difference"], rows).print(report.summary(), markup=False)

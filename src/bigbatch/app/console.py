"""What the command line prints as tables: ``bigbatch plan``'s and ``bigbatch check``'s here, and
the one table maker (``print_table``) the run summary and the demo use too.

The library returns values (``Plan``, ``CheckReport``); this module, part of the application on
top, turns them into text with ``rich``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from bigbatch.core._units import format_bytes

if TYPE_CHECKING:
    from bigbatch.memory._candidates import Candidate
    from bigbatch.memory.planner import Plan
    from bigbatch.verifier._check import CheckReport


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
    columns = ["micro-batch", "tokens", "padding", "steps", "checkpointing", "peak MiB",
               "saved MiB", "ms/step", "spread (ms)", "samples/s", "fits"]  # fmt: skip
    rows = [_plan_row(result, c) for c in result.candidates]
    console = print_table(title + f"safety margin {result.margin:.0%}", columns, rows, 0, 160)
    lines = [
        "ms/step: the median of the timed steps, taken in alternating rounds; spread: their "
        "interquartile range (a tie needs overlapping spreads and at most 5% between medians)",
        "! saves nothing measurable: within 2% of the same micro-batch without checkpointing"
        if any(c.saves_nothing for c in result.candidates) else "",
        f"safety margin {result.margin:.0%}: a configuration fits when its peak is within "
        f"{usable} of the {budget} budget",
        *(f"memory fit, {fit.label}: peak ≈ {format_bytes(fit.base_bytes)} + "
          f"{format_bytes(fit.bytes_per_sample)} x {'token' if fit.tokens else 'micro-batch'}; "
          f"largest that fits: {_largest(fit.largest_fitting(result.usable_bytes))}"
          for fit in result.fits),
        *(f"not tried: {skipped}" for skipped in result.skipped),
        f"choice: {result.choice.describe()} (headroom {format_bytes(result.headroom_bytes)})",
        f"runner-up: {result.runner_up.describe()}" if result.runner_up is not None else "",
        f"why: {result.reason}",
    ]  # fmt: skip
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
        f"≤{c.micro_batch_size}" if c.micro_batch_tokens else str(c.micro_batch_size),
        str(c.micro_batch_tokens or "-"),
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


def _largest(size: int) -> str:
    return "any" if size >= 2**31 else str(size)


def print_check(report: CheckReport, title: str) -> None:
    """The parameters that differ most, then the verdict and each diagnosis."""
    rows = [(name, f"{diff:.2e}") for name, diff in report.worst(10)]
    console = print_table(title, ["parameter", "relative difference"], rows)
    console.print(report.summary(), markup=False)

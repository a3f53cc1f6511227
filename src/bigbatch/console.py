"""What the command line prints: the tables of ``bigbatch plan`` and ``bigbatch check``.

The library returns values (``Plan``, ``CheckReport``); this module, part of the application on
top, turns them into text with ``rich``.
"""

from __future__ import annotations

from typing import Any

from bigbatch._units import format_bytes
from bigbatch.check import CheckReport
from bigbatch.memory.planner import Plan


def _console() -> Any:
    from rich.console import Console

    return Console(width=max(100, Console().width))


def print_plan(result: Plan) -> None:
    """Every configuration as a table, then the memory fits, the choice and why."""
    from rich.table import Table

    table = Table(
        title=f"bigbatch plan: batch {result.batch_size} on {result.device}, "
        f"budget {format_bytes(result.memory_budget)}"
    )
    for name in ("micro-batch", "steps", "ckpt", "peak MiB", "ms/step", "samples/s", "fits"):
        table.add_column(name, justify="right")
    for c in result.candidates:
        peak = f"{c.peak_bytes / 2**20:,.0f}" + ("" if c.measured else " (fit)")
        fits = "OOM" if c.out_of_memory else ("yes" if c.fits else "no")
        table.add_row(
            str(c.micro_batch_size),
            str(c.gradient_accumulation_steps),
            f"{c.checkpointing:.0%}",
            "-" if c.out_of_memory else peak,
            f"{c.seconds_per_step * 1000:,.1f}" if c.seconds_per_step else "-",
            f"{c.samples_per_s:,.1f}" if c.samples_per_s else "-",
            fits + (" <- chosen" if c is result.choice else ""),
        )
    console = _console()
    console.print(table)
    for fit in result.fits:
        console.print(
            f"memory fit, {fit.checkpointing:.0%} checkpointed: peak ≈ "
            f"{format_bytes(fit.base_bytes)} + {format_bytes(fit.bytes_per_sample)} x micro-batch; "
            f"largest that fits: {fit.largest_fitting(result.memory_budget)}",
            markup=False,
        )
    console.print(
        f"choice: {result.choice.describe()} (headroom {format_bytes(result.headroom_bytes)})",
        markup=False,
    )
    console.print(f"why: {result.reason}", markup=False)


def print_check(report: CheckReport, title: str) -> None:
    """The parameters that differ most, then the verdict and each diagnosis."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("parameter")
    table.add_column("relative difference", justify="right")
    for name, diff in report.worst(10):
        table.add_row(name, f"{diff:.2e}")
    console = _console()
    console.print(table)
    console.print(report.summary(), markup=False)

"""What the command line prints: the tables of ``bigbatch plan`` and ``bigbatch check``.

The library returns values (``Plan``, ``CheckReport``); this module, part of the application on
top, turns them into text with ``rich``.
"""

from __future__ import annotations

import functools
from typing import Any

from bigbatch.core._units import format_bytes
from bigbatch.memory._candidates import Candidate
from bigbatch.memory.planner import Plan
from bigbatch.verifier._check import CheckReport


def _console(width: int = 100) -> Any:
    from rich.console import Console

    return Console(width=max(width, Console().width))


def print_plan(result: Plan) -> None:
    """Every configuration as a table, then the margin, the memory fits, the choice and why."""
    from rich.table import Table

    table = Table(
        title=f"bigbatch plan: batch {result.batch_size} on {result.device}, budget "
        f"{format_bytes(result.memory_budget)}, safety margin {result.margin:.0%}"
    )
    headers = ("micro-batch", "steps", "checkpointing", "peak MiB", "saved MiB", "ms/step")
    for name in (*headers, "spread (ms)", "samples/s", "fits"):
        table.add_column(name, justify="right", no_wrap=True)
    for c in result.candidates:
        table.add_row(*_plan_row(result, c))
    console = _console(width=132)
    console.print(table)
    say = functools.partial(console.print, markup=False)
    say(
        "ms/step: the median of the timed steps, taken in alternating rounds; spread: their "
        "interquartile range (a tie needs overlapping spreads and at most 5% between medians)"
    )
    if any(c.saves_nothing for c in result.candidates):
        say("! saves nothing measurable: within 2% of the same micro-batch without checkpointing")
    say(
        f"safety margin {result.margin:.0%}: a configuration fits when its peak is within "
        f"{format_bytes(result.usable_bytes)} of the {format_bytes(result.memory_budget)} budget"
    )
    for fit in result.fits:
        say(
            f"memory fit, {fit.label}: peak ≈ {format_bytes(fit.base_bytes)} + "
            f"{format_bytes(fit.bytes_per_sample)} x micro-batch; largest that fits: "
            f"{_largest(fit.largest_fitting(result.usable_bytes))}"
        )
    for skipped in result.skipped:
        say(f"not tried: {skipped}")
    say(f"choice: {result.choice.describe()} (headroom {format_bytes(result.headroom_bytes)})")
    if result.runner_up is not None:
        say(f"runner-up: {result.runner_up.describe()}")
    say(f"why: {result.reason}")


def _plan_row(result: Plan, c: Candidate) -> tuple[str, ...]:
    """One table row: what was measured (or predicted) and how it compares."""
    peak = f"{c.peak_bytes / 2**20:,.1f}" + ("" if c.measured else " (fit)")
    saved = "-" if c.saved_bytes is None else f"{c.saved_bytes / 2**20:,.1f}"
    seconds = c.seconds_per_step
    spread = c.spread_seconds and tuple(t * 1000 for t in c.spread_seconds)
    if c.out_of_memory:
        fits = "OOM"
    else:
        over = "no (margin)" if c.peak_bytes <= result.memory_budget else "no"
        fits = "yes" if c.fits else over
    mark = {id(result.choice): " <- chosen", id(result.runner_up): " <- runner-up"}
    return (
        str(c.micro_batch_size),
        str(c.gradient_accumulation_steps),
        c.label,
        "-" if c.out_of_memory else peak,
        saved + ("!" if c.saves_nothing else ""),
        f"{seconds * 1000:,.1f}" if seconds else "-",
        "-" if not spread else f"{spread[0]:,.1f}-{spread[1]:,.1f}",
        f"{c.samples_per_s:,.1f}" if c.samples_per_s else "-",
        fits + mark.get(id(c), ""),
    )


def _largest(size: int) -> str:
    return "any" if size >= 2**31 else str(size)


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

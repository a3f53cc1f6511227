"""Shared measuring helpers for the benchmark scripts: warm up, synchronise, median, peak, table.

Kept generic on purpose (any benchmark may use it): a timed function is any zero-argument
callable; peak bytes come from ``bigbatch.measure_peak`` (CUDA allocator statistics, or the CPU
resident-set high-water mark).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bigbatch.core.peak import measure_peak


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work so a wall-clock reading covers it (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], Any], device: torch.device | str, *, warmup: int = 1, repeats: int = 3
) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bytes(fn: Callable[[], Any], device: torch.device | str) -> int:
    """Peak memory of one call of ``fn()`` above what was in use before it."""
    with measure_peak(device) as peak:
        fn()
    return peak.peak_bytes


def device_name(device: torch.device | str) -> str:
    """``"NVIDIA H100 80GB HBM3"``, or the CPU's model name and the torch thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            name = next(
                line.split(":", 1)[1].strip() for line in info if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    return f"CPU {name}, {torch.get_num_threads()} threads"


def mib(n_bytes: float) -> str:
    """Bytes as MiB with no decimals: ``"1,234 MiB"``."""
    return f"{n_bytes / 2**20:,.0f} MiB"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print a table as GitHub markdown (pastes into docs as is), right-aligning numbers."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print(f"\n{title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |")

"""benchmarks/memory.py --quick runs: the checkpointing frontier's table, its verdict and its plot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a subprocess building and timing six model copies (~10 s on 2 idle cores)
def test_memory_benchmark_quick_prints_the_frontier_and_plots_it(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    plot = tmp_path / "frontier.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--quick", "--plot", str(plot)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("|")]
    labels = [row.split("|")[1].strip() for row in rows[2:]]
    assert labels == [
        "none", "selective", "full 25% of blocks", "full 50% of blocks", "full 75% of blocks",
        "full",
    ]  # fmt: skip
    baseline = [cell.strip() for cell in rows[2].split("|")[4:7]]
    assert baseline == ["1.00", "1.00", "0%"]  # time, memory, saved of "none"
    assert sum("the target" in row for row in rows) == 1  # exactly one configuration marked
    assert "- target: >= 50% of the activation memory saved at <= 1.15x" in done.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

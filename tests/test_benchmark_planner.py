"""The planner's benchmarks run: benchmarks/memory.py's planner part (the plan's table, its margin,
its runner-up, the planner row beside the others, whether repeated plans chose alike) and
benchmarks/planner.py (GPT-2's plans side by side against a reference pass; every task built and
trained a step); tiny models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bigbatch

ROOT = Path(__file__).resolve().parents[1]
TINY = "--layers 2 --dim 64 --seq 16 --vocab 128 --batch 4 --steps 2 --plans 2 --threads 1"


@pytest.mark.slow  # a subprocess planning a tiny GPT-2 twice (~10 s on 2 idle cores)
def test_memory_benchmark_planner_part_prints_the_plan_and_its_stability() -> None:
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--model", "transformer"]
    done = subprocess.run(
        command + ["--no-frontier", *TINY.split()],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    assert "safety margin 10%" in out and "<- chosen" in out and "Runner-up:" in out
    assert "planner, budget" in out and "checkpointing" in out
    assert "- planner's choice among its" in out and "configurations that fit the budget" in out
    assert "- 2 plans, same choice: " in out
    assert "Checkpointing frontier" not in out  # --no-frontier


@pytest.mark.slow  # three child processes planning a tiny GPT-2 (~20 s on 2 cores)
def test_planner_benchmark_prints_the_plans_side_by_side() -> None:
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, str(ROOT / "benchmarks" / "planner.py"), "--tiny", "--plans", "2"]
    done = subprocess.run(
        command + ["--task", "gpt2", "--rounds", "2", "--steps", "2"],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "gpt2: 2 plans side by side (each in a fresh process)" in out
    assert out.count("| run 1 |") == 1 and out.count("| run 2 |") == 1
    assert "| plan spread |" in out and "| / fastest |" in out
    assert "reference pass: every fitting configuration" in out
    assert "- every choice within 10% of the fastest fitting configuration: " in out


@pytest.mark.slow  # scikit-learn's import for the digits (~3 s)
@pytest.mark.parametrize("task", ["demo", "gpt2", "lm"])
def test_every_task_of_the_planner_benchmark_builds_and_trains(task: str) -> None:
    """The tasks the side-by-side test does not plan (the demo's MLP on the digits, the language
    model of examples/causal_lm.py) still build, and one step trains on them."""
    pytest.importorskip("transformers")
    if task == "demo":
        pytest.importorskip("sklearn")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import planner
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    model, batch, loss_fn = planner.build(task, tiny=True)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2
    )
    assert torch.isfinite(torch.as_tensor(acc.train_step(batch, loss_fn).loss))

"""The Quick start job: one model trained three ways, the same weights, less memory.

``bigbatch demo`` trains a wide MLP on scikit-learn's bundled 8x8 digits (no download) in
float64, from the same initial weights on the same batches, three ways:

1. **full batch**: a plain PyTorch loop, one forward/backward of the whole batch per step;
2. **accumulated**: ``Accumulator(micro_batch_size=64)``, the batch cut into micro-batches;
3. **auto**: ``Accumulator(micro_batch_size="auto", memory_budget=...)`` under a budget of half
   the peak the full batch was measured to need, so the full batch does not fit.

It shows that the three reach the same weights (float64 rounding) and test accuracy while the
peak memory falls, as a table and a PNG plot.

Note [demo peaks]
    A run's peak is the most memory one optimizer step added above what was in use before it
    (``measure_peak`` on the CPU: the process's resident-set high-water mark), the quantity
    ``memory_budget`` caps. The first step of every run is left out (one-time allocations:
    the optimizer state, thread pools), and so are the auto run's steps that redid a window
    after going over the budget: on the CPU the budget is checked after each micro-batch, so
    the attempt that went over did touch that memory before it was discarded (on a GPU it would
    have been an out-of-memory error). The hidden layer is wide (8192) so that activations,
    which scale with the micro-batch, dominate the peak over the 0.6M parameters.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from bigbatch.core.engine import Accumulator
from bigbatch.core.peak import measure_peak, small_mmap_threshold

Batch = tuple[torch.Tensor, torch.Tensor]
EXACT = 1e-10  # float64: a difference above this is not rounding
MIN_BATCH = 256  # below, half the full batch's peak is less than the parameters' share alone


@dataclass(frozen=True)
class Digits:
    """The digits, scaled to [0, 1], split into a training and a held-out test set."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@dataclass
class Run:
    """What one of the three runs did.

    Attributes:
        name: ``"full batch"``, ``"accumulated"`` or ``"auto"``.
        model: the trained model.
        losses: the loss of each optimizer step (the batch's mean, before the step).
        step_peaks: bytes each step added above what was in use before it.
        micro_batch_sizes: micro-batch size of each step (the whole batch for the full batch).
        retries: windows redone after going over the memory budget, per step.
        time_s: training time in seconds.
        batch_size: samples per optimizer step.
    """

    name: str
    model: torch.nn.Module
    batch_size: int
    losses: list[float] = field(default_factory=list)
    step_peaks: list[int] = field(default_factory=list)
    micro_batch_sizes: list[int] = field(default_factory=list)
    retries: list[int] = field(default_factory=list)
    time_s: float = 0.0

    def peak_bytes(self) -> int:
        """The run's peak, per Note [demo peaks]."""
        kept = [p for p, r in zip(self.step_peaks[1:], self.retries[1:], strict=True) if not r]
        return max(kept or self.step_peaks)

    def micro_batch_size(self) -> int:
        """The micro-batch size of the last step."""
        return self.micro_batch_sizes[-1]


def load_digits(test_samples: int = 397, seed: int = 0) -> Digits:
    """scikit-learn's 1,797 bundled 8x8 digit images, shuffled and split, in float64.

    Raises:
        ImportError: scikit-learn is not installed (``pip install scikit-learn``).
    """
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = torch.tensor(digits.data, dtype=torch.float64) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return Digits(x[test_samples:], y[test_samples:], x[:test_samples], y[:test_samples])


def make_model(hidden: int = 8192, seed: int = 0) -> torch.nn.Module:
    """A wide one-hidden-layer MLP, 64 pixels -> ``hidden`` -> 10 digits, in float64."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    ).double()


def loss_fn(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of a ``(images, labels)`` batch."""
    return F.cross_entropy(model(batch[0]), batch[1])


def batch_order(n_samples: int, batch_size: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Each step's sample indices: ``batch_size`` distinct samples drawn afresh every step."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randperm(n_samples, generator=gen)[:batch_size] for _ in range(steps)]


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` whose highest logit is the label ``y``."""
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).double().mean())


def max_relative_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest ``‖a_i - b_i‖ / ‖a_i‖`` over the parameter tensors of two models."""
    return max(
        float((p - q).detach().norm() / p.detach().norm())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


StepFn = Callable[[Batch], tuple[float, int, int]]  # batch -> (loss, micro-batch, retries)


def train(run: Run, step: StepFn, data: Digits, order: Sequence[torch.Tensor], tick: Any) -> Run:
    """Take one step per index tensor of ``order``, measuring each step's peak and the time."""
    start = time.perf_counter()
    for idx in order:
        batch = (data.x_train[idx], data.y_train[idx])
        with measure_peak("cpu") as peak:
            loss, size, retries = step(batch)
        run.losses.append(loss)
        run.step_peaks.append(peak.peak_bytes)
        run.micro_batch_sizes.append(size)
        run.retries.append(retries)
        tick()
    run.time_s = time.perf_counter() - start
    return run


def full_batch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StepFn:
    """The plain PyTorch step the other runs must reproduce: the whole batch at once."""

    def step(batch: Batch) -> tuple[float, int, int]:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        return float(loss.detach()), len(batch[1]), 0

    return step


def accumulated_step(acc: Accumulator) -> StepFn:
    """One ``Accumulator.train_step``: the batch cut into micro-batches, one optimizer step."""

    def step(batch: Batch) -> tuple[float, int, int]:
        result = acc.train_step(batch, loss_fn)
        return result.loss, int(result.micro_batch_size or 0), result.oom_retries

    return step


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The demo's optimizer: AdamW, the same settings for the three runs."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)


def warm_up(init: torch.nn.Module, data: Digits, batch_size: int) -> None:
    """One untimed full-batch step on a throwaway copy, so no run pays one-time allocations."""
    model = copy.deepcopy(init)
    idx = torch.arange(min(batch_size, len(data.y_train)))
    full_batch_step(model, optimizer_for(model))((data.x_train[idx], data.y_train[idx]))


@dataclass(frozen=True)
class DemoResult:
    """The three runs and how they compare.

    Attributes:
        runs: full batch, accumulated, auto (in that order).
        budget_bytes: the auto run's ``memory_budget``: half the full batch's measured peak.
        accuracies: test accuracy of each run.
        differences: max relative parameter difference of each run vs the full batch.
        plot_path: where the PNG was written.
    """

    runs: list[Run]
    budget_bytes: int
    accuracies: list[float]
    differences: list[float]
    plot_path: str

    def exact(self) -> bool:
        """Same weights to float64 rounding, the same accuracy, and auto under its budget."""
        full, _, auto = self.runs
        return (
            max(self.differences) < EXACT
            and len(set(self.accuracies)) == 1
            and auto.peak_bytes() <= self.budget_bytes < full.peak_bytes()
        )


def run_demo(
    steps: int = 40,
    batch_size: int = 512,
    micro_batch_size: int = 64,
    out: str = "bigbatch-demo.png",
    hidden: int = 8192,
) -> DemoResult:
    """Train the digits MLP three ways, print the comparison table and write the plot.

    Args:
        steps: optimizer steps per run (at least 2: the first is left out of the peaks).
        batch_size: samples per optimizer step, the same for the three runs.
        micro_batch_size: the accumulated run's micro-batch.
        out: path of the PNG plot (its folder is created).
        hidden: width of the MLP's hidden layer.

    Returns:
        The ``DemoResult``; ``.exact()`` says whether the runs agree.

    Raises:
        ValueError: ``steps``, ``batch_size`` or ``micro_batch_size`` out of range.
        ImportError: scikit-learn is not installed.
    """
    data = load_digits()
    _check_sizes(steps, batch_size, micro_batch_size, len(data.y_train))
    order = batch_order(len(data.y_train), batch_size, steps)
    init = make_model(hidden)
    with small_mmap_threshold():  # clear CPU readings: Note [honest CPU peaks] in memory.peak
        warm_up(init, data, batch_size)
        with _progress() as bar:
            full = _run("full batch", init, batch_size, data, order, bar, None, None)
            budget = full.peak_bytes() // 2
            accumulated = _run(
                "accumulated", init, batch_size, data, order, bar, micro_batch_size, None
            )
            auto = _run("auto", init, batch_size, data, order, bar, "auto", budget)
    runs = [full, accumulated, auto]
    result = DemoResult(
        runs,
        budget,
        [accuracy(r.model, data.x_test, data.y_test) for r in runs],
        [max_relative_difference(full.model, r.model) for r in runs],
        plot_demo(runs, budget, out),
    )
    print_demo(result)
    return result


def _check_sizes(steps: int, batch_size: int, micro_batch_size: int, n_train: int) -> None:
    if steps < 2:
        raise ValueError(f"steps={steps} is too few: use 2 or more (the first step is a warm-up).")
    if not MIN_BATCH <= batch_size <= n_train:
        raise ValueError(
            f"batch_size={batch_size} is not allowed: use {MIN_BATCH} to {n_train} (the training "
            "images; below, half the full batch's peak leaves no room for the gradients and the "
            "optimizer step)."
        )
    if not 1 <= micro_batch_size <= batch_size:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} is not allowed: use 1 to the batch size "
            f"({batch_size})."
        )


def _run(
    name: str,
    init: torch.nn.Module,
    batch_size: int,
    data: Digits,
    order: Sequence[torch.Tensor],
    bar: Any,
    micro_batch_size: int | str | None,
    budget: int | None,
) -> Run:
    model = copy.deepcopy(init)
    optimizer = optimizer_for(model)
    if micro_batch_size is None:
        step = full_batch_step(model, optimizer)
    else:
        step = accumulated_step(
            Accumulator(model, optimizer, micro_batch_size, memory_budget=budget)
        )
    task = bar.add_task(name, total=len(order))
    return train(Run(name, model, batch_size), step, data, order, lambda: bar.advance(task))


def _progress() -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "{task.description:>12}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )


def _row(run: Run, full: Run, acc: float, diff: float) -> list[str]:
    size = run.micro_batch_size()
    peak = run.peak_bytes()
    return [
        run.name,
        f"{size} x {-(-run.batch_size // size)}",
        _mib(peak),
        f"{peak / full.peak_bytes():.0%}",
        f"{run.time_s:.1f} s",
        f"{run.batch_size * len(run.losses) / run.time_s:,.0f}",
        f"{acc:.2%}",
        "—" if run is full else f"{diff:.0e}",
    ]


def print_demo(result: DemoResult) -> None:
    """The comparison table and the verdict line."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    full = result.runs[0]
    table = Table(
        title=f"digits MLP, batch {full.batch_size}, {len(full.losses)} AdamW steps, float64",
        caption="peak: the most memory a step adds; auto's budget: half the full batch's peak",
        box=box.SIMPLE_HEAD,
        padding=0,  # the box's blank column separates the cells: fits 80 columns
    )
    headers = ["run", "micro-batch\nx steps", "peak\nmemory", "vs full\nbatch", "time", "samples/s"]
    for name in headers + ["test\naccuracy", "weights:\nmax diff"]:
        table.add_column(name, justify="left" if name in headers[:2] else "right")
    for run, acc, diff in zip(result.runs, result.accuracies, result.differences, strict=True):
        table.add_row(*_row(run, full, acc, diff))
    console = Console()
    console.print(table)
    console.print(_verdict(result))
    console.print(f"plot: {result.plot_path}")


def _verdict(result: DemoResult) -> str:
    full, accumulated, auto = result.runs
    saved = full.peak_bytes() / max(accumulated.peak_bytes(), 1)
    memory = (
        f"peak memory {_mib(full.peak_bytes())} -> {_mib(accumulated.peak_bytes())} accumulated "
        f"({saved:.1f}x less) and {_mib(auto.peak_bytes())} auto, under a "
        f"{_mib(result.budget_bytes)} budget the full batch exceeds"
    )
    if result.exact():
        return (
            f"[bold green]Same result[/]: the weights agree to float64 rounding (max relative "
            f"difference {max(result.differences):.0e}), the same test accuracy "
            f"({result.accuracies[0]:.2%}); {memory}."
        )
    accuracies = ", ".join(f"{a:.2%}" for a in result.accuracies)
    return (
        f"[bold red]NOT as expected[/]: max relative weight difference "
        f"{max(result.differences):.1e}, test accuracies {accuracies}; {memory}."
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def plot_demo(runs: Sequence[Run], budget: int, path: str) -> str:
    """Draw the loss curves of the runs overlaid and their peak memory as bars; return ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    styles = [("-", 6, 0.35), ("--", 2.5, 1.0), (":", 2.5, 1.0)]
    for run, (style, width, alpha) in zip(runs, styles, strict=True):
        left.plot(
            range(1, len(run.losses) + 1), run.losses, style, lw=width, alpha=alpha, label=run.name
        )
    left.set(xlabel="optimizer step", ylabel="training loss", title="the same loss curve")
    left.legend()
    mib = [r.peak_bytes() / 2**20 for r in runs]
    right.bar(
        [f"{r.name}\nmicro-batch {r.micro_batch_size()}" for r in runs],
        mib,
        color=["C0", "C1", "C2"],
    )
    right.axhline(budget / 2**20, color="C3", ls="--", label=f"auto's budget ({_mib(budget)})")
    right.set(ylabel="peak memory per step (MiB)", title="less memory")
    right.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

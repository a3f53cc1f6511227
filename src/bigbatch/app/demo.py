"""Train one model three ways on the CPU and show that they give the same result on less
memory.

The data are scikit-learn's 1,797 bundled 8x8 digit images (no download; 1,400 to train, 397
held out). A wide MLP (64 -> 8192 -> 10, float64) is trained from the same initial weights on
the same batches of --batch-size images with AdamW:

  full batch    a plain PyTorch loop: the whole batch in one forward/backward per step
  accumulated   bigbatch.Accumulator(micro_batch_size=--micro-batch-size)
  auto          Accumulator(micro_batch_size="auto", memory_budget=half the full batch's peak)

The table gives each run's micro-batch, peak memory per step (the process's resident-set
high-water mark, measured), time, samples/s, test accuracy and the largest relative weight
difference from the full batch (float64 rounding: ~1e-15). The plot (--out) overlays the
loss curves and draws the peaks. Exit 0 when the weights agree and auto kept to its budget.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from bigbatch.app.report import print_table, save_png
from bigbatch.core.engine import Accumulator
from bigbatch.core.peak import measure_peak, small_mmap_threshold

EXACT = 1e-10  # float64: a difference above this is not rounding
MIN_BATCH = 256  # below, half the full batch's peak is less than the parameters' share alone


class Digits(NamedTuple):
    """The digits, scaled to [0, 1], split into a training and a held-out test set."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@dataclass
class Run:
    """What one of the three runs did: its training time and, per optimizer step, the loss
    (before the step), its micro-batch size, the windows redone over the budget and the bytes
    the step added."""

    name: str
    model: torch.nn.Module
    batch_size: int
    time_s: float
    losses: list[float]
    micro_batch_sizes: list[int]
    retries: list[int]
    step_peaks: list[int]

    def peak_bytes(self) -> int:
        """The run's peak: the most memory one of its steps added.

        Note [demo peaks]
            A run's peak is the most memory one optimizer step added above what was in use before it
            (``measure_peak`` on the CPU: the process's resident-set high-water mark), the quantity
            ``memory_budget`` caps. The first step of every run is left out (one-time allocations:
            the optimizer state, thread pools), and so are the auto run's steps that redid a window
            after going over the budget: on the CPU the budget is checked after each micro-batch, so
            the attempt that went over did touch that memory before it was discarded (on a GPU it
            would have been an out-of-memory error). The hidden layer is wide (8192) so that
            activations, which scale with the micro-batch, dominate the peak over the 0.6M
            parameters.
        """
        kept = [p for p, r in zip(self.step_peaks[1:], self.retries[1:], strict=True) if not r]
        return max(kept or self.step_peaks)


@dataclass(frozen=True)
class DemoResult:
    """The three runs (full batch, accumulated, auto), auto's budget (half the full batch's
    peak), each run's test accuracy and largest relative weight difference from the full batch."""

    runs: list[Run]
    budget_bytes: int
    accuracies: list[float]
    differences: list[float]
    plot_path: str

    def exact(self) -> bool:
        """Same weights to float64 rounding, the same accuracy, and auto under its budget."""
        full, _, auto = self.runs
        same = max(self.differences) < EXACT and len(set(self.accuracies)) == 1
        return same and auto.peak_bytes() <= self.budget_bytes < full.peak_bytes()


def load_digits(test_samples: int = 397, seed: int = 0) -> Digits:
    """scikit-learn's 1,797 bundled 8x8 digit images, shuffled and split, in float64.

    Raises:
        ImportError: scikit-learn is not installed (``pip install scikit-learn``).
    """
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as exc:
        raise ImportError(
            f"the demo's data come with scikit-learn ({exc}): run pip install "
            'scikit-learn (or pip install -e ".[demo]" in a clone).'
        ) from None
    digits = sklearn_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(seed))
    x = (torch.tensor(digits.data, dtype=torch.float64) / 16.0)[order]
    y = torch.tensor(digits.target, dtype=torch.long)[order]
    return Digits(x[test_samples:], y[test_samples:], x[:test_samples], y[:test_samples])


def make_model(hidden: int = 8192) -> torch.nn.Module:
    """The demo's MLP, 64 -> ``hidden`` -> 10, in float64."""
    layers = torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    return torch.nn.Sequential(*layers).double()


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of an ``(images, labels)`` batch."""
    return F.cross_entropy(model(batch[0]), batch[1])


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
        hidden: width of the MLP's hidden layer (64 -> hidden -> 10).

    Returns:
        The ``DemoResult``; ``.exact()`` says whether the runs agree.

    Raises:
        ValueError: ``steps``, ``batch_size`` or ``micro_batch_size`` out of range.
        ImportError: scikit-learn is not installed.
    """
    data = load_digits()
    n = len(data.y_train)
    if steps < 2:
        raise ValueError(f"steps={steps} is too few: use 2 or more (the first step is a warm-up).")
    if not MIN_BATCH <= batch_size <= n:
        raise ValueError(
            f"batch_size={batch_size} is not allowed: use {MIN_BATCH} to {n} (the "
            "training images; below, auto's budget cannot hold the step)."
        )
    if not 1 <= micro_batch_size <= batch_size:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} is not allowed: use 1 to the batch "
            f"size ({batch_size})."
        )
    gen = torch.Generator().manual_seed(0)  # each step: batch_size distinct samples, afresh
    order = [torch.randperm(n, generator=gen)[:batch_size] for _ in range(steps)]
    torch.manual_seed(0)
    init = make_model(hidden)
    with small_mmap_threshold():  # Note [honest CPU peaks] in memory.peak
        _train("warm-up", init, data, order[:1])  # one-time allocations
        full = _train("full batch", init, data, order)
        budget = full.peak_bytes() // 2
        accumulated = _train("accumulated", init, data, order, micro_batch_size)
        runs = [full, accumulated, _train("auto", init, data, order, "auto", budget)]
    with torch.no_grad():
        predictions = [r.model(data.x_test).argmax(1) for r in runs]
        hits = [float((p == data.y_test).double().mean()) for p in predictions]
        pairs = [zip(full.model.parameters(), r.model.parameters(), strict=True) for r in runs]
        differences = [max(float((p - q).norm() / p.norm()) for p, q in pair) for pair in pairs]
    result = DemoResult(runs, budget, hits, differences, plot_demo(runs, budget, out))
    print_demo(result)
    return result


def _train(
    name: str,
    init: torch.nn.Module,
    data: Digits,
    order: list[torch.Tensor],
    micro_batch_size: int | str | None = None,
    budget: int | None = None,
) -> Run:
    """One run: a plain full-batch loop (``micro_batch_size=None``) or an ``Accumulator``."""
    from rich.progress import track

    model = copy.deepcopy(init)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    plain = micro_batch_size is None
    acc = None if plain else Accumulator(model, optimizer, micro_batch_size, memory_budget=budget)
    steps, start = [], time.perf_counter()
    for idx in order if name == "warm-up" else track(order, f"{name:>12}"):
        batch = (data.x_train[idx], data.y_train[idx])
        with measure_peak("cpu") as peak:
            if acc is None:  # the plain PyTorch step the others must reproduce
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model, batch)
                loss.backward()
                optimizer.step()
                step = (float(loss.detach()), len(idx), 0)
            else:
                result = acc.train_step(batch, loss_fn)
                step = (result.loss, int(result.micro_batch_size or 0), result.oom_retries)
        steps.append((*step, peak.peak_bytes))
    columns = map(list, zip(*steps, strict=True))  # losses, micro-batch sizes, retries, peaks
    return Run(name, model, len(order[0]), time.perf_counter() - start, *columns)


def print_demo(result: DemoResult) -> None:
    """The comparison table and the verdict line."""
    from rich import box

    full, rows = result.runs[0], []
    for run, acc, diff in zip(result.runs, result.accuracies, result.differences, strict=True):
        size, peak = run.micro_batch_sizes[-1], run.peak_bytes()
        rows.append(
            (
                run.name,
                f"{size} x {-(-run.batch_size // size)}",
                _mib(peak),
                f"{peak / full.peak_bytes():.0%}",
                f"{run.time_s:.1f} s",
                f"{run.batch_size * len(run.losses) / run.time_s:,.0f}",
                f"{acc:.2%}",
                "—" if run is full else f"{diff:.0e}",
            )
        )
    columns = [
        "run",
        "micro-batch\nx steps",
        "peak\nmemory",
        "vs full\nbatch",
        "time",
        "samples/s",
        "test\naccuracy",
        "weights:\nmax diff",
    ]
    console = print_table(
        f"digits MLP, batch {full.batch_size}, {len(full.losses)} AdamW steps, float64",
        columns,
        rows,
        right=2,
        box=box.SIMPLE_HEAD,
        padding=0,  # the box's blank column
        caption="peak: the most memory a step adds; auto's budget: half the full batch's peak",
    )
    console.print(f"{_verdict(result)}\nplot: {result.plot_path}")


def _verdict(result: DemoResult) -> str:
    full, accumulated, auto = (r.peak_bytes() for r in result.runs)
    accuracies = ", ".join(sorted({f"{a:.2%}" for a in result.accuracies}))
    head = (
        "[bold green]Same result[/]: the weights agree to float64 rounding"
        if result.exact()
        else "[bold red]NOT as expected[/]: the weights differ"
    )
    return (
        f"{head} (max relative difference {max(result.differences):.0e}), test accuracy "
        f"{accuracies}; peak memory {_mib(full)} -> {_mib(accumulated)} accumulated ("
        f"{full / max(accumulated, 1):.1f}x less) and {_mib(auto)} auto, under a "
        f"{_mib(result.budget_bytes)} budget the full batch exceeds."
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def plot_demo(runs: list[Run], budget: int, path: str) -> str:
    """Draw the loss curves of the runs overlaid and their peak memory as bars; return ``path``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="tight")
    left, right = fig.subplots(1, 2)
    styles = [("-", 6, 0.35), ("--", 2.5, 1.0), (":", 2.5, 1.0)]
    for run, (style, width, alpha) in zip(runs, styles, strict=True):
        steps = range(1, len(run.losses) + 1)
        left.plot(steps, run.losses, style, lw=width, alpha=alpha, label=run.name)
    left.set(xlabel="optimizer step", ylabel="training loss", title="the same loss curve")
    names = [f"{r.name}\nmicro-batch {r.micro_batch_sizes[-1]}" for r in runs]
    right.bar(names, [r.peak_bytes() / 2**20 for r in runs], color=["C0", "C1", "C2"])
    right.axhline(budget / 2**20, color="C3", ls="--", label=f"auto's budget ({_mib(budget)})")
    right.set(ylabel="peak memory per step (MiB)", title="less memory")
    left.legend()
    right.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return save_png(fig, path)

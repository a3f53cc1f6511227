"""The planner: measure a few ways to cut a batch, fit memory against micro-batch, choose, say why.

Note [what the planner measures]
    Each configuration (micro-batch ``m``, checkpointing fraction ``f``) runs real optimizer
    steps of the whole effective batch on a deep copy of the model and optimizer: one warm-up
    step, then the median of ``steps`` timed steps. Its peak is ``measure_peak`` around all of
    it, so it counts what training needs above what was in use before: the copy of the
    parameters, their gradients, the optimizer state and the activations of one micro-batch
    (accumulation keeps only the gradients between micro-batches). Within one fraction the peak
    grows about linearly with the micro-batch, ``peak ≈ a + b·m``: ``a`` is the model, gradients
    and optimizer state, ``b`` the activations per sample. Sizes are measured smallest first;
    once one does not fit the budget the larger ones of that fraction are not run, only
    predicted by the fit. The choice is the fastest measured configuration that fits.

Note [honest CPU peaks] (in ``bigbatch.memory.peak``)
    On the CPU the planner measures inside ``small_mmap_threshold()``, and first runs one untimed
    step so that one-time allocations (thread pools, kernel caches) are not charged to the first
    configuration measured. The process's malloc settings are put back when ``plan`` returns.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch._units import format_bytes, parse_bytes
from bigbatch.engine import Accumulator
from bigbatch.loss import LossFn
from bigbatch.memory.checkpointing import enable_checkpointing, find_blocks
from bigbatch.memory.oom import MemoryBudgetExceeded, is_out_of_memory, release_memory
from bigbatch.memory.peak import measure_peak, resolve_device, small_mmap_threshold
from bigbatch.split import Batch, split
from bigbatch.split import batch_size as count_samples

OptimizerArg = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None
"""An optimizer over the model's parameters (copied with it), a factory ``f(params)``, or None."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to run a step of the effective batch, and what it cost.

    Attributes:
        micro_batch_size: samples per micro-batch.
        gradient_accumulation_steps: micro-batches per optimizer step (the last may be smaller).
        checkpointing: fraction of the repeated blocks checkpointed (0 = none, 1 = all).
        peak_bytes: peak memory of a step (measured, or predicted by the fit when not measured).
        seconds_per_step: median time of one optimizer step; ``None`` when not measured.
        samples_per_s: effective batch / seconds_per_step; ``None`` when not measured.
        fits: whether ``peak_bytes`` is within the memory budget.
        measured: ``False`` when the size was only predicted (a smaller one already did not fit).
        out_of_memory: the measurement itself ran out of memory.
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    checkpointing: float
    peak_bytes: int
    seconds_per_step: float | None
    samples_per_s: float | None
    fits: bool
    measured: bool = True
    out_of_memory: bool = False

    def describe(self) -> str:
        """``"micro-batch 16 x 4 steps with half the blocks checkpointed"``."""
        ckpt = {0.0: "without checkpointing", 1.0: "with every block checkpointed"}.get(
            self.checkpointing, f"with {self.checkpointing:.0%} of the blocks checkpointed"
        )
        return (
            f"micro-batch {self.micro_batch_size} x {self.gradient_accumulation_steps} steps {ckpt}"
        )


@dataclass(frozen=True)
class MemoryFit:
    """Least-squares line ``peak_bytes ≈ base_bytes + bytes_per_sample · micro_batch_size``."""

    checkpointing: float
    base_bytes: float
    bytes_per_sample: float

    def predict(self, micro_batch_size: int) -> int:
        """Predicted peak bytes at ``micro_batch_size``."""
        return int(self.base_bytes + self.bytes_per_sample * micro_batch_size)

    def largest_fitting(self, memory_budget: int) -> int:
        """Largest micro-batch the line keeps within ``memory_budget`` (0 if none)."""
        if self.bytes_per_sample <= 0:
            return 0 if self.base_bytes > memory_budget else 2**31
        return max(0, math.floor((memory_budget - self.base_bytes) / self.bytes_per_sample))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The planner's result: every configuration, the memory fits, the choice and why.

    Attributes:
        choice: the fastest measured configuration whose peak fits the budget.
        naive: the smallest micro-batch with the most checkpointing (the usual safe guess).
        candidates: every configuration, measured or predicted, in measuring order.
        fits: one ``MemoryFit`` per checkpointing fraction with at least two measured sizes.
        memory_budget: bytes a step may use.
        batch_size: the effective batch (samples per optimizer step).
        device: where it was measured.
        reason: one or two sentences saying why ``choice`` was chosen.
    """

    choice: Candidate
    naive: Candidate
    candidates: tuple[Candidate, ...]
    fits: tuple[MemoryFit, ...]
    memory_budget: int
    batch_size: int
    device: str
    reason: str

    @property
    def headroom_bytes(self) -> int:
        """Budget left above the choice's peak."""
        return self.memory_budget - self.choice.peak_bytes

    @property
    def speedup_over_naive(self) -> float:
        """Naive seconds per step / chosen seconds per step."""
        return (self.naive.seconds_per_step or math.nan) / (
            self.choice.seconds_per_step or math.nan
        )


def plan(
    model: torch.nn.Module,
    batch: Batch | Callable[[int], Batch],
    loss_fn: LossFn,
    batch_size: int | None = None,
    *,
    memory_budget: int | str | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    checkpointing: Sequence[float] | None = None,
    optimizer: OptimizerArg = None,
    steps: int = 3,
) -> Plan:
    """Find the fastest way to cut ``batch_size`` samples into micro-batches that fits in memory.

    Measures time per optimizer step and peak memory for each micro-batch size and
    checkpointing fraction (see Note [what the planner measures]), fits how memory grows with
    the micro-batch, and chooses the fastest configuration that fits ``memory_budget``. The
    model and optimizer are deep-copied for each configuration: yours are not changed.

    Args:
        model: the module to train, on the device to plan for.
        batch: one effective batch (``batch_size`` samples), or ``batch_fn(n)`` returning ``n``.
        loss_fn: ``loss_fn(model, micro_batch)`` returning a scalar mean or ``(loss_sum, count)``.
        batch_size: samples per optimizer step; default: the size of ``batch``.
        memory_budget: bytes a step may use (``"6GiB"``); default: the CUDA device's total
            memory, or on the CPU the system's available memory (``MemAvailable``).
        micro_batch_sizes: sizes to try; default: powers of two from ``batch_size / 32`` up,
            and ``batch_size`` itself.
        checkpointing: fractions of the repeated blocks to checkpoint; default ``(0, 0.5, 1)``
            (only ``0`` when the model has no repeated blocks).
        optimizer: an optimizer over ``model``'s parameters (copied with it), a factory
            ``optimizer(params)``, or ``None`` for ``AdamW``. Its state counts in the peak.
        steps: timed optimizer steps per configuration (after one warm-up step).

    Returns:
        A ``Plan``; ``plan.choice`` is the configuration to use, ``plan.reason`` says why.

    Raises:
        ValueError: bad sizes or fractions, or a batch whose size is not ``batch_size``.
        MemoryBudgetExceeded: no measured configuration fits the budget.

    Example:
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(2)])
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b), b)
        >>> p = plan(net, torch.randn(8, 8), mse, micro_batch_sizes=[4, 8], steps=1)
        >>> p.choice.micro_batch_size in (4, 8)
        True
    """
    full = _full_batch(batch, batch_size)
    n = count_samples(full)
    sizes = _check_sizes(micro_batch_sizes, n)
    fractions = _check_fractions(checkpointing, model)
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps={steps!r} is not allowed: use a positive integer, e.g. steps=3.")
    device = resolve_device(next(model.parameters()).device)
    budget = parse_bytes(memory_budget) or default_budget(device)
    cpu = device.type == "cpu"
    with small_mmap_threshold() if cpu else contextlib.nullcontext():  # Note [honest CPU peaks]
        _warm_up(model, optimizer, full, loss_fn, sizes[0])
        candidates: list[Candidate] = []
        fits: list[MemoryFit] = []
        for fraction in fractions:
            measured = _measure_fraction(
                model, optimizer, full, loss_fn, sizes, fraction, steps, budget
            )
            fit = fit_memory([c for c in measured if not c.out_of_memory], fraction)
            fits += [fit] if fit else []
            candidates += measured + _predicted(
                sizes[len(measured) :], n, fraction, fit, measured[-1]
            )
    return _choose(candidates, tuple(fits), budget, n, str(device))


def _measure_fraction(
    model: torch.nn.Module,
    optimizer: OptimizerArg,
    batch: Batch,
    loss_fn: LossFn,
    sizes: Sequence[int],
    fraction: float,
    steps: int,
    budget: int,
) -> list[Candidate]:
    """Measure ``sizes`` smallest first, stopping after the first that does not fit."""
    measured: list[Candidate] = []
    for m in sizes:
        if measured and not measured[-1].fits:
            break
        measured.append(_measure(model, optimizer, batch, loss_fn, m, fraction, steps, budget))
    return measured


def fit_memory(measured: Sequence[Candidate], checkpointing: float) -> MemoryFit | None:
    """Least-squares ``peak ≈ a + b·m`` over measured candidates; ``None`` with fewer than two sizes."""
    points = [(c.micro_batch_size, c.peak_bytes) for c in measured]
    if len({m for m, _ in points}) < 2:
        return None
    mean_m = statistics.fmean(m for m, _ in points)
    mean_p = statistics.fmean(p for _, p in points)
    slope = sum((m - mean_m) * (p - mean_p) for m, p in points) / sum(
        (m - mean_m) ** 2 for m, _ in points
    )
    return MemoryFit(checkpointing, mean_p - slope * mean_m, slope)


def default_budget(device: torch.device) -> int:
    """The CUDA device's total memory, or the CPU system's available memory (``MemAvailable``)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError(
        'cannot read MemAvailable from /proc/meminfo: pass memory_budget, e.g. "6GiB".'
    )


def _measure(
    model: torch.nn.Module,
    optimizer: OptimizerArg,
    batch: Batch,
    loss_fn: LossFn,
    micro_batch_size: int,
    fraction: float,
    steps: int,
    budget: int,
) -> Candidate:
    n = count_samples(batch)
    k = math.ceil(n / micro_batch_size)
    device = resolve_device(next(model.parameters()).device)
    seconds: list[float] = []
    try:
        with measure_peak(device) as peak:
            net, opt = _copy(model, optimizer)
            if fraction > 0:
                enable_checkpointing(net, fraction=fraction)
            acc = Accumulator(net, opt, micro_batch_size=micro_batch_size)
            for step in range(steps + 1):  # the first is a warm-up
                start = time.perf_counter()
                acc.train_step(batch, loss_fn)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds += [time.perf_counter() - start] if step else []
            del net, opt, acc
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        del exc
        release_memory(device)
        return Candidate(
            micro_batch_size=micro_batch_size, gradient_accumulation_steps=k,
            checkpointing=fraction, peak_bytes=budget + 1, seconds_per_step=None,
            samples_per_s=None, fits=False, out_of_memory=True,
        )  # fmt: skip
    t = statistics.median(seconds)
    return Candidate(
        micro_batch_size=micro_batch_size, gradient_accumulation_steps=k, checkpointing=fraction,
        peak_bytes=peak.peak_bytes, seconds_per_step=t, samples_per_s=n / t,
        fits=peak.peak_bytes <= budget,
    )  # fmt: skip


def _warm_up(
    model: torch.nn.Module,
    optimizer: OptimizerArg,
    batch: Batch,
    loss_fn: LossFn,
    micro_batch_size: int,
) -> None:
    net, opt = _copy(model, optimizer)
    Accumulator(net, opt, micro_batch_size=micro_batch_size).train_step(
        split(batch, micro_batch_size)[0], loss_fn
    )


def _copy(model: torch.nn.Module, optimizer: OptimizerArg) -> tuple[torch.nn.Module, Any]:
    if isinstance(optimizer, torch.optim.Optimizer):
        return copy.deepcopy((model, optimizer))  # one memo: the copy steps the copied parameters
    net = copy.deepcopy(model)
    factory = optimizer if optimizer is not None else torch.optim.AdamW
    return net, factory(net.parameters())


def _predicted(
    sizes: Sequence[int],
    n: int,
    fraction: float,
    fit: MemoryFit | None,
    last: Candidate,
) -> list[Candidate]:
    # Larger than a size that did not fit: the peak only grows with the micro-batch.
    return [
        Candidate(
            micro_batch_size=m, gradient_accumulation_steps=math.ceil(n / m),
            checkpointing=fraction, peak_bytes=max(fit.predict(m) if fit else 0, last.peak_bytes),
            seconds_per_step=None, samples_per_s=None, fits=False, measured=False,
        )
        for m in sizes
    ]  # fmt: skip


def _choose(
    candidates: list[Candidate], fits: tuple[MemoryFit, ...], budget: int, n: int, device: str
) -> Plan:
    fitting = [c for c in candidates if c.fits and c.seconds_per_step is not None]
    measured = [c for c in candidates if c.measured and not c.out_of_memory]
    if not fitting:
        smallest = min(measured, key=lambda c: c.peak_bytes, default=None)
        lowest = (
            f"{format_bytes(smallest.peak_bytes)} ({smallest.describe()})"
            if smallest
            else "none (all ran out of memory)"
        )
        raise MemoryBudgetExceeded(
            f"no configuration fits memory_budget={format_bytes(budget)}: the smallest peak measured "
            f"was {lowest}. Raise memory_budget, try smaller micro_batch_sizes (down to 1), "
            "checkpointing=(1.0,), a lower precision, or a smaller model or sequence length."
        )
    choice = min(fitting, key=lambda c: c.seconds_per_step or math.inf)
    naive = min(measured, key=lambda c: (c.micro_batch_size, -c.checkpointing))
    return Plan(
        choice=choice, naive=naive, candidates=tuple(candidates), fits=fits,
        memory_budget=budget, batch_size=n, device=device,
        reason=_reason(choice, naive, candidates, budget),
    )  # fmt: skip


def _reason(choice: Candidate, naive: Candidate, candidates: list[Candidate], budget: int) -> str:
    text = (
        f"{choice.describe()} is the fastest that fits: {format_bytes(choice.peak_bytes)} "
        f"of {format_bytes(budget)}"
    )
    # The configuration that would have been next: same checkpointing, next larger micro-batch.
    bigger = [
        c
        for c in candidates
        if c.checkpointing == choice.checkpointing and c.micro_batch_size > choice.micro_batch_size
    ]
    if bigger and not bigger[0].fits:
        how = "needs" if bigger[0].measured else "would need (predicted)"
        text += (
            f"; micro-batch {bigger[0].micro_batch_size} {how} {format_bytes(bigger[0].peak_bytes)}"
        )
    if naive is not choice and naive.seconds_per_step and choice.seconds_per_step:
        text += (
            f"; {naive.seconds_per_step / choice.seconds_per_step:.2f}x the speed of the naive "
            f"{naive.describe()}"
        )
    return text + "."


def _full_batch(batch: Batch | Callable[[int], Batch], batch_size: int | None) -> Batch:
    if callable(batch):
        if batch_size is None:
            raise ValueError("batch is a function: pass batch_size, e.g. plan(..., batch_size=64).")
        return batch(batch_size)
    n = count_samples(batch)
    if batch_size is not None and batch_size != n:
        raise ValueError(
            f"batch_size={batch_size} but the batch has {n} samples: pass one effective batch, or "
            "a function batch_fn(n) that returns n samples."
        )
    return batch


def _check_sizes(sizes: Sequence[int] | None, n: int) -> list[int]:
    if sizes is None:
        powers = [2**i for i in range(n.bit_length()) if n / 32 <= 2**i < n]
        return powers + [n]
    bad = [s for s in sizes if not (isinstance(s, int) and 1 <= s <= n)]
    if not sizes or bad:
        raise ValueError(
            f"micro_batch_sizes={list(sizes)!r} is not allowed: use integers from 1 to the batch "
            f"size {n}, e.g. micro_batch_sizes=[1, 2, 4]."
        )
    return sorted(set(sizes))


def _check_fractions(fractions: Sequence[float] | None, model: torch.nn.Module) -> list[float]:
    if fractions is None:
        try:
            find_blocks(model)
        except ValueError:
            return [0.0]  # no repeated blocks: nothing to checkpoint
        return [0.0, 0.5, 1.0]
    bad = [f for f in fractions if not (isinstance(f, (int, float)) and 0 <= f <= 1)]
    if not fractions or bad:
        raise ValueError(
            f"checkpointing={list(fractions)!r} is not allowed: use fractions of the blocks in "
            "[0, 1], e.g. checkpointing=(0, 0.5, 1)."
        )
    return sorted({float(f) for f in fractions})

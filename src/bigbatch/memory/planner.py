"""The planner: measure ways to cut a batch and to checkpoint, choose one that fits, say why.

Note [what the planner measures]
    Each configuration (micro-batch ``m``, checkpointing option: none, ``selective``, a fraction
    of whole-block recompute, ``offload`` on CUDA) runs real optimizer steps of the whole
    effective batch on a deep copy of the model and optimizer: one warm-up step, then ``steps``
    timed steps (their median is the time, their spread the noise: ``Candidate.noise_seconds``).
    Its peak is ``measure_peak`` around all of it, so it counts what training needs above what
    was in use before: the copy of the parameters, their gradients, the optimizer state and the
    activations of one micro-batch (accumulation keeps only the gradients between
    micro-batches). Within one option the peak grows about linearly with the micro-batch,
    ``peak ≈ a + b·m``: ``a`` is the model, gradients and optimizer state, ``b`` the activations
    per sample. Sizes are measured smallest first; once one does not fit, the larger ones of
    that option are not run, only predicted by the fit.

Note [safety margin]
    A peak is one run's reading; training the same step later can take a little more (another
    allocation order, fragmentation, a library's workspace, a CPU reading that moved by a few
    pages). So a configuration fits only when its peak is within the budget less ``margin``
    (10% by default): the choice keeps at least that much headroom.

Note [ties and headroom] (in ``bigbatch.memory._candidates``) decides between the fitting ones.

Note [honest CPU peaks] (in ``bigbatch.core.peak``)
    On the CPU the planner measures inside ``small_mmap_threshold()``, and first runs one untimed
    micro-batch per checkpointing option so that one-time allocations (thread pools, kernel
    caches, checkpointing's machinery) are not charged to the first configuration measured.
    The process's malloc settings are put back when ``plan`` returns.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.core._units import parse_bytes
from bigbatch.core.engine import Accumulator
from bigbatch.core.loss import LossFn
from bigbatch.core.oom import MemoryBudgetExceeded, is_out_of_memory, release_memory
from bigbatch.core.peak import measure_peak, resolve_device, small_mmap_threshold
from bigbatch.core.split import Batch, split
from bigbatch.core.split import batch_size as count_samples
from bigbatch.memory._candidates import (
    POLICIES,
    Candidate,
    Option,
    decide,
    explain,
    nothing_fits,
    option_label,
    parse_option,
    ranked,
    too_close_to_call,
    usable,
    with_savings,
)
from bigbatch.memory.checkpointing import enable_checkpointing, find_blocks

OptimizerArg = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None
"""An optimizer over the model's parameters (copied with it), a factory ``f(params)``, or None."""


@dataclass(frozen=True)
class MemoryFit:
    """Least-squares line ``peak_bytes ≈ base_bytes + bytes_per_sample · micro_batch_size``."""

    checkpointing: float
    base_bytes: float
    bytes_per_sample: float
    policy: str = "full"

    @property
    def label(self) -> str:
        """The option's short name (``Candidate.label``)."""
        return option_label((self.policy, self.checkpointing))

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
        choice: the configuration to use (Note [ties and headroom]).
        naive: the smallest micro-batch with the most checkpointing (the usual safe guess).
        candidates: every configuration, measured or predicted, in measuring order.
        fits: one ``MemoryFit`` per checkpointing option with at least two measured sizes.
        memory_budget: bytes a step may use.
        batch_size: the effective batch (samples per optimizer step).
        device: where it was measured.
        reason: why ``choice`` was chosen, the runner-up and why it lost, and what to know.
        margin: the safety margin: a configuration fits within ``memory_budget * (1 - margin)``.
        runner_up: the best other configuration that fits (``None`` if there is none).
        skipped: checkpointing policies not tried here, each with why.
    """

    choice: Candidate
    naive: Candidate
    candidates: tuple[Candidate, ...]
    fits: tuple[MemoryFit, ...]
    memory_budget: int
    batch_size: int
    device: str
    reason: str
    margin: float = 0.1
    runner_up: Candidate | None = None
    skipped: tuple[str, ...] = ()

    @property
    def usable_bytes(self) -> int:
        """The budget less the safety margin: what a configuration's peak must stay within."""
        return usable(self.memory_budget, self.margin)

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


@dataclass(frozen=True)
class _Setup:
    """What every measurement of one plan shares."""

    model: torch.nn.Module
    optimizer: OptimizerArg
    batch: Batch
    loss_fn: LossFn
    steps: int
    budget: int
    margin: float
    device: torch.device

    @property
    def usable(self) -> int:
        """The budget less the margin (Note [safety margin])."""
        return usable(self.budget, self.margin)


def plan(
    model: torch.nn.Module,
    batch: Batch | Callable[[int], Batch],
    loss_fn: LossFn,
    batch_size: int | None = None,
    *,
    memory_budget: int | str | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    checkpointing: Sequence[float | str] | None = None,
    optimizer: OptimizerArg = None,
    steps: int = 3,
    margin: float = 0.1,
) -> Plan:
    """Find a fast way to cut ``batch_size`` samples into micro-batches that fits in memory.

    Measures time per optimizer step and peak memory for each micro-batch size and
    checkpointing option (Note [what the planner measures]), fits how memory grows with the
    micro-batch, and chooses the fastest configuration whose peak stays within
    ``memory_budget`` less ``margin`` (Note [safety margin]); configurations whose times are
    within the measured noise tie, and a tie goes to the one with more headroom (Note [ties
    and headroom]), so repeated plans choose alike. The model and optimizer are deep-copied
    for each configuration: yours are not changed.

    Args:
        model: the module to train, on the device to plan for.
        batch: one effective batch (``batch_size`` samples), or ``batch_fn(n)`` returning ``n``.
        loss_fn: ``loss_fn(model, micro_batch)`` returning a scalar mean or ``(loss_sum, count)``.
        batch_size: samples per optimizer step; default: the size of ``batch``.
        memory_budget: bytes a step may use (``"6GiB"``); default: the CUDA device's total
            memory, or on the CPU the system's available memory (``MemAvailable``).
        micro_batch_sizes: sizes to try; default: powers of two from ``batch_size / 32`` up,
            and ``batch_size`` itself.
        checkpointing: options to try: fractions of the repeated blocks recomputed whole
            (``0`` = none, ``1`` = all) and policy names ``"none"``, ``"selective"``,
            ``"full"``, ``"offload"`` (every block), or ``"selective:0.5"`` for a fraction.
            Default ``("none", "selective", 0.5, 1)``, plus ``"offload"`` on CUDA, leaving out
            a policy that this torch cannot run; only ``"none"`` without repeated blocks.
        optimizer: an optimizer over ``model``'s parameters (copied with it), a factory
            ``optimizer(params)``, or ``None`` for ``AdamW``. Its state counts in the peak.
        steps: timed optimizer steps per configuration (after one warm-up step); at least 2
            give a measure of the noise.
        margin: fraction of ``memory_budget`` kept free, in [0, 1).

    Returns:
        A ``Plan``; ``plan.choice`` is the configuration to use, ``plan.reason`` says why.

    Raises:
        ValueError: bad sizes, options, steps or margin, or a batch whose size is not
            ``batch_size``.
        MemoryBudgetExceeded: no measured configuration fits the budget less the margin.

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
    device = resolve_device(next(model.parameters()).device)
    options, skipped = _check_options(checkpointing, model, device)
    _check_steps_and_margin(steps, margin)
    budget = parse_bytes(memory_budget) or default_budget(device)
    setup = _Setup(model, optimizer, full, loss_fn, steps, budget, margin, device)
    with small_mmap_threshold() if device.type == "cpu" else contextlib.nullcontext():
        _warm_up(setup, sizes[0], options)  # Note [honest CPU peaks]
        candidates, fits = _measure_all(setup, options, sizes)
        candidates = _settle(setup, candidates)
    return _choose(setup, candidates, tuple(fits), tuple(skipped))


def _measure_all(
    setup: _Setup, options: Sequence[Option], sizes: Sequence[int]
) -> tuple[list[Candidate], list[MemoryFit]]:
    """Every option at every size, smallest first, until a size does not fit; then the fits."""
    n = count_samples(setup.batch)
    candidates: list[Candidate] = []
    fits: list[MemoryFit] = []
    for option in options:
        measured: list[Candidate] = []
        for m in sizes:
            if measured and not measured[-1].fits:
                break
            measured.append(_measure(setup, m, option))
        fit = fit_memory([c for c in measured if not c.out_of_memory])
        fits += [fit] if fit else []
        candidates += measured + _predicted(sizes[len(measured) :], n, fit, measured[-1])
    return with_savings(candidates), fits


def fit_memory(measured: Sequence[Candidate]) -> MemoryFit | None:
    """Least-squares ``peak ≈ a + b·m`` over measured candidates of one option; ``None`` with
    fewer than two sizes."""
    points = [(c.micro_batch_size, c.peak_bytes) for c in measured]
    if len({m for m, _ in points}) < 2:
        return None
    mean_m = statistics.fmean(m for m, _ in points)
    mean_p = statistics.fmean(p for _, p in points)
    slope = sum((m - mean_m) * (p - mean_p) for m, p in points) / sum(
        (m - mean_m) ** 2 for m, _ in points
    )
    first = measured[0]
    return MemoryFit(first.checkpointing, mean_p - slope * mean_m, slope, first.policy)


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


def _measure(setup: _Setup, micro_batch_size: int, option: Option) -> Candidate:
    n = count_samples(setup.batch)
    k = math.ceil(n / micro_batch_size)
    policy, fraction = option
    seconds: list[float] = []
    try:
        with measure_peak(setup.device) as peak:
            net, opt = _copy(setup.model, setup.optimizer)
            if policy != "none":
                enable_checkpointing(net, fraction=fraction, policy=policy)
            acc = Accumulator(net, opt, micro_batch_size=micro_batch_size)
            for step in range(setup.steps + 1):  # the first is a warm-up
                start = time.perf_counter()
                acc.train_step(setup.batch, setup.loss_fn)
                if setup.device.type == "cuda":
                    torch.cuda.synchronize(setup.device)
                seconds += [time.perf_counter() - start] if step else []
            del net, opt, acc
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        del exc
        release_memory(setup.device)
        return Candidate(
            micro_batch_size=micro_batch_size, gradient_accumulation_steps=k,
            checkpointing=fraction, policy=policy, peak_bytes=setup.usable + 1,
            seconds_per_step=None, samples_per_s=None, fits=False, out_of_memory=True,
        )  # fmt: skip
    t = statistics.median(seconds)
    return Candidate(
        micro_batch_size=micro_batch_size, gradient_accumulation_steps=k, checkpointing=fraction,
        policy=policy, peak_bytes=peak.peak_bytes, seconds_per_step=t, samples_per_s=n / t,
        fits=peak.peak_bytes <= setup.usable, step_seconds=tuple(seconds),
    )  # fmt: skip


def _warm_up(setup: _Setup, micro_batch_size: int, options: Sequence[Option]) -> None:
    """One untimed micro-batch per option, so that what runs once per process (thread pools,
    kernel caches, checkpointing's machinery) is not charged to the first configuration."""
    net, opt = _copy(setup.model, setup.optimizer)
    first = split(setup.batch, micro_batch_size)[0]
    for policy, fraction in options:
        if policy != "none":
            enable_checkpointing(net, fraction=fraction, policy=policy)
        Accumulator(net, opt, micro_batch_size=micro_batch_size).train_step(first, setup.loss_fn)


def _copy(model: torch.nn.Module, optimizer: OptimizerArg) -> tuple[torch.nn.Module, Any]:
    if isinstance(optimizer, torch.optim.Optimizer):
        return copy.deepcopy((model, optimizer))  # one memo: the copy steps the copied parameters
    net = copy.deepcopy(model)
    factory = optimizer if optimizer is not None else torch.optim.AdamW
    return net, factory(net.parameters())


def _predicted(
    sizes: Sequence[int], n: int, fit: MemoryFit | None, last: Candidate
) -> list[Candidate]:
    # Larger than a size that did not fit: the peak only grows with the micro-batch.
    return [
        dataclasses.replace(
            last, micro_batch_size=m, gradient_accumulation_steps=math.ceil(n / m),
            peak_bytes=max(fit.predict(m) if fit else 0, last.peak_bytes), seconds_per_step=None,
            samples_per_s=None, fits=False, measured=False, out_of_memory=False, step_seconds=(),
        )
        for m in sizes
    ]  # fmt: skip


def _settle(setup: _Setup, candidates: list[Candidate]) -> list[Candidate]:
    """Measure again, in reverse order, the best configurations if they are too close to call."""
    close = too_close_to_call(candidates)
    again = {id(c): _remeasure(setup, c) for c in sorted(close, key=candidates.index)[::-1]}
    return [again.get(id(c), c) for c in candidates]


def _remeasure(setup: _Setup, first: Candidate) -> Candidate:
    second = _measure(setup, first.micro_batch_size, (first.policy, first.checkpointing))
    if second.out_of_memory:
        return dataclasses.replace(second, remeasured=True)
    times = first.step_seconds + second.step_seconds
    peak = max(first.peak_bytes, second.peak_bytes)
    t = min(first.seconds_per_step or math.inf, second.seconds_per_step or math.inf)
    saved = None if first.saved_bytes is None else first.saved_bytes - (peak - first.peak_bytes)
    return dataclasses.replace(
        first, step_seconds=times, seconds_per_step=t, samples_per_s=count_samples(setup.batch) / t,
        peak_bytes=peak, fits=peak <= setup.usable, saved_bytes=saved, remeasured=True,
    )  # fmt: skip


def _choose(
    setup: _Setup,
    candidates: list[Candidate],
    fits: tuple[MemoryFit, ...],
    skipped: tuple[str, ...],
) -> Plan:
    measured = [c for c in candidates if c.measured and not c.out_of_memory]
    if not ranked(candidates):
        raise MemoryBudgetExceeded(nothing_fits(measured, setup.budget, setup.margin))
    choice, runner_up, _ = decide(candidates)
    naive = min(measured, key=lambda c: (c.micro_batch_size, -c.checkpointing, c.policy != "full"))
    reason = explain(candidates, naive, setup.budget, setup.margin)
    return Plan(
        choice=choice, naive=naive, candidates=tuple(candidates), fits=fits,
        memory_budget=setup.budget, batch_size=count_samples(setup.batch), device=str(setup.device),
        reason=reason, margin=setup.margin, runner_up=runner_up, skipped=skipped,
    )  # fmt: skip


# ---------------------------------------------------------------------------- arguments
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


def _check_steps_and_margin(steps: int, margin: float) -> None:
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps={steps!r} is not allowed: use a positive integer, e.g. steps=3.")
    if isinstance(margin, bool) or not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ValueError(
            f"margin={margin!r} is not allowed: use the fraction of the budget to keep free, in "
            "[0, 1), e.g. margin=0.1 (10%)."
        )


def _check_options(
    spec: Sequence[float | str] | None, model: torch.nn.Module, device: torch.device
) -> tuple[list[Option], list[str]]:
    """The checkpointing options to measure, and the default policies left out (with why)."""
    if spec is None:
        return _default_options(model, device)
    options = [] if isinstance(spec, str) else [parse_option(o) for o in spec]
    if not options or None in options:
        shown = spec if isinstance(spec, str) else list(spec)
        raise ValueError(
            f"checkpointing={shown!r} is not allowed: use fractions of the blocks in [0, 1] "
            "(recomputed whole) or policy names 'none', 'selective', 'full', 'offload', "
            "optionally with a fraction ('selective:0.5'), e.g. checkpointing=(0, 'selective', "
            "0.5, 1)."
        )
    valid = [o for o in options if o is not None]
    return sorted(set(valid), key=lambda o: (POLICIES.index(o[0]), o[1])), []


def _default_options(
    model: torch.nn.Module, device: torch.device
) -> tuple[list[Option], list[str]]:
    try:
        find_blocks(model)
    except ValueError:
        return [("none", 0.0)], []  # no repeated blocks: nothing to checkpoint
    wanted: list[Option] = [("none", 0.0), ("selective", 1.0), ("full", 0.5), ("full", 1.0)]
    wanted += [("offload", 1.0)] if device.type == "cuda" else []
    options: list[Option] = []
    skipped: list[str] = []
    for option in wanted:
        why = _cannot_run(option[0])
        options += [] if why else [option]
        skipped += [f"{option[0]}: {why}"] if why else []
    return options, skipped


def _cannot_run(policy: str) -> str | None:
    """Why ``enable_checkpointing`` refuses ``policy`` on this machine and torch, or ``None``."""
    if policy == "none":
        return None
    probe = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    try:
        enable_checkpointing(probe, policy=policy)
    except ValueError as exc:
        return str(exc)
    return None

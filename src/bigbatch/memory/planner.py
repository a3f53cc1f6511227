"""The planner: measure ways to cut a batch and to checkpoint, choose one that fits, say why.

Note [what the planner measures]
    Each configuration (micro-batch ``m``, checkpointing option: none, ``selective``, a fraction
    of whole-block recompute, ``offload`` on CUDA) runs real optimizer steps of the whole
    effective batch on a deep copy of the model and optimizer. Its peak is ``measure_peak``
    around the copy and two steps (the second with the optimizer's state in memory), so it
    counts what training needs above what was in use before: the parameters, their gradients,
    the optimizer state and the activations of one micro-batch (accumulation keeps only the
    gradients between micro-batches). Within one option the peak grows about linearly with the
    micro-batch, ``peak ≈ a + b·m``: ``a`` is the model, gradients and optimizer state, ``b`` the
    activations per sample. Sizes are measured smallest first; once one does not fit, the larger
    ones of that option are not run, only predicted by the fit. With the default options,
    checkpointing is measured only at the sizes that do not fit without it: it recomputes the
    same micro-batches, so where they fit it can only be slower (and the safety margin already
    keeps the headroom a step needs: Note [ties and headroom]); explicit options are all
    measured. A token budget that cuts the batch into the same micro-batches as a smaller one is
    left out: it would measure the same. With ``micro_batch_tokens`` the
    token budgets of variable-length text are swept the same way after the sizes, per option
    (Note [token windows] in ``bigbatch.core._tokens``): the fit is then per token of the budget,
    and a budget's micro-batch count, rows and padding are read from the cut itself, without a
    model. Then the configurations that fit are timed (Note [timing under load]).

Note [safety margin]
    A peak is one run's reading; training the same step later can take a little more (another
    allocation order, fragmentation, a library's workspace, a CPU reading that moved by a few
    pages). So a configuration fits only when its peak is within the budget less ``margin``
    (10% by default): the choice keeps at least that much headroom.

Note [timing under load]
    Peaks and times are measured in separate passes. On the CPU, honest peaks need glibc to map
    every tensor over 64 KiB on its own (Note [honest CPU peaks]), and a step timed that way
    maps and faults in its activations again each time: measured on the demo's MLP (batch 512,
    1 thread, threshold fixed at 128 KiB), 1.7-2.7x the time of the same step with glibc
    untouched, and not uniformly (micro-batch 512 looked the fastest, at 230 ms, when with glibc
    untouched it is 1.4x slower than micro-batch 128, at 96 ms). So
    peaks are read first, under that threshold, and the steps are timed afterwards under the
    thresholds a training loop's glibc settles at (mmap 32 MiB, trim 64 MiB), which ``plan``
    leaves in place (glibc cannot turn its dynamic adjustment back on). The timing runs in
    ``steps`` rounds on one copy of the model and optimizer: each round visits every fitting
    configuration, in alternating order (forward, then backward), and runs one untimed step
    (the allocator and kernels settle on that size) and one timed step. A load that rises or
    falls while planning so touches all configurations alike; dividing each round's times by
    the round's median cancels a load that slowed a whole round. After two rounds, only the
    configurations within 1.5x of the fastest median are timed again: a tie needs 5%, so the
    others cannot win, and timing them again was most of a plan's time. A configuration's time
    is the median of its relative times (in seconds: times the median round, over those timed
    in every round), its spread their interquartile range; Note [ties and headroom] (in
    ``bigbatch.memory._candidates``) decides. ``progress`` hears of each measurement.
    On the CPU the timing runs on a thread of its own: glibc gives a new thread its own malloc
    arena, so the heap those steps leave behind is not the one later peaks are read from
    (timed on the main thread, a second plan in the same process read micro-batch 16 of the
    planner test's MLP 5 MiB higher than the first: large requests were served from free chunks
    of the timing's heap, and the high-water mark followed them).

Note [honest CPU peaks] (in ``bigbatch.core.peak``)
    On the CPU the planner reads peaks inside ``small_mmap_threshold()``, and first runs one
    untimed micro-batch per checkpointing option so that one-time allocations (thread pools,
    kernel caches, checkpointing's machinery) are not charged to the first configuration.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes.util
import dataclasses
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bigbatch.core._tokens import TokenCut, TrimmedSampleCut
from bigbatch.core._units import parse_bytes
from bigbatch.core.engine import Accumulator
from bigbatch.core.loss import LossFn
from bigbatch.core.oom import MemoryBudgetExceeded, is_out_of_memory, release_memory
from bigbatch.core.peak import measure_peak, resolve_device, small_mmap_threshold
from bigbatch.core.split import Batch, split
from bigbatch.core.split import batch_size as count_samples
from bigbatch.memory import _candidates as rules
from bigbatch.memory._candidates import Candidate, MemoryFit, Option, fit_memory
from bigbatch.memory.checkpointing import disable_checkpointing, enable_checkpointing, find_blocks

OptimizerArg = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None
"""An optimizer over the model's parameters (copied with it), a factory ``f(params)``, or None."""
Progress = Callable[[str, int, int], None]
"""``progress(line, done, total)``: after each measurement, what it found and how far the plan is
(``done`` of at most ``total`` measurements and timed steps)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
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
        return rules.usable(self.memory_budget, self.margin)

    @property
    def headroom_bytes(self) -> int:
        """Budget left above the choice's peak."""
        return self.memory_budget - self.choice.peak_bytes


def _quiet(line: str, done: int, total: int) -> None:
    """The ``Progress`` of a plan nobody watches: it hears nothing."""


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every measurement of one plan shares."""

    model: torch.nn.Module
    optimizer: OptimizerArg
    batch: Batch
    n: int  # samples in ``batch``
    loss_fn: LossFn
    steps: int
    budget: int
    margin: float
    device: torch.device
    cut: TokenCut | None  # with the lengths, when the batch is text (padding, token budgets)
    progress: Progress = _quiet

    def copy(self, option: Option = ("none", 0.0)) -> tuple[torch.nn.Module, Any]:
        """A copy of the model (checkpointed as ``option`` says) and of its optimizer."""
        if isinstance(self.optimizer, torch.optim.Optimizer):  # one memo: it steps the copy
            net, opt = copy.deepcopy((self.model, self.optimizer))
        else:
            net = copy.deepcopy(self.model)
            opt = (self.optimizer or torch.optim.AdamW)(net.parameters())
        checkpoint(disable_checkpointing(net), option)
        return net, opt

    def accumulator(self, net: torch.nn.Module, opt: Any, c: Candidate) -> Accumulator:
        """The ``Accumulator`` that cuts as ``c`` says, by samples or by tokens."""
        t, cut = c.micro_batch_tokens, self.cut
        if t and cut:
            return Accumulator(net, opt, micro_batch_tokens=t, lengths=cut.lengths)
        return Accumulator(net, opt, micro_batch_size=c.micro_batch_size)

    def shape(self, m: int, tokens: bool, option: Option) -> Candidate:
        """Micro-batch ``m`` (a token budget if ``tokens``) under ``option``, not yet measured;
        its padding is of the tokens computed (cut by samples: trimmed as the sample cut trims)."""
        cut, rows, steps, padding = self.cut, m, math.ceil(self.n / m), None
        if cut is not None:  # by samples: trimmed to each micro-batch's longest, if text
            whole, trimmed = cut.units(self.batch), TrimmedSampleCut()(self.batch, m)
            pieces = cut(self.batch, m if tokens else whole)
            computed = sum(p.padded_tokens or 0 for p in (pieces if tokens else trimmed))
            padding = 1 - sum(p.tokens or 0 for p in pieces) / (computed or whole)
            rows, steps = (max(p.samples for p in pieces), len(pieces)) if tokens else (m, steps)
        return Candidate(
            micro_batch_size=rows,
            gradient_accumulation_steps=steps,
            checkpointing=option[1],
            policy=option[0],
            padding=padding,
            micro_batch_tokens=m if tokens else None,
            peak_bytes=rules.usable(self.budget, self.margin) + 1,
        )

    def step(self, acc: Accumulator) -> float:
        """Seconds of one optimizer step of the effective batch."""
        start = time.perf_counter()
        acc.train_step(self.batch, self.loss_fn)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


def _distinct(cut: TokenCut | None, batch: Batch, budgets: list[int]) -> list[int]:
    """``budgets`` less those that cut ``batch`` into the same micro-batches as a smaller one."""
    cuts: dict[tuple, int] = {}
    for b in budgets:  # ascending: each cut keeps its smallest budget (no budgets without a cut)
        pieces = cut(batch, b)  # type: ignore[misc]
        cuts.setdefault(tuple((p.padded_tokens, *p.rows.tolist()) for p in pieces), b)  # type: ignore[union-attr]
    return list(cuts.values())


def checkpoint(model: torch.nn.Module, option: Option) -> None:
    """Checkpoint ``model``'s blocks as ``option`` says (nothing for ``"none"``)."""
    if option[0] != "none":
        enable_checkpointing(model, fraction=option[1], policy=option[0])


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
    steps: int = 5,
    margin: float = 0.1,
    micro_batch_tokens: Sequence[int] | str | None = None,
    lengths: Callable[[Any], Any] | None = None,
    progress: Progress | None = None,
) -> Plan:
    """Find a fast way to cut ``batch_size`` samples into micro-batches that fits in memory.

    Measures peak memory and then time per optimizer step for each micro-batch size and
    checkpointing option (Note [what the planner measures], Note [timing under load]), fits how
    memory grows with the micro-batch, and chooses the fastest configuration whose peak stays
    within ``memory_budget`` less ``margin`` (Note [safety margin]); configurations whose
    spreads overlap and whose times are within 5% tie, and a tie goes to the one with more
    headroom (Note [ties and headroom]). The model and optimizer are deep-copied: yours are not
    changed. On the CPU it leaves glibc's malloc thresholds where training settles them.

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
        steps: timed optimizer steps per fitting configuration, one per round (Note [timing
            under load]); at least 2 give a spread.
        margin: fraction of ``memory_budget`` kept free, in [0, 1).
        micro_batch_tokens: token budgets to compare as well, for a batch of variable-length
            text (Note [token windows] in ``bigbatch.core._tokens``): integers from the longest
            sample's length to the whole window's ``batch_size × longest``, or ``"auto"`` for
            ``m × longest`` at each default ``m``; ``None``: cut by samples only. A budget that
            cuts the batch into the same micro-batches as a smaller one is left out (it would
            measure the same).
        lengths: ``lengths(batch)`` -> each sample's tokens, for a batch that is not a mapping
            with an ``attention_mask``; with it (or with ``micro_batch_tokens``) every
            configuration shows its padding.
        progress: ``progress(line, done, total)`` after each measurement (``Progress``), e.g.
            to draw a progress bar.

    Returns:
        A ``Plan``; ``plan.choice`` is the configuration to use, ``plan.reason`` says why.

    Raises:
        ValueError: bad sizes, token budgets, options, steps or margin, a model without
            trainable parameters, or a batch whose size is not ``batch_size``.
        MemoryBudgetExceeded: no measured configuration fits the budget less the margin.

    Example:
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(2)])
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b), b)
        >>> p = plan(net, torch.randn(8, 8), mse, micro_batch_sizes=[4, 8], steps=1)
        >>> p.choice.micro_batch_size in (4, 8)
        True
    """
    full, n = _full_batch(batch, batch_size)
    sizes = _check_sizes(micro_batch_sizes, n)
    device = _device_of(model)
    options, skipped = _check_options(checkpointing, model, device)
    _check_steps_and_margin(steps, margin)
    budget = parse_bytes(memory_budget) or default_budget(device)
    cut = TokenCut(lengths=lengths) if (micro_batch_tokens, lengths) != (None, None) else None
    budgets = _distinct(cut, full, _check_tokens(micro_batch_tokens, cut, full, n))
    setup = _Setup(
        model, optimizer, full, n, loss_fn, steps, budget, margin, device, cut, progress or _quiet
    )
    candidates, fits = _measure(setup, options, sizes, budgets, checkpointing is None)
    if len(options) > 1 and all(c.policy == "none" for c in candidates):
        skipped.append("checkpointing: every micro-batch fits without it (it only adds time)")
    timed = _on_own_thread if device.type == "cpu" else _time
    return _choose(setup, timed(setup, candidates), tuple(fits), tuple(skipped))


def _measure(
    setup: _Setup,
    options: Sequence[Option],
    sizes: Sequence[int],
    budgets: Sequence[int],
    bound: bool,
) -> tuple[list[Candidate], list[MemoryFit]]:
    """The peaks of ``_measure_peaks`` (``bound``: as it says), read where they are honest
    (Note [honest CPU peaks]); refused when no configuration fits the budget less the margin."""
    cpu = setup.device.type == "cpu"
    with small_mmap_threshold() if cpu else contextlib.nullcontext():
        _warm_up(setup, sizes[0], options)  # Note [honest CPU peaks]
        candidates, fits = _measure_peaks(setup, options, sizes, budgets, bound)
    if not any(c.fits for c in candidates):
        raise MemoryBudgetExceeded(rules.nothing_fits(candidates, setup.budget, setup.margin))
    return candidates, fits


def _choose(setup: _Setup, candidates: list[Candidate], fits: tuple, skipped: tuple) -> Plan:
    choice, runner_up, _ = rules.decide(candidates)
    naive = min(
        filter(rules.ran, candidates),
        key=lambda c: (c.size[0], c.micro_batch_size, -c.checkpointing, c.policy != "full"),
    )
    return Plan(
        choice=choice,
        naive=naive,
        candidates=tuple(candidates),
        fits=fits,
        memory_budget=setup.budget,
        batch_size=setup.n,
        device=str(setup.device),
        reason=rules.explain(candidates, naive, setup.budget, setup.margin),
        margin=setup.margin,
        runner_up=runner_up,
        skipped=skipped,
    )


def _measure_peaks(
    setup: _Setup,
    options: Sequence[Option],
    sizes: Sequence[int],
    budgets: Sequence[int],
    bound: bool = False,
) -> tuple[list[Candidate], list[MemoryFit]]:
    """Every option at every size, then every token budget, smallest first, until one does not
    fit (the larger ones are predicted); then the fits. ``bound``: checkpointing only at the
    sizes that do not fit without it (Note [what the planner measures])."""
    candidates, fits, plain = list[Candidate](), list[MemoryFit](), set[tuple[bool, int]]()
    total = len(options) * (len(sizes) + len(budgets))
    for option, tokens in ((o, t) for o in options for t in (False, True)):
        wanted = [m for m in (budgets if tokens else sizes) if (tokens, m) not in plain]
        larger = [setup.shape(m, tokens, option) for m in wanted]
        if not larger:
            continue
        measured: list[Candidate] = []
        while larger and (not measured or measured[-1].fits):
            done = len(candidates) + len(measured)  # said before each: one may take minutes
            setup.progress(f"measuring the peak of {larger[0].describe()}...", done, total)
            measured.append(c := _peak(setup, larger.pop(0)))
            what = "out of memory" if c.out_of_memory else rules.format_bytes(c.peak_bytes)
            setup.progress(
                f"peak of {c.describe()}: {what}", len(candidates) + len(measured), total
            )
        plain |= {c.size for c in measured if c.fits and bound and option[0] == "none"}
        fit = fit_memory([c for c in measured if not c.out_of_memory])
        fits += [fit] if fit else []
        candidates += measured + (rules.predicted(larger, fit, measured[-1]) if larger else [])
    return rules.with_savings(candidates), fits


def _peak(setup: _Setup, out: Candidate) -> Candidate:
    """Peak memory of a copy, its optimizer and two steps (Note [what the planner measures])."""
    usable = rules.usable(setup.budget, setup.margin)
    try:
        with measure_peak(setup.device) as peak:
            acc = setup.accumulator(*setup.copy((out.policy, out.checkpointing)), out)
            for _ in range(2):  # the second with the optimizer's state in memory
                setup.step(acc)
            del acc
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        del exc  # it holds the failed step's frames
        release_memory(setup.device)
        return dataclasses.replace(out, out_of_memory=True)
    return dataclasses.replace(out, peak_bytes=peak.peak_bytes, fits=peak.peak_bytes <= usable)


def _on_own_thread(setup: _Setup, candidates: list[Candidate]) -> list[Candidate]:
    """``_time`` on a thread of its own, under training's malloc thresholds (Note [timing under
    load]). A Ctrl-C stops the timing after the step in flight, which ends before ``plan`` raises
    (leaving the pool joins the thread): torch must not be running on another thread when the
    interpreter exits (it aborts the process)."""
    settle_malloc()
    stop = threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="bigbatch-plan-timing") as pool:
        try:
            return pool.submit(_time, setup, candidates, stop).result()
        finally:
            stop.set()


def _time(
    setup: _Setup, candidates: list[Candidate], stop: threading.Event | None = None
) -> list[Candidate]:
    """The fitting configurations timed in alternating rounds (Note [timing under load]), until
    ``stop`` is set."""
    fitting = [c for c in candidates if c.fits]
    net, opt = setup.copy()
    seconds: list[list[float]] = [[] for _ in fitting]
    visits = list(enumerate(fitting))
    for r in range(setup.steps):
        if r == 2:  # Note [timing under load]: later rounds time only those that can still win
            best = min(statistics.median(t) for t in seconds)
            visits = [(i, c) for i, c in visits if statistics.median(seconds[i]) <= 1.5 * best]
        for i, c in visits if r % 2 == 0 else visits[::-1]:
            if stop is not None and stop.is_set():
                return candidates
            checkpoint(disable_checkpointing(net), (c.policy, c.checkpointing))
            acc = setup.accumulator(net, opt, c)
            setup.step(acc)  # untimed: the allocator and kernels settle on this size
            seconds[i].append(setup.step(acc))
            line = f"timing round {r + 1}/{setup.steps}: {c.describe()}: {seconds[i][-1]:.2f} s"
            setup.progress(line, sum(map(len, seconds)), setup.steps * len(visits))
    done = iter(rules.timed(fitting, seconds, setup.n))
    return [next(done) if c.fits else c for c in candidates]


def settle_malloc() -> None:
    """glibc's mmap and trim thresholds as its dynamic adjustment settles them in a training loop
    (32 and 64 MiB; Note [timing under load]); a no-op where the C library is not glibc."""
    with contextlib.suppress(OSError, AttributeError, TypeError):  # not glibc
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 * 2**20)  # M_TRIM_THRESHOLD


def default_budget(device: torch.device) -> int:
    """The CUDA device's total memory, or the CPU system's available memory (``MemAvailable``)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError('no MemAvailable in /proc/meminfo: pass memory_budget, e.g. "6GiB".')


def _warm_up(setup: _Setup, micro_batch_size: int, options: Sequence[Option]) -> None:
    """One untimed micro-batch per option, so that what runs once per process (thread pools,
    kernel caches, checkpointing's machinery) is not charged to the first configuration."""
    net, opt = setup.copy()
    first = split(setup.batch, micro_batch_size)[0]
    for option in options:
        checkpoint(disable_checkpointing(net), option)
        Accumulator(net, opt, micro_batch_size=micro_batch_size).train_step(first, setup.loss_fn)


# ---------------------------------------------------------------------------- arguments
def _full_batch(batch: Batch | Callable[[int], Batch], batch_size: int | None) -> tuple[Batch, int]:
    if callable(batch) and batch_size is None:
        raise ValueError("batch is a function: pass batch_size, e.g. plan(..., batch_size=64).")
    full = batch(batch_size) if callable(batch) and batch_size is not None else batch
    n = count_samples(full)
    if batch_size is not None and batch_size != n:
        got = f"batch_fn({batch_size}) returned" if callable(batch) else "the batch has"
        fewer = " (do the data hold fewer samples than the batch?)" if n < batch_size else ""
        raise ValueError(
            f"batch_size={batch_size} but {got} {n} samples{fewer}: pass batch_size "
            "samples (one effective batch), or batch_fn(n) giving n."
        )
    return full, n


def _device_of(model: torch.nn.Module) -> torch.device:
    if (trained := next((p for p in model.parameters() if p.requires_grad), None)) is None:
        raise ValueError(
            f"plan needs a model with trainable parameters, and {type(model).__name__} has none: "
            "pass the module holding the weights you train (else any micro-batch fits)."
        )
    return resolve_device(trained.device)


def _ints(name: str, values: Any, low: int, high: int, allowed: str) -> list[int]:
    """``values`` sorted, each once; one error naming ``name`` unless integers in [low, high]."""
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high  # noqa: E731
    if isinstance(values, str) or not values or not all(map(ok, values)):
        shown = values if isinstance(values, str) else list(values)
        raise ValueError(f"{name}={shown!r} is not allowed: use {allowed}.")
    return sorted(set(values))


def _check_sizes(sizes: Sequence[int] | None, n: int) -> list[int]:
    if sizes is None:
        return [2**i for i in range(n.bit_length()) if n / 32 <= 2**i < n] + [n]
    allowed = f"integers from 1 to the batch size {n}, e.g. micro_batch_sizes=[1, 2, 4]"
    return _ints("micro_batch_sizes", sizes, 1, n, allowed)


def _check_tokens(spec: Any, cut: TokenCut | None, batch: Batch, n: int) -> list[int]:
    """The token budgets to measure: ``m × longest`` at each default ``m`` for ``"auto"``."""
    if spec is None or cut is None:
        return []
    longest, whole = cut.floor(batch), cut.units(batch)
    if spec == "auto":
        return sorted({m * longest for m in _check_sizes(None, n)})
    allowed = (
        f"'auto' or integers from the longest sample's {longest} tokens to the whole "
        f"batch's {whole}, e.g. micro_batch_tokens=[{longest}, {whole}]"
    )
    return _ints("micro_batch_tokens", spec, longest, whole, allowed)


def _check_steps_and_margin(steps: int, margin: float) -> None:
    if isinstance(steps, bool) or not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps={steps!r} is not allowed: use a positive integer, e.g. steps=5.")
    if isinstance(margin, bool) or not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ValueError(
            f"margin={margin!r} is not allowed: use the fraction of the budget to "
            "keep free, in [0, 1), e.g. margin=0.1 (10%)."
        )


def _check_options(
    spec: Sequence[float | str] | None, model: torch.nn.Module, device: torch.device
) -> tuple[list[Option], list[str]]:
    """The checkpointing options to measure, and the default policies left out (with why). By
    default none, selective, half and all the blocks (and offload on CUDA), less what this
    machine and torch refuse (``enable_checkpointing`` says why); only none without repeated
    blocks."""
    if spec is not None:
        parsed = [rules.parse_option(o) for o in ([] if isinstance(spec, str) else spec)]
        if not parsed or None in parsed:
            raise ValueError(
                f"checkpointing={spec if isinstance(spec, str) else list(spec)!r} is "
                "not allowed: use fractions of the blocks in [0, 1] (recomputed "
                "whole) or policy names 'none', 'selective', 'full', 'offload', "
                "optionally with a fraction ('selective:0.5'), e.g. "
                "checkpointing=(0, 'selective', 0.5, 1)."
            )
        order = lambda o: (rules.POLICIES.index(o[0]), o[1])  # noqa: E731
        return sorted(set(filter(None, parsed)), key=order), []
    try:
        find_blocks(model)
    except ValueError:
        return [("none", 0.0)], []
    options, skipped = [], []
    wanted = [("none", 0.0), ("selective", 1.0), ("full", 0.5), ("full", 1.0), ("offload", 1.0)]
    for option in wanted[: 4 + (device.type == "cuda")]:
        try:
            checkpoint(torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)), option)
            options.append(option)
        except ValueError as exc:
            skipped.append(f"{option[0]}: {exc}")
    return options, skipped

"""The accumulation engine: exactly one optimizer step per logical batch, however it is cut.

``Accumulator.train_step(batch, loss_fn)`` cuts the batch into micro-batches, back-propagates
each micro-batch's loss *sum*, and steps once; ``micro_batch`` / ``backward`` / ``step`` are the
same parts for users who keep their own loop. See Note [window normalisation] in
``bigbatch.core.loss``, Note [global normalisation] in ``bigbatch.core._sync``, Note [fp16 and accumulation]
in ``bigbatch.core._precision``, Note [auto micro-batch] in ``bigbatch.core._auto`` and Note [window
buffers] in ``bigbatch.core._window``.

Note [backward scale]
    Every micro-batch of a window back-propagates ``loss_sum * s`` with ONE constant ``s`` per
    window, the same on every rank, and ``step`` divides the gradients by ``s * Σ count`` (times
    the number of ranks, whose average DDP / FSDP take). The step is exact whatever ``s`` is; ``s``
    only sets the magnitude of what flows through the backward, which matters in fp16: the
    loss scaler skips a step whose gradients overflow. The best ``s`` is ``1 / C``, C the window's
    total count over all ranks: then every backward runs at the scale of the full batch's mean,
    exactly what a plain fp16 full-batch loop back-propagates. So:

    * ``train_step(..., count_fn=f)``: C = Σ f(micro-batch), counted before the window runs (on
      several ranks in fp16 summed by one small all-reduce, moved before the window): ``s = 1 / C``.
      Give it for token losses in fp16, e.g.
      ``count_fn=lambda mb: (mb["labels"][:, 1:] != -100).sum()``.
    * ``train_step`` without ``count_fn``: ``s = 1 / N``, N the window's samples over all ranks,
      known before the window: exactly ``1 / C`` for a per-sample loss (a mean, or a pair counting
      samples). For a token loss on one process ``s`` is refined at the first micro-batch to
      ``1 / (N · c_1 / n_1)`` (its tokens per sample); on several ranks it stays ``1 / N``, so
      each backward carries sums per sample, tokens-per-sample times a mean.
    * On several ranks in fp32 and bf16 (whose range is float32's) ``s = 1``: no collective is
      spent on a scale that cannot overflow (it matters on slow links).
    * The low-level path (``backward`` / ``step``, no look-ahead): ``s = 1 / c_1`` (the first
      micro-batch's count) on one process, ``1`` (raw sums) on several ranks, where no first
      count is known to all. In fp16 on several ranks prefer ``train_step`` with ``count_fn``.

Note [window checks]
    Bad values that can only be seen on the device (a count tensor that is negative or not
    finite, a loss or gradient that is NaN or infinite) are checked at ``step``, from the totals
    it reads anyway (one host sync per step), before ``optimizer.step()``: a window that fails a
    check is discarded and nothing else changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.core._batchnorm import warn_batch_coupled, window
from bigbatch.core._precision import make_precision
from bigbatch.core._sizing import WindowMeter, gradient_bytes, make_sizing
from bigbatch.core._stepping import (
    NONFINITE_FIX,
    NonFiniteError,
    add_grads_,
    check_max_grad_norm,
    check_nonfinite,
    check_optimizer,
    check_scheduler,
    check_window_totals,
    clip_or_norm_,
    pair_grads,
    scale_grads_,
    step_scheduler,
)
from bigbatch.core._sync import make_sync
from bigbatch.core._units import parse_bytes
from bigbatch.core._window import Backup, MutableBuffers, Window, first_scale, planned_scale
from bigbatch.core.loss import LossFn, WindowLoss, as_sum_and_count, check_count, check_scalar_loss
from bigbatch.core.oom import MemoryBudgetExceeded, is_out_of_memory, release_memory
from bigbatch.core.split import Batch, batch_size, micro_batch_sizes, split

CountFn = Callable[[Any], "torch.Tensor | int | float"]
"""``count_fn(micro_batch)``: how many items the loss of that micro-batch will count."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    Attributes:
        loss: the window's true mean loss, ``Σ loss_sum / Σ count`` (over all ranks).
        count: the window's total count (samples, or tokens for a token loss), over all ranks.
        micro_batches: micro-batches accumulated on this rank.
        micro_batch_size: samples per micro-batch (the last may be smaller); ``None`` when the
            caller cut the batch itself (``backward`` / ``step``).
        grad_norm: total 2-norm of the normalised gradient, before clipping.
        skipped: ``True`` when the optimizer did not step: fp16 found inf/NaN gradients, or
            ``nonfinite="skip"`` met a non-finite loss or gradient. The scheduler did not step.
        oom_retries: windows redone at a smaller micro-batch after running out of memory.
        samples: samples in the window on this rank (``None`` for ``backward`` / ``step``).
        nonfinite: the loss or the gradient norm was NaN or infinite.
        peak_bytes: memory the successful attempt of the window added at its peak (measured
            with ``micro_batch_size="auto"`` or a ``memory_budget``; else ``None``).
    """

    loss: float
    count: float
    micro_batches: int
    micro_batch_size: int | None
    grad_norm: float
    skipped: bool = False
    oom_retries: int = 0
    samples: int | None = None
    nonfinite: bool = False
    peak_bytes: int | None = None


class Accumulator:
    """Accumulate micro-batch gradients and take one exact optimizer step per logical batch.

    The step's gradient is ``∇(Σ loss_sum) / Σ count`` over every micro-batch of the window,
    the gradient of the true mean over the whole batch. Clipping, the optimizer step, the
    scheduler step and ``zero_grad(set_to_none=True)`` happen once per window.

    Args:
        model: the module to train (plain, ``DistributedDataParallel`` or FSDP).
        optimizer: a ``torch.optim.Optimizer`` holding every trainable parameter of the model.
        micro_batch_size: samples per micro-batch, or ``"auto"`` for the largest that fits;
            an out-of-memory error then shrinks it and redoes the window.
        scheduler: an LR scheduler of ``optimizer``, stepped once per optimizer step (not per
            micro-batch); ``ReduceLROnPlateau`` is stepped with the window's mean loss.
        max_grad_norm: clip the normalised gradient to this 2-norm; ``None`` to not clip.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + grad scaler).
        memory_budget: cap on the memory a step may use above what was in use before it
            (``"6GiB"``, bytes): a window that goes over is redone smaller in auto mode.
        nonfinite: a window whose loss or gradient norm is NaN / infinite: ``"raise"``
            ``NonFiniteError`` before the optimizer steps (default), ``"skip"`` it, or ``"apply"``
            it anyway. In fp16 every non-finite window is the loss scaler's to skip (and lower
            its scale), as in a plain fp16 loop: ``StepResult.skipped`` and ``.nonfinite``.

    Raises:
        TypeError, ValueError: a bad argument, named with what is allowed.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(3, 1)
        >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4)
        >>> x, y = torch.randn(10, 3), torch.randn(10, 1)
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> acc.train_step((x, y), mse).micro_batches  # 10 samples at 4: 4 + 4 + 2
        3
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batch_size: int | str = 32,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        precision: str = "fp32",
        memory_budget: int | str | None = None,
        *,
        nonfinite: str = "raise",
    ) -> None:
        self._sizing = make_sizing(micro_batch_size)
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        self.nonfinite = check_nonfinite(nonfinite)
        check_optimizer(model, optimizer)
        self.model, self.optimizer = model, optimizer
        self.scheduler = check_scheduler(scheduler, optimizer)
        self.micro_batch_size = micro_batch_size
        self.device = _device_of(model)
        self._precision = make_precision(precision, self.device)
        self._meter = WindowMeter(
            self.device, parse_bytes(memory_budget), self._sizing.retries, gradient_bytes(optimizer)
        )
        self._sync = make_sync(model, auto=self._sizing.retries)
        self._buffers = MutableBuffers(model)
        self._window = Window()
        self._in_micro_batch = False
        self._warned = False  # about batch-coupled layers, once (bigbatch.core._batchnorm)

    @property
    def precision(self) -> str:
        """``"fp32"``, ``"bf16"`` or ``"fp16"``."""
        return self._precision.name

    @property
    def current_micro_batch_size(self) -> int | None:
        """The micro-batch the next full window is cut at (``None``: auto before its first window)."""
        return self._sizing.adopted

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What the engine owns and a restart needs: the micro-batch sizing and the loss scaler.

        The model, optimizer and scheduler have their own ``state_dict``.

        Raises:
            RuntimeError: called in the middle of a window (micro-batches await a ``step``).
        """
        if self._window.micro_batches:
            raise RuntimeError(
                f"state_dict() called in the middle of a window ({self._window.micro_batches} "
                "micro-batch(es) await a step()): save between optimizer steps."
            )
        return {"sizing": self._sizing.state_dict(), "scaler": self._precision.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (same micro-batch policy and precision).

        Raises:
            ValueError: the state was saved with another micro-batch policy or precision.
        """
        self._sizing.load_state_dict(dict(state["sizing"]))
        self._precision.load_state_dict(state["scaler"])

    # ------------------------------------------------------------------ the high-level path
    def train_step(
        self, batch: Batch, loss_fn: LossFn, *, count_fn: CountFn | None = None
    ) -> StepResult:
        """Cut ``batch`` into micro-batches, accumulate them and take one optimizer step.

        Args:
            batch: a tensor or nested tuple / list / dict of tensors sharing the first dimension
                (per-sample lists of non-tensors are cut with the rows, see ``bigbatch.core.split``).
            loss_fn: ``loss_fn(model, micro_batch)`` returning a scalar mean or ``(loss_sum, count)``.
            count_fn: optional ``count_fn(micro_batch)``, the count the loss will return for it
                (e.g. its non-padding tokens); lets fp16 back-propagate at the full batch's
                scale (Note [backward scale]). The step itself is exact without it.

        Returns:
            The ``StepResult`` of the step.

        Raises:
            ValueError, TypeError: bad batch or loss; NonFiniteError (``nonfinite="raise"``).
                Nothing is changed: the parameters, the optimizer state, the gradients and the
                model's buffers are as they were.
            RuntimeError: ``backward`` was called without a ``step`` before this call.
            torch.OutOfMemoryError, MemoryBudgetExceeded (or the CPU allocator's RuntimeError):
                with a fixed ``micro_batch_size``; nothing is changed. An out-of-memory error in
                the optimizer step itself is never retried (its memory does not depend on the
                micro-batch).
            MemoryError: ``micro_batch_size="auto"`` and not even one sample fits.
        """
        n = batch_size(batch)
        self._check_empty_window()
        backup, retries = Backup(self._buffers, self.device), 0
        while True:
            size = self._sizing.size_for(n)
            failure = self._attempt(batch, size, loss_fn, count_fn, backup)
            failed, measured = self._sync.agree_on_oom(*failure)  # Note [auto micro-batch ...]
            if failed is None:
                break
            # Retry outside the except block: the live exception would keep its tensors alive.
            self._discard_window(backup)
            release_memory(self.device)
            self._sizing.after_oom(failed, measured)
            retries += 1
        peak = self._meter.peak_bytes()
        result = self._step(backup)
        self._sizing.after_success(size)
        self._buffers.learn(backup)
        return dataclasses.replace(
            result, micro_batch_size=size, oom_retries=retries, samples=n, peak_bytes=peak
        )

    def _attempt(
        self, batch: Batch, size: int, loss_fn: LossFn, count_fn: CountFn | None, backup: Backup
    ) -> tuple[int | None, bool]:
        """Accumulate the window at ``size``. Returns ``(size, measured)`` if it ran out of memory
        in auto mode (``measured``: over the budget, not an allocator failure), else ``(None, _)``."""
        try:
            self._accumulate_window(batch, size, loss_fn, count_fn)
        except BaseException as exc:
            self._discard_window(backup)
            if not (self._sizing.retries and is_out_of_memory(exc)):
                raise
            traceback.clear_frames(exc.__traceback__)  # unpin the failed window's tensors
            return size, isinstance(exc, MemoryBudgetExceeded)
        return None, False

    def _accumulate_window(
        self, batch: Batch, size: int, loss_fn: LossFn, count_fn: CountFn | None
    ) -> None:
        pieces = split(batch, size)
        sizes = micro_batch_sizes(batch_size(batch), size)  # those of `pieces`, without a re-walk
        if not self._warned and len(pieces) > 1:  # one micro-batch is the full batch: exact
            warn_batch_coupled(self.model)
            self._warned = True
        self._meter.start()
        self._window.scale = self._plan_scale(pieces, sizes, count_fn)
        last_syncs = not self._sync.defers_sync  # Note [auto micro-batch across ranks]
        with window(self.model, sum(sizes)):
            if isinstance(loss_fn, WindowLoss):  # e.g. cached_loss: sees the window first
                with self._sync.micro_batch(False), self._precision.autocast():  # no backward
                    loss_fn = loss_fn.prepare(self.model, batch, pieces)
            for i, piece in enumerate(pieces):
                with self.micro_batch(last=last_syncs and i == len(pieces) - 1):
                    self.backward(*as_sum_and_count(loss_fn(self.model, piece), sizes[i]))
                self._meter.check(size)
        self._window.deferred = self._window.deferred or self._sync.defers_sync

    def _plan_scale(
        self, pieces: Sequence[Batch], sizes: Sequence[int], count_fn: CountFn | None
    ) -> torch.Tensor | float | None:
        """The window's backward scale, from what is known before it runs (Note [backward scale])."""
        counts = None if count_fn is None else [count_fn(p) for p in pieces]
        if self._sync.world_size > 1 and self._precision.scaler is None:
            return 1.0  # fp32 / bf16 do not overflow: no collective for it (slow links)
        self._window.samples_hint = (sum(sizes), sizes[0])
        return planned_scale(counts, sum(sizes), self._sync, self.device)

    # ------------------------------------------------------------------ the low-level path
    @contextlib.contextmanager
    def micro_batch(self, last: bool = True) -> Iterator[None]:
        """Context for one micro-batch's forward (and usually its ``backward``) in your own loop.

        It runs the forward in the chosen precision and, for DDP / FSDP, skips the gradient
        all-reduce unless ``last`` is ``True`` (the window's last micro-batch). The backward may
        also come after several forwards, outside the context (Note [several forwards]).

        Example:
            >>> for i, mb in enumerate(micro_batches):  # doctest: +SKIP
            ...     with acc.micro_batch(last=i == len(micro_batches) - 1):
            ...         acc.backward(*my_loss(model, mb))
            >>> acc.step()  # doctest: +SKIP
        """
        w, backwards_before = self._window, self._window.micro_batches
        self._in_micro_batch = True
        try:
            with self._sync.micro_batch(last and not w.deferred), self._precision.autocast():
                yield
        finally:
            self._in_micro_batch = False
        if w is self._window and w.micro_batches == backwards_before:  # its backward comes later
            w.pending_forwards += 1
            w.deferred = w.deferred or (not last and self._sync.can_defer)

    def backward(self, loss_sum: torch.Tensor, count: torch.Tensor | int | float) -> None:
        """Back-propagate one micro-batch's ``loss_sum``, the sum of ``count`` per-item losses.

        For a mean over ``n`` samples call ``backward(loss * n, n)``. The division by the
        window's total count happens once, in ``step``.

        Raises:
            ValueError: ``loss_sum`` is not a scalar, or ``count`` is negative or not finite.
            TypeError: ``count`` is not a number.
            RuntimeError: precision is bf16 / fp16 and the forward ran outside ``micro_batch()``.
        """
        check_scalar_loss(loss_sum, "loss_sum")
        count = check_count(count, "count")
        w = self._window
        if not self._in_micro_batch and w.pending_forwards:
            w.pending_forwards -= (
                1  # the backward of a forward run earlier (Note [several forwards])
            )
        elif not self._in_micro_batch and self._precision.autocast_dtype is not None:
            raise RuntimeError(
                f"precision={self.precision!r} needs the forward under autocast: run it inside "
                "`with acc.micro_batch(last=...):` (and backward() there or after it)."
            )
        if w.scale is None:
            w.scale = self._first_scale(count)
        self._precision.backward(loss_sum * w.scale)
        w.add(loss_sum, count)

    def accumulate_grads(
        self,
        grads: Mapping[torch.Tensor, torch.Tensor] | Sequence[torch.Tensor | None],
        count: torch.Tensor | int | float,
        loss_sum: torch.Tensor | float = 0.0,
    ) -> None:
        """Add gradients computed elsewhere to the window, as if a micro-batch had produced them.

        Args:
            grads: gradients of a loss SUM over ``count`` items: ``{parameter: gradient}``, or a
                list in the order of the optimizer's parameters (``None`` for none).
            count: the items that sum covers (samples, tokens).
            loss_sum: the sum's value, for the reported loss.

        Raises:
            ValueError: a gradient whose shape is not its parameter's; FSDP (sharded gradients).
        """
        if self._sync.world_size > 1 and not self._sync.can_defer:
            raise ValueError(
                "accumulate_grads() cannot add gradients to an FSDP model (they are sharded): "
                "express them as a loss and call backward() instead."
            )
        pairs = pair_grads(self.optimizer, grads)  # checked before anything changes
        count = check_count(count, "count")
        w = self._window
        if w.scale is None:
            w.scale = self._first_scale(count)
        add_grads_(pairs, w.scale)
        w.deferred = w.deferred or self._sync.can_defer  # DDP saw no backward: sync at step
        w.add(torch.as_tensor(loss_sum, dtype=torch.float64, device=self.device), count)

    def step(self) -> StepResult:
        """Normalise the window's gradients, clip, step the optimizer and scheduler, zero grads.

        Raises:
            RuntimeError: nothing was accumulated since the last step.
            ValueError: the window's total count is 0, or a count was negative / not finite.
            NonFiniteError: the loss or gradient is NaN / infinite and ``nonfinite="raise"``.
            In each case the window is discarded and nothing else changed.
        """
        return self._step(None)

    def _step(self, backup: Backup | None) -> StepResult:
        w = self._window
        if w.micro_batches == 0:
            raise RuntimeError(
                "step() called with nothing accumulated: call backward(loss_sum, count) for at "
                "least one micro-batch first (or use train_step(batch, loss_fn))."
            )
        try:
            return self._apply(w)
        except BaseException:
            self._discard_window(backup)
            raise

    def _apply(self, w: Window) -> StepResult:
        loss_total, count_total, bad = self._window_totals(w)  # the one host sync per step
        check_window_totals(count_total, bad)
        loss = loss_total / count_total
        finite_loss = math.isfinite(loss)
        fp16 = self._precision.scaler is not None  # non-finite windows are the scaler's to skip
        if not finite_loss and self.nonfinite == "raise" and not fp16:
            raise NonFiniteError(
                f"the window's loss is {loss} (count {count_total:g}); " + NONFINITE_FIX
            )
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if w.deferred:
            self._sync.reduce_grads(params)  # Note [several forwards]
        self._precision.unscale_(self.optimizer)
        with_grad = [p for p in params if p.grad is not None]
        scale = w.scale if w.scale is not None else 1.0  # set by the window's first backward
        scale_grads_(with_grad, self._sync.world_size / (count_total * scale))
        grad_norm = float(clip_or_norm_(with_grad, self.max_grad_norm))
        nonfinite = not (finite_loss and math.isfinite(grad_norm))
        skipped = self._decide(nonfinite, grad_norm, count_total)
        if skipped:
            self._precision.discard()
        else:
            skipped = self._precision.step(self.optimizer)
        if not skipped:
            step_scheduler(self.scheduler, loss)
        self.optimizer.zero_grad(set_to_none=True)
        self._window = Window()
        return StepResult(
            loss, count_total, w.micro_batches, None, grad_norm, skipped, nonfinite=nonfinite
        )

    def _decide(self, nonfinite: bool, grad_norm: float, count: float) -> bool:
        """Whether a non-finite window is skipped (fp16 leaves gradients to its loss scaler)."""
        if not nonfinite or self.nonfinite == "apply" or self._precision.scaler is not None:
            return False  # fp16: the scaler skips it and lowers the scale, as a full batch would
        if self.nonfinite == "raise":
            raise NonFiniteError(
                f"the window's gradient norm is {grad_norm} (count {count:g}); " + NONFINITE_FIX
            )
        return True

    def _window_totals(self, w: Window) -> tuple[float, float, float]:
        local = [w.loss_sum, w.count, w.bad_counts]
        totals = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(()) for v in local]
        )
        totals = self._sync.all_reduce_sum(totals)
        loss_total, count_total, bad = totals.tolist()
        return loss_total, count_total, bad

    # ------------------------------------------------------------------ helpers
    def _first_scale(self, count: torch.Tensor | float) -> torch.Tensor | float:
        """``s`` when nothing was known before the window (Note [backward scale])."""
        return first_scale(count, self._window.samples_hint, self._sync.world_size)

    def _discard_window(self, backup: Backup | None = None) -> None:
        """Drop the window's partial gradients (a failed micro-batch may have left some in .grad)
        and, when the window ran under ``train_step``, put the RNG and the buffers back."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self._precision.discard()
        self._window = Window()
        if backup is not None:
            backup.restore()

    def _check_empty_window(self) -> None:
        if self._window.micro_batches:
            raise RuntimeError(
                f"train_step() called while {self._window.micro_batches} micro-batch(es) from "
                "backward() await a step(): call acc.step() first, or use only one of the two paths."
            )
        if any(p.grad is not None for p in self.model.parameters()):
            raise RuntimeError(
                "train_step() found gradients already in the parameters' .grad; they would be "
                "mixed into this step. Call optimizer.zero_grad(set_to_none=True) before it."
            )


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

"""The accumulation engine: exactly one optimizer step per logical batch, however it is cut.

``Accumulator.train_step(batch, loss_fn)`` cuts the batch into micro-batches, back-propagates
each micro-batch's loss *sum*, and steps once; ``backward`` / ``step`` are the same two halves
for users who keep their own loop. See Note [window normalisation] in ``bigbatch.loss``,
Note [global normalisation] in ``bigbatch.sync``, Note [fp16 and accumulation] in
``bigbatch.precision`` and Note [auto micro-batch] in ``bigbatch.memory.auto``.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.batchnorm import warn_batch_coupled, window
from bigbatch.loss import LossFn, WindowLoss, as_sum_and_count, check_count, check_scalar_loss
from bigbatch.memory import auto
from bigbatch.memory.oom import MemoryBudgetExceeded, is_out_of_memory, release_memory
from bigbatch.memory.peak import PeakProbe
from bigbatch.precision import make_precision
from bigbatch.split import Batch, batch_size, check_micro_batch_size, micro_batch_sizes, split
from bigbatch.sync import make_sync


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
        skipped: ``True`` when fp16 found inf/NaN gradients and skipped the step (and the scheduler).
        oom_retries: windows redone at a smaller micro-batch after running out of memory.
        samples: samples in the window on this rank (``None`` for ``backward`` / ``step``).
    """

    loss: float
    count: float
    micro_batches: int
    micro_batch_size: int | None
    grad_norm: float
    skipped: bool = False
    oom_retries: int = 0
    samples: int | None = None


@dataclass
class _Window:
    """The running state of the window being accumulated (kept on the device: no host syncs)."""

    micro_batches: int = 0
    loss_sum: torch.Tensor | float = 0.0
    count: torch.Tensor | float = 0.0
    backward_scale: torch.Tensor | float = 1.0  # see Note [backward scale] in bigbatch.sync


class Accumulator:
    """Accumulate micro-batch gradients and take one exact optimizer step per logical batch.

    The step's gradient is ``∇(Σ loss_sum) / Σ count`` over every micro-batch of the window,
    the gradient of the true mean over the whole batch. Clipping, the optimizer step, the
    scheduler step and ``zero_grad(set_to_none=True)`` happen once per window.

    Args:
        model: the module to train (plain, ``DistributedDataParallel`` or FSDP).
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        micro_batch_size: samples per micro-batch, or ``"auto"`` for the largest that fits;
            an out-of-memory error then shrinks it and redoes the window.
        scheduler: an LR scheduler stepped once per optimizer step (not per micro-batch).
        max_grad_norm: clip the normalised gradient to this 2-norm; ``None`` to not clip.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + grad scaler).
        memory_budget: cap on the memory a step may use above what was in use before it
            (``"6GiB"``, bytes): a window that goes over is redone smaller in auto mode.

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
    ) -> None:
        if micro_batch_size == "auto":
            self.auto_state: auto.AutoState | None = auto.AutoState()
        else:
            check_micro_batch_size(micro_batch_size)
            self.auto_state = None
        if max_grad_norm is not None and not (max_grad_norm > 0):
            raise ValueError(
                f"max_grad_norm={max_grad_norm!r} is not allowed: use a positive number or None."
            )
        self.model = model
        self.optimizer = optimizer
        self.micro_batch_size = micro_batch_size
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.device = _device_of(model)
        self.precision = make_precision(precision, self.device)
        self.memory_budget = auto.parse_bytes(memory_budget)
        self.sync = make_sync(model, auto=self.auto_state is not None)
        self._window = _Window()
        self._in_micro_batch = False
        self._layers_checked = False  # warn once about batch-coupled layers (bigbatch.batchnorm)

    # ------------------------------------------------------------------ the high-level path
    def train_step(self, batch: Batch, loss_fn: LossFn) -> StepResult:
        """Cut ``batch`` into micro-batches, accumulate them and take one optimizer step.

        Args:
            batch: a tensor or nested tuple / list / dict of tensors sharing the first dimension.
            loss_fn: ``loss_fn(model, micro_batch)`` returning a scalar mean or ``(loss_sum, count)``.

        Returns:
            The ``StepResult`` of the step.

        Raises:
            ValueError, TypeError: bad batch or loss (nothing is changed: the parameters, the
                optimizer state and the gradients are as they were).
            RuntimeError: ``backward`` was called without a ``step`` before this call.
            torch.OutOfMemoryError, MemoryBudgetExceeded (or the CPU allocator's RuntimeError):
                with a fixed ``micro_batch_size``; the window is discarded and the parameters,
                the optimizer state and the gradients are as they were. An out-of-memory error in
                the optimizer step itself is never retried (its memory does not depend on the
                micro-batch).
            MemoryError: ``micro_batch_size="auto"`` and not even one sample fits.
        """
        n = batch_size(batch)
        self._check_empty_window()
        rng = _rng_state(self.device) if self.auto_state is not None else None
        retries = 0
        while True:
            size, failed = self._size_for(n), None
            try:
                self._accumulate_window(batch, size, loss_fn)
            except BaseException as exc:
                self._discard_window()
                if self.auto_state is None or not is_out_of_memory(exc):
                    raise
                traceback.clear_frames(exc.__traceback__)  # unpin the failed window's tensors
                failed = size
            failed = self.sync.end_window(failed)  # Note [auto micro-batch across ranks]
            if failed is None:
                break
            # Retry outside the except block: the live exception would keep its tensors alive.
            self._discard_window()
            release_memory(self.device)
            self.auto_state = auto.after_oom(self.auto_state, failed)  # type: ignore[arg-type]
            _set_rng_state(rng, self.device)
            retries += 1
        try:
            result = self.step()
        except BaseException:
            # Not retried: the optimizer's memory does not shrink with the micro-batch.
            self._discard_window()
            raise
        if self.auto_state is not None:
            self.auto_state = auto.after_success(self.auto_state, size, n)
        extra = {"micro_batch_size": size, "oom_retries": retries, "samples": n}
        return StepResult(**{**result.__dict__, **extra})

    def _size_for(self, n: int) -> int:
        if self.auto_state is not None:
            return auto.size_for(self.auto_state, n)
        return min(int(self.micro_batch_size), n)

    def _accumulate_window(self, batch: Batch, size: int, loss_fn: LossFn) -> None:
        pieces = split(batch, size)
        probe = PeakProbe(self.device) if self.memory_budget is not None else None
        record = probe.reset() if probe else None
        if not self._layers_checked and len(pieces) > 1:  # one micro-batch is the full batch: exact
            warn_batch_coupled(self.model)
            self._layers_checked = True
        sizes = micro_batch_sizes(batch_size(batch), size)  # those of `pieces`, without a re-walk
        with window(self.model, sum(sizes)):
            if isinstance(loss_fn, WindowLoss):  # e.g. cached_loss: sees the window first
                with self.micro_batch(last=False):
                    loss_fn = loss_fn.prepare(self.model, batch, pieces)
            for i, piece in enumerate(pieces):
                # defers_sync: the sync waits for end_window (Note [auto micro-batch across ranks])
                last = i == len(pieces) - 1 and not self.sync.defers_sync
                with self.micro_batch(last=last):
                    loss_sum, count = as_sum_and_count(loss_fn(self.model, piece), sizes[i])
                    self.backward(loss_sum, count)
                if probe and record and probe.peak_bytes(record) > self.memory_budget:  # type: ignore[operator]
                    raise MemoryBudgetExceeded(
                        f"micro_batch_size={size} used {auto.format_bytes(probe.peak_bytes(record))}, "
                        f"over memory_budget={auto.format_bytes(self.memory_budget or 0)}; use "
                        'micro_batch_size="auto", a smaller micro-batch or a larger budget.'
                    )

    # ------------------------------------------------------------------ the low-level path
    @contextlib.contextmanager
    def micro_batch(self, last: bool = True) -> Iterator[None]:
        """Context for one micro-batch's forward and ``backward`` in your own loop.

        It runs the forward in the chosen precision and, for DDP / FSDP, skips the gradient
        all-reduce unless ``last`` is ``True`` (the window's last micro-batch).

        Example:
            >>> for i, mb in enumerate(micro_batches):  # doctest: +SKIP
            ...     with acc.micro_batch(last=i == len(micro_batches) - 1):
            ...         acc.backward(*my_loss(model, mb))
            >>> acc.step()  # doctest: +SKIP
        """
        self._in_micro_batch = True
        try:
            with self.sync.micro_batch(last), self.precision.autocast():
                yield
        finally:
            self._in_micro_batch = False

    def backward(self, loss_sum: torch.Tensor, count: torch.Tensor | int | float) -> None:
        """Back-propagate one micro-batch's ``loss_sum``, the sum of ``count`` per-item losses.

        For a mean over ``n`` samples call ``backward(loss * n, n)``. The division by the
        window's total count happens once, in ``step``.

        Raises:
            ValueError: ``loss_sum`` is not a scalar, or ``count`` is negative.
            RuntimeError: precision is bf16 / fp16 and the forward ran outside ``micro_batch()``.
        """
        check_scalar_loss(loss_sum, "loss_sum")
        count = check_count(count, "count")
        if self.precision.autocast_dtype is not None and not self._in_micro_batch:
            raise RuntimeError(
                f"precision={self.precision.name!r} needs the forward under autocast: run it and "
                "backward() inside `with acc.micro_batch(last=...):`."
            )
        w = self._window
        if w.micro_batches == 0:
            w.backward_scale = self.sync.backward_scale(count)
        self.precision.backward(loss_sum * w.backward_scale)
        w.loss_sum = w.loss_sum + loss_sum.detach().reshape(()).to(torch.float64)
        w.count = w.count + count
        w.micro_batches += 1

    def step(self) -> StepResult:
        """Normalise the window's gradients, clip, step the optimizer and scheduler, zero grads.

        Raises:
            RuntimeError: nothing was accumulated since the last step.
            ValueError: the window's total count is 0 (the window is discarded, the parameters
                and the optimizer state are unchanged).
        """
        w = self._window
        if w.micro_batches == 0:
            raise RuntimeError(
                "step() called with nothing accumulated: call backward(loss_sum, count) for at "
                "least one micro-batch first (or use train_step(batch, loss_fn))."
            )
        local = [w.loss_sum, w.count, w.backward_scale]
        totals = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(()) for v in local]
        )
        totals[:2] = self.sync.all_reduce_sum(totals[:2])
        loss_total, count_total, backward_scale = totals.tolist()  # the one host sync per step
        if count_total <= 0:
            self._discard_window()
            raise ValueError(
                f"the window's total count is {count_total:g}: no item to average over (e.g. every "
                "label equals ignore_index). The window was discarded; the parameters and the "
                "optimizer are unchanged. Check the batch or the loss_fn's count."
            )
        params = [p for p in _params(self.optimizer) if p.grad is not None]
        self.precision.unscale_(self.optimizer)
        if params:
            scale = self.sync.world_size / (count_total * backward_scale)
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)
        grad_norm = _clip_or_norm(params, self.max_grad_norm)
        skipped = self.precision.step(self.optimizer)
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._window = _Window()
        return StepResult(
            loss=loss_total / count_total,
            count=count_total,
            micro_batches=w.micro_batches,
            micro_batch_size=None,
            grad_norm=float(grad_norm),
            skipped=skipped,
        )

    # ------------------------------------------------------------------ helpers
    def _discard_window(self) -> None:
        """Drop the window's partial gradients: a failed micro-batch may have left some in .grad."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self._window = _Window()

    def _check_empty_window(self) -> None:
        if self._window.micro_batches:
            raise RuntimeError(
                f"train_step() called while {self._window.micro_batches} micro-batch(es) from "
                "backward() await a step(): call acc.step() first, or use only one of the two paths."
            )
        if any(p.grad is not None for p in _params(self.optimizer)):
            raise RuntimeError(
                "train_step() found gradients already in the parameters' .grad; they would be "
                "mixed into this step. Call optimizer.zero_grad(set_to_none=True) before it."
            )


def _params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _clip_or_norm(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    if not params:
        return torch.zeros(())
    if max_norm is not None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    norms = torch._foreach_norm([p.grad for p in params])  # type: ignore[misc]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: Any, device: torch.device) -> None:
    """Restore the RNG so a redone window draws the same dropout masks as the first try."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)

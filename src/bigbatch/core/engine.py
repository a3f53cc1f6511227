"""The accumulation engine: exactly one optimizer step per logical batch, however it is cut.

``Accumulator.train_step(batch, loss_fn)`` hands the window to the runner
(``bigbatch.core._window``: cut, size, retry after out-of-memory, restore), back-propagates each
micro-batch's loss *sum*, and steps once; ``micro_batch`` / ``backward`` / ``step`` are the same
parts for users who keep their own loop. See Note [window normalisation] and Note [named terms]
in ``bigbatch.core.loss``, Note [global normalisation] in ``bigbatch.core._sync``, Note [fp16 and
accumulation] in ``bigbatch.core._precision`` and Note [auto micro-batch] in
``bigbatch.core._auto``.

Note [backward scale]
    Every micro-batch back-propagates ``Σ_k w_k · loss_sum_k · s_k`` (one scale ``s_k`` per loss
    term) and ``step`` multiplies the gradients by ``W / (C · s)`` (``W`` ranks, whose average
    DDP / FSDP take; ``C`` the window's total count): the step is exact whatever ``s`` is, and
    ``s`` only sets the magnitude of what flows through the backward, which matters in fp16 (the
    loss scaler skips a step whose gradients overflow). The best ``s`` is ``1 / C``: every
    backward then runs at the scale of the full batch's mean, what a plain fp16 loop runs. So:

    * counts known before the window (``count_fn``, a count pass): ``s_k = 1 / C_k`` exactly,
      on several ranks the global ``C_k`` (one small all-reduce before the window). A loss of
      several terms needs this (Note [named terms]): its first window without ``count_fn``
      restarts with a count pass, and so do the windows after it.
    * otherwise, one term: ``s = 1 / N`` (the window's samples; exactly ``1 / C`` for a mean over
      samples); in fp16 ``s = 1 / Ĉ`` with ``Ĉ`` the batch's labelled tokens when the batch says
      (a mapping with ``labels``: ``labels != -100``); and in fp16 a loss whose counts are not
      its samples switches to *following* the count: ``s = 1 / (count seen so far)``, the
      gradients rescaled as counts arrive, and on several ranks the global count agreed at each
      rank's last micro-batch (whose backward synchronises), so no rank back-propagates sums of
      another magnitude than the full batch's mean.
    * fp32 / bf16 on several ranks: ``s = 1`` (float32's range cannot overflow; no collective).

Note [window checks]
    Bad values that can only be seen on the device (a count tensor that is negative or not
    finite, a loss or gradient that is NaN or infinite) are checked at ``step``, from the totals
    it reads anyway (one host sync per step), before ``optimizer.step()``: a window that fails a
    check is discarded and nothing else changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
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
from bigbatch.core._window import (
    Piece,
    Restart,
    Runner,
    Window,
    agree,
    clamp_count,
    prepass,
    replay,
    total_counts,
)
from bigbatch.core.loss import LossFn, Term, WindowLoss, as_terms, check_count, check_scalar_loss
from bigbatch.core.split import Batch

CountFn = Callable[[Any], Any]
"""``count_fn(micro_batch)``: the count the loss will return for it (``{name: count}`` for terms)."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    Attributes:
        loss: the window's true loss, ``Σ loss_sum / Σ count`` over all ranks (for named terms
            ``Σ_k w_k Σ loss_sum_k / Σ count_k``).
        count: the window's total count over all ranks (samples, or tokens for a token loss; the
            first term's for named terms).
        micro_batches: micro-batches accumulated on this rank.
        micro_batch_size: samples per micro-batch (the last may be smaller), or the token budget
            of a token cut; ``None`` when the caller cut the batch itself (``backward``/``step``).
        grad_norm: total 2-norm of the normalised gradient, before clipping.
        skipped: ``True`` when the optimizer did not step: fp16 found inf/NaN gradients, or
            ``nonfinite="skip"`` met a non-finite loss or gradient. The scheduler did not step.
        oom_retries: windows redone at a smaller micro-batch after running out of memory.
        samples: samples in the window on this rank (``None`` for ``backward`` / ``step``).
        nonfinite: the loss or the gradient norm was NaN or infinite.
        peak_bytes: memory the successful attempt of the window added at its peak (measured
            with ``micro_batch_size="auto"`` or a ``memory_budget``; else ``None``).
        terms: each named term's value ``Σ loss_sum_k / Σ count_k`` (one ``"loss"`` otherwise).
        tokens: real tokens in the window on this rank (token cuts), else ``None``.
        padded_tokens: tokens computed, padding included (token cuts), else ``None``.
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
    terms: dict[str, float] = field(default_factory=dict)
    tokens: int | None = None
    padded_tokens: int | None = None


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
        sizing = make_sizing(micro_batch_size)
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        self.nonfinite = check_nonfinite(nonfinite)
        check_optimizer(model, optimizer)
        self.model, self.optimizer = model, optimizer
        self.scheduler = check_scheduler(scheduler, optimizer)
        self.micro_batch_size = micro_batch_size
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._precision = make_precision(precision, self.device)
        budget = parse_bytes(memory_budget)
        meter = WindowMeter(self.device, budget, sizing.retries, gradient_bytes(optimizer))
        self._sync = make_sync(model, auto=sizing.retries)
        self._runner = Runner(model, sizing, self._sync, meter, self.device)
        self._window = Window()
        self._last: bool | None = None  # inside micro_batch(): whether it is the window's last
        self._count_pass = False  # the loss has several terms: count them before each window
        self._warned = False  # about batch-coupled layers, once (bigbatch.core._batchnorm)

    @property
    def precision(self) -> str:
        """``"fp32"``, ``"bf16"`` or ``"fp16"``."""
        return self._precision.name

    @property
    def current_micro_batch_size(self) -> int | None:
        """The micro-batch the next full window is cut at (``None``: auto before its first window)."""
        return self._runner.sizing.adopted

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
        return {"sizing": self._runner.sizing.state_dict(), "scaler": self._precision.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (same micro-batch policy and precision).

        Raises:
            ValueError: not an engine state, or saved with another micro-batch policy or
                precision (the message names the field).
        """
        if not isinstance(state, Mapping) or not {"sizing", "scaler"} <= set(state):
            raise ValueError(
                f"load_state_dict() got {type(state).__name__} without the keys 'sizing' and "
                "'scaler': pass what Accumulator.state_dict() returned."
            )
        self._runner.sizing.load_state_dict(dict(state["sizing"]))
        self._precision.load_state_dict(state["scaler"])

    # ------------------------------------------------------------------ the high-level path
    def train_step(
        self, batch: Batch, loss_fn: LossFn, *, count_fn: CountFn | None = None
    ) -> StepResult:
        """Cut ``batch`` into micro-batches, accumulate them and take one optimizer step.

        Args:
            batch: a tensor or nested tuple / list / dict of tensors sharing the first dimension
                (per-sample lists of non-tensors are cut with the rows, see ``bigbatch.split``).
            loss_fn: ``loss_fn(model, micro_batch)`` returning a scalar mean, ``(loss_sum,
                count)``, or named terms ``{name: (loss_sum, count[, weight])}``.
            count_fn: optional ``count_fn(micro_batch)``, the count the loss will return for it
                (e.g. its non-padding tokens; ``{name: count}`` for named terms): the backward
                then runs at the full batch's scale with no count pass (Note [backward scale]).
                The step is exact without it.

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
        self._check_empty_window()
        run = functools.partial(self._accumulate, batch, loss_fn=loss_fn, count_fn=count_fn)
        ran = self._runner.run(batch, run, self._finish, self._discard_window)
        return dataclasses.replace(
            ran.value,
            micro_batch_size=ran.size,
            oom_retries=ran.oom_retries,
            peak_bytes=ran.peak_bytes,
        )

    def _finish(self, pieces: list[Piece], size: int) -> StepResult:
        result = self._apply(self._window)
        tokens = [p.tokens for p in pieces]
        if None in tokens:
            return result
        padded = sum(p.padded_tokens or 0 for p in pieces)
        return dataclasses.replace(result, tokens=sum(tokens), padded_tokens=padded)  # type: ignore[arg-type]

    def _accumulate(
        self, batch: Batch, pieces: list[Piece], size: int, *, loss_fn: Any, count_fn: Any
    ) -> None:
        if not self._warned and len(pieces) > 1:  # one micro-batch is the full batch: exact
            warn_batch_coupled(self.model)
            self._warned = True
        samples = sum(p.samples for p in pieces)
        if isinstance(loss_fn, WindowLoss):  # e.g. cached_loss: sees the window first
            with self._sync.micro_batch(False), self._precision.autocast():  # no backward
                loss_fn = loss_fn.prepare(self.model, batch, [p.batch for p in pieces])
        counts, states = self._counts(pieces, loss_fn, count_fn)
        self._plan(batch, counts, samples)
        last_syncs = not self._sync.defers_sync  # Note [auto micro-batch across ranks]
        with window(self.model, samples):
            for i, piece in enumerate(pieces):
                with replay(states[i] if states else None, self.device):
                    with self.micro_batch(last=last_syncs and i == len(pieces) - 1):
                        self._backward(as_terms(loss_fn(self.model, piece.batch), piece.samples))
                self._runner.check_memory(size)
        self._window.deferred = self._window.deferred or self._sync.defers_sync
        self._window.samples = samples

    def _counts(
        self, pieces: list[Piece], loss_fn: Any, count_fn: Any
    ) -> tuple[list[Any] | None, list[Any] | None]:
        """Each piece's counts before the window: ``count_fn``'s, or a count pass's (Note [named
        terms]); ``None`` when neither is needed. Also the random states the pass started from."""
        if count_fn is not None:
            return [count_fn(p.batch) for p in pieces], None
        if not self._count_pass:
            return None, None

        def count(piece: Piece) -> dict[str, Any]:
            with self._precision.autocast():
                terms = as_terms(loss_fn(self.model, piece.batch), piece.samples)
            return {name: t.count for name, t in terms.items()}

        failure, outputs, states = None, None, None
        try:
            outputs, states = prepass(self.model, pieces, count, self.device)
        except Exception as exc:  # the other ranks must not wait in the totals for us
            failure = exc
        agree(self._sync, failure)
        return outputs, states

    def _plan(self, batch: Batch, counts: list[Any] | None, samples: int) -> None:
        """The window's scales before it runs (Note [backward scale])."""
        w, fp16 = self._window, self._precision.scaler is not None
        if counts is not None:
            w.expected = self._global(total_counts(counts), samples)[0]
            w.scales = {k: 1.0 / clamp_count(c) for k, c in w.expected.items()}
        elif self._sync.world_size > 1 and not fp16:
            w.scales = {"loss": 1.0}  # fp32 / bf16 do not overflow: no collective (slow links)
        else:
            labelled = _labelled_tokens(batch) if fp16 else None
            local = {"loss": labelled} if labelled is not None else {}
            totals, n = self._global(local, samples)
            w.scales = {"loss": 1.0 / clamp_count(totals.get("loss", n))}
            w.follow = "tensors" if labelled is None and fp16 else ""  # token losses (_follow)

    def _global(self, local: dict[str, Any], samples: int) -> tuple[dict[str, Any], float]:
        """``local`` counts and the samples summed over ranks (one all-reduce; none on one)."""
        if self._sync.world_size == 1:
            return local, float(samples)
        values = [*local.values(), float(samples)]
        total = self._sync.all_reduce_sum(_stack(values, self.device))
        return dict(zip(local, total[:-1], strict=True)), float(total[-1])

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
        self._last = last
        try:
            with self._sync.micro_batch(last and not w.deferred), self._precision.autocast():
                yield
        finally:
            self._last = None
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
        self._backward({"loss": Term(loss_sum, check_count(count, "count"))})

    def _backward(self, terms: dict[str, Term]) -> None:
        w = self._window
        if self._last is None and w.pending_forwards:
            w.pending_forwards -= (
                1  # the backward of a forward run earlier (Note [several forwards])
            )
        elif self._last is None and self._precision.autocast_dtype is not None:
            raise RuntimeError(
                f"precision={self.precision!r} needs the forward under autocast: run it inside "
                "`with acc.micro_batch(last=...):` (and backward() there or after it)."
            )
        if w.scales is None:  # the low-level path: nothing known before the window
            w.scales = {"loss": 1.0}
            w.follow = "all" if self._precision.scaler is not None else ""
        if set(terms) != set(w.scales):
            self._need_counts(terms)
        count = terms["loss"].count if "loss" in terms else None
        if w.follow == "all" or w.follow and isinstance(count, torch.Tensor):
            self._follow(count)
        loss = sum(t.weight * t.loss_sum * w.scales[k] for k, t in terms.items())
        self._precision.backward(loss)  # type: ignore[arg-type]
        w.add(terms)

    def _need_counts(self, terms: Mapping[str, Term]) -> None:
        """Several terms and no counts known before the window (Note [named terms])."""
        if self._last is not None and not self._window.micro_batches and not self._count_pass:
            self._count_pass = True  # train_step: this window and the next ones count first
            raise Restart
        raise ValueError(
            f"loss_fn returned the terms {sorted(terms)}, but the counts known before the window "
            f"are for {sorted(self._window.scales or {})}: a loss of several terms needs each "
            "term's count before the first backward. Return the same terms for every micro-batch, "
            "give count_fn returning {name: count}, or use train_step (it counts first)."
        )

    def _follow(self, count: Any) -> None:
        """fp16 without counts known before: scale by 1 / (count seen so far), rescaling the
        gradients already accumulated; on several ranks agreed at the syncing backward."""
        w = self._window
        seen = w.seen("loss", count)
        if self._last and self._sync.world_size > 1 and not w.deferred:  # DDP syncs next
            seen = self._sync.all_reduce_sum(torch.as_tensor(seen, dtype=torch.float64))
        scale = 1.0 / seen
        if w.micro_batches:
            scale_grads_(self._params_with_grad(), scale / w.scales["loss"])  # type: ignore[index]
        w.scales["loss"] = scale  # type: ignore[index]

    def accumulate_grads(
        self,
        grads: Mapping[torch.Tensor, torch.Tensor] | Sequence[torch.Tensor | None],
        count: torch.Tensor | int | float,
        loss_sum: torch.Tensor | float = 0.0,
    ) -> None:
        """Add gradients computed elsewhere to the window, as if a micro-batch had produced them.

        Args:
            grads: gradients of a loss SUM over ``count`` items: ``{parameter: gradient}`` for
                parameters of the optimizer, or a list in the order of the optimizer's parameters
                (``None`` for none).
            count: the items that sum covers (samples, tokens).
            loss_sum: the sum's value, for the reported loss (a number or a one-element tensor).

        Raises:
            ValueError, TypeError: a gradient whose shape is not its parameter's, a parameter
                the optimizer does not hold, a bad count or loss_sum; FSDP (sharded gradients).
                A refused call changes nothing.
        """
        if self._sync.world_size > 1 and not self._sync.can_defer:
            raise ValueError(
                "accumulate_grads() cannot add gradients to an FSDP model (they are sharded): "
                "express them as a loss and call backward() instead."
            )
        pairs = pair_grads(self.optimizer, grads)  # every check before anything changes
        count = check_count(count, "count")
        value = torch.as_tensor(loss_sum, dtype=torch.float64, device=self.device)
        check_scalar_loss(value, "loss_sum")
        w = self._window
        if w.scales is None:
            w.scales = {"loss": 1.0}
        if set(w.scales) != {"loss"}:
            self._need_counts({"loss": Term(value, count)})
        add_grads_(pairs, w.scales["loss"])
        w.deferred = w.deferred or self._sync.can_defer  # DDP saw no backward: sync at step
        w.add({"loss": Term(value, count)})

    def step(self) -> StepResult:
        """Normalise the window's gradients, clip, step the optimizer and scheduler, zero grads.

        Raises:
            RuntimeError: nothing was accumulated since the last step.
            ValueError: the window's total count is 0, or a count was negative / not finite.
            NonFiniteError: the loss or gradient is NaN / infinite and ``nonfinite="raise"``.
            In each case the window is discarded and nothing else changed.
        """
        if self._window.micro_batches == 0:
            raise RuntimeError(
                "step() called with nothing accumulated: call backward(loss_sum, count) for at "
                "least one micro-batch first (or use train_step(batch, loss_fn))."
            )
        try:
            return self._apply(self._window)
        except BaseException:
            self._discard_window()
            raise

    def _apply(self, w: Window) -> StepResult:
        totals = self._totals(w)  # the one host sync per step
        counts = {k: totals[1][k] for k in w.sums}
        check_window_totals(sum(counts.values()), totals[2])
        _check_expected(w.expected, counts)
        terms = {k: totals[0][k] / c if c else 0.0 for k, c in counts.items()}
        loss = sum(w.weights[k] * v for k, v in terms.items())
        first = next(iter(counts))
        fp16 = self._precision.scaler is not None  # non-finite windows are the scaler's to skip
        if not math.isfinite(loss) and self.nonfinite == "raise" and not fp16:
            raise NonFiniteError(
                f"the window's loss is {loss} (count {counts[first]:g}); " + NONFINITE_FIX
            )
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        scale = float(w.scales[first])  # type: ignore[index]  # set by the first backward
        factor = self._sync.world_size / (counts[first] * scale) if counts[first] else 1.0
        if w.deferred:  # Note [several forwards]: each rank's own factor, then the average
            scale_grads_(params, factor)
            self._sync.reduce_grads(params)
        self._precision.unscale_(self.optimizer)
        with_grad = [p for p in params if p.grad is not None]
        if not w.deferred and abs(factor - 1.0) > 4e-16:
            scale_grads_(with_grad, factor)
        grad_norm = float(clip_or_norm_(with_grad, self.max_grad_norm))
        nonfinite = not (math.isfinite(loss) and math.isfinite(grad_norm))
        skipped = self._decide(nonfinite, grad_norm, counts[first])
        if skipped:
            self._precision.discard()
        else:
            skipped = self._precision.step(self.optimizer)
        if not skipped:
            step_scheduler(self.scheduler, loss)
        self.optimizer.zero_grad(set_to_none=True)
        self._window = Window()
        return StepResult(
            loss, counts[first], w.micro_batches, None, grad_norm, skipped, nonfinite=nonfinite,
            samples=getattr(w, "samples", None), terms=terms,
        )  # fmt: skip

    def _decide(self, nonfinite: bool, grad_norm: float, count: float) -> bool:
        """Whether a non-finite window is skipped (fp16 leaves gradients to its loss scaler)."""
        if not nonfinite or self.nonfinite == "apply" or self._precision.scaler is not None:
            return False  # fp16: the scaler skips it and lowers the scale, as a full batch would
        if self.nonfinite == "raise":
            raise NonFiniteError(
                f"the window's gradient norm is {grad_norm} (count {count:g}); " + NONFINITE_FIX
            )
        return True

    def _totals(self, w: Window) -> tuple[dict[str, float], dict[str, float], float]:
        """Each term's sum and count and the bad counts, over all ranks (one all-reduce)."""
        names = list(w.sums)
        local = [*(w.sums[k] for k in names), *(w.counts[k] for k in names), w.bad_counts]
        totals = self._sync.all_reduce_sum(_stack(local, self.device)).tolist()
        k = len(names)
        sums, counts = totals[:k], totals[k : 2 * k]
        return (
            dict(zip(names, sums, strict=True)),
            dict(zip(names, counts, strict=True)),
            totals[-1],
        )

    # ------------------------------------------------------------------ helpers
    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _discard_window(self) -> None:
        """Drop the window's partial gradients (a failed micro-batch may have left some in .grad)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self._precision.discard()
        self._window = Window()

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


def _labelled_tokens(batch: Batch) -> torch.Tensor | None:
    """``labels != -100`` counted, for a batch in the transformers convention; else ``None``."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and not labels.is_floating_point():
        return (labels != -100).sum()
    return None


def _check_expected(expected: dict[str, Any] | None, counts: dict[str, float]) -> None:
    """The counts known before the window must be the ones the loss returned (several terms)."""
    if expected is None or len(counts) == 1:
        return
    for name, count in counts.items():
        want = float(expected.get(name, math.nan))
        if not math.isclose(want, count, rel_tol=1e-9, abs_tol=1e-9):
            raise ValueError(
                f"term {name!r}: count_fn counted {want:g} before the window, loss_fn returned "
                f"counts adding up to {count:g}: count_fn must return, for each micro-batch, the "
                "counts loss_fn will return for it. The window was discarded; nothing changed."
            )


def _stack(values: Sequence[Any], device: torch.device) -> torch.Tensor:
    """Numbers and 0-dim tensors as one float64 vector on ``device``."""
    return torch.stack(
        [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values]
    )

"""The accumulation engine: exactly one optimizer step per logical batch, however it is cut.

``Accumulator.train_step(batch, loss_fn)`` hands the window to the runner
(``bigbatch.core._window``: cut, size, retry after out-of-memory, restore), back-propagates each
micro-batch's loss *sum*, and steps once; ``micro_batch`` / ``backward`` / ``step`` are the same
parts for users who keep their own loop. See Note [window normalisation] and Note [named terms]
in ``bigbatch.core.loss``, Note [backward scale] in ``bigbatch.core._scale``, Note [global
normalisation] in ``bigbatch.core._sync``, Note [fp16 and accumulation] in
``bigbatch.core._precision`` and Note [auto micro-batch] in ``bigbatch.core._sizing``.

Note [window checks]
    Bad values that can only be seen on the device (a count tensor that is negative or not
    finite, a loss or gradient that is NaN or infinite) are checked at ``step``, from the totals
    it reads anyway (one host sync per step), before ``optimizer.step()``: a window that fails a
    check is discarded and nothing else changes. A window whose total count is 0 (every label
    ``ignore_index``, every sample masked or weighted 0: a third of wikitext's lines are empty)
    has nothing to average over; transformers' Trainer and Keras then take the step with a zero
    gradient and report a loss of 0, and so does the engine, with one ``BigBatchWarning``: the
    optimizer steps (AdamW still decays its moments and the weights, SGD's momentum still moves
    them). A term whose count is 0 and whose sum is not has no full-batch value (sum / 0) and is
    refused; one whose sum is 0 too adds nothing (its scale is 0: ``_reciprocal`` in ``_scale``),
    so the other terms' gradients are the full batch's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from bigbatch.core import _rng
from bigbatch.core._precision import Precision
from bigbatch.core._scale import follow, overflowed, plan, scaled_sum
from bigbatch.core._sizing import WindowMeter
from bigbatch.core._stepping import Stepper, StepResult, pair_grads, params_of
from bigbatch.core._sync import COUNTS_FIRST, SHARDS_NEED_SUMS, make_sync
from bigbatch.core._tokens import PAD_ROWS_NEED_SUMS, TokenCut, check_pad_rows, warn_if_copying
from bigbatch.core._window import Piece, Restart, Runner, Window, agree, prepass, with_stats
from bigbatch.core.batchnorm import warn_batch_coupled
from bigbatch.core.cut import Cut, CutSettings
from bigbatch.core.ledger import Ledgers
from bigbatch.core.loss import (
    LossFn,
    Term,
    as_terms,
    check_count,
    check_scalar_loss,
    check_stats_fn,
)
from bigbatch.core.split import Batch

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Accumulator", "CountFn", "StatsFn", "StepResult"]

CountFn = Callable[[Any], Any]
"""``count_fn(micro_batch)``: the count the loss will return for it (``{name: count}`` for terms)."""

StatsFn = Callable[[torch.nn.Module, Any], Any]
"""``stats_fn(model, micro_batch)``: additive statistics (a tensor or a dict of tensors)."""


class Accumulator:
    """Accumulate micro-batch gradients and take one exact optimizer step per logical batch.

    The step's gradient is ``∇(Σ loss_sum) / Σ count`` over every micro-batch of the window,
    the gradient of the true mean over the whole batch. Clipping, the optimizer step, the
    scheduler step and ``zero_grad(set_to_none=True)`` happen once per window.

    Args:
        model: the module to train (plain, ``DistributedDataParallel``, FSDP, or a DeepSpeed
            engine from ``deepspeed.initialize``: Note [DeepSpeed windows] in ``core._deepspeed``).
        optimizer: a ``torch.optim.Optimizer`` holding every trainable parameter of the model
            (under DeepSpeed: the engine's, the one ``deepspeed.initialize`` returned).
        cut: how each window is cut into micro-batches and sized: a ``bigbatch.core.cut.Cut``,
            or a micro-batch size (``8``, ``"auto"``) standing for ``micro_batch_size``; or give
            the cut's settings by name (``**settings``). ``None``: 32 samples per micro-batch.
        scheduler: an LR scheduler of ``optimizer``, stepped once per optimizer step (not per
            micro-batch); ``ReduceLROnPlateau`` is stepped with the window's mean loss.
        max_grad_norm: clip the normalised gradient to this 2-norm; ``None`` to not clip.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + grad scaler); an
            integration passes its own object with ``Precision``'s methods (Keras' loss scaling).
        nonfinite: a window whose loss or gradient norm is NaN / infinite: ``"raise"``
            ``NonFiniteError`` before the optimizer steps (default), ``"skip"`` it, or ``"apply"``
            it anyway. In fp16 every non-finite window is the loss scaler's to skip (and lower
            its scale), as in a plain fp16 loop: ``StepResult.skipped`` and ``.nonfinite``.
        **settings: the cut's settings by name (``Cut``'s fields): ``micro_batch_size``
            (samples per micro-batch, or ``"auto"`` for the largest that fits: an out-of-memory
            error then shrinks it and redoes the window), ``micro_batch_tokens`` (cut windows of
            variable-length text by tokens instead: Note [token windows] in
            ``bigbatch.core._tokens``), ``pad_to_multiple_of`` (Note [compile buckets]),
            ``lengths``, ``pad_values`` (Note [per-token tensors]), ``trim_padding`` and
            ``memory_budget`` (a cap on the memory a window may use above what was in use before
            it, ``"6GiB"``: a window that goes over is redone smaller in auto mode), ``pack``
            (Note [packed windows] in ``bigbatch.core._pack``) and ``count_group`` (under context
            parallelism, the ``DeviceMesh`` naming its ``"cp"`` dimension: Note [count groups] in
            ``bigbatch.core._sync``).

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
        cut: Cut | int | str | None = None,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        precision: str | Precision = "fp32",
        *,
        nonfinite: str = "raise",
        **settings: Unpack[CutSettings],
    ) -> None:
        self.cut = Cut.of(cut, **settings)
        sizing, cutter = self.cut.build()
        self._sync = make_sync(model, sizing.retries, self.cut.count_group)  # recognised once
        stepping = self._sync.settings(model, optimizer, scheduler, max_grad_norm, nonfinite)
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.max_grad_norm, self.nonfinite = stepping
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._precision = self._sync.precision(precision, self.device)
        self._stepper = Stepper(optimizer, *stepping, self._precision, self._sync)
        meter = WindowMeter(self.device, self.cut.memory_budget, sizing.retries, optimizer)
        self._runner = Runner(model, sizing, self._sync, meter, self.device, cutter)
        self._window = Window()
        self._last: bool | None = None  # inside micro_batch(): whether it is the window's last
        self._count_pass = False  # the loss has several terms: count them before each window
        self._known: float | None = None  # the count of a window to redo (Note [backward scale])
        self._warned = False  # about batch-coupled layers, once (bigbatch.core.batchnorm)
        self._looked = False  # whether the loss copies its input (warn_if_copying), once
        self._ledger = Ledgers(model)

    @property
    def precision(self) -> str:
        """``"fp32"``, ``"bf16"`` or ``"fp16"``."""
        return self._precision.name

    @property
    def micro_batch_size(self) -> int | str | None:
        """The ``micro_batch_size`` setting of the cut (``None``, a size or ``"auto"``)."""
        return self.cut.micro_batch_size

    @property
    def current_micro_batch_size(self) -> int | None:
        """The micro-batch the next full window is cut at (``None``: auto before its first window)."""
        return self._runner.sizing.state.size

    def track(self, tensors: Callable[[], list[torch.Tensor]]) -> None:
        """Also save and restore ``tensors()`` around each window, besides the buffers.

        For state a forward changes in place that is not a module buffer (Keras keeps BatchNorm
        statistics, seed generators and metric totals in non-trainable variables): a failed or
        redone window then leaves it as it was (Note [window buffers]).
        """
        self._runner.tracked.append(tensors)

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
        self,
        batch: Batch,
        loss_fn: LossFn,
        *,
        count_fn: CountFn | None = None,
        stats_fn: StatsFn | None = None,
    ) -> StepResult:
        """Cut ``batch`` into micro-batches, accumulate them and take one optimizer step.

        Args:
            batch: a tensor or nested tuple / list / dict of tensors sharing the first dimension
                (per-sample lists of non-tensors are cut with the rows, see ``bigbatch.split``).
            loss_fn: ``loss_fn(model, micro_batch)`` returning a scalar mean, ``(loss_sum,
                count)``, or named terms ``{name: (loss_sum, count[, weight])}``; with
                ``stats_fn``, ``loss_fn(model, micro_batch, stats)``.
            count_fn: optional ``count_fn(micro_batch)``, the count the loss will return for it
                (e.g. its non-padding tokens; ``{name: count}`` for named terms): the backward
                then runs at the full batch's scale with no count pass (Note [backward scale]).
                The step is exact without it.
            stats_fn: optional ``stats_fn(model, micro_batch)`` returning additive statistics (a
                tensor or a dict of tensors) computed without gradient in a pass before the
                window; ``loss_fn`` then gets their totals over the window and every rank
                (Note [passes before the window]): a whole-batch statistic (MoE routing fractions, a
                KTO reference point, batch-normalised advantages) with micro-batch memory. Both
                passes draw the same dropout masks; BatchNorm statistics move once.

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
        if self._window.micro_batches:
            raise RuntimeError(
                f"train_step() called while {self._window.micro_batches} micro-batch(es) from "
                "backward() await a step(): call acc.step() first; use only one of the two paths."
            )
        if self._params_with_grad():
            raise RuntimeError(
                "train_step() found gradients already in the parameters' .grad; they would be "
                "mixed into this step. Call optimizer.zero_grad(set_to_none=True) before it."
            )
        check_stats_fn(loss_fn, stats_fn)
        if stats_fn is None:  # the cut's check of a first window (Note [packing audit])
            with self._precision.autocast():
                self._runner.cut.audit(self.model, batch, loss_fn)
        run = functools.partial(self._accumulate, batch, fns=(loss_fn, count_fn, stats_fn))
        return self._runner.run(batch, run, self._finish, self._discard_window)

    def _finish(self, pieces: list[Piece], size: int, retries: int, peak: int | None) -> StepResult:
        cut = self._runner.cut
        if isinstance(cut, TokenCut):  # the shapes this window was cut into
            cut.check_shapes(self.model)
        sized = "micro_batch_tokens" if isinstance(cut, TokenCut) else "micro_batch_size"
        result = self._apply(**{sized: size}, oom_retries=retries, peak_bytes=peak)
        return self._ledger.add(result, pieces)  # Note [step ledger]

    def _accumulate(self, batch: Batch, pieces: list[Piece], size: int, *, fns: tuple) -> None:
        if not self._warned and len(pieces) > 1:  # one micro-batch is the full batch: exact
            warn_batch_coupled(self.model)
            self._warned = True
        loss_fn, states = self._before(batch, pieces, *fns)
        last_syncs = not self._sync.defers_sync  # Note [auto micro-batch across ranks]
        try:
            for i, piece in enumerate(pieces):
                if states:  # the random state its pre-pass drew from (same dropout masks)
                    _rng.restore(states[i], self.device)
                self._last = last = last_syncs and i == len(pieces) - 1
                with self._sync.micro_batch(last):
                    with self._precision.autocast():
                        out = loss_fn(self.model, piece.batch)
                    if i == 0:  # every rank's loss has the same terms, or none steps
                        self._sync.agree_on_terms(out)
                    if not (self._looked or fns[1] or getattr(fns[0], "shifts_labels", 0)):
                        warn_if_copying(piece.batch, out)  # one more read, once
                    self._looked = True
                    self._backward_output(out, piece)
                self._runner.meter.check(size)
        finally:
            self._last = None
        w = self._window
        w.deferred, w.samples = w.deferred or self._sync.defers_sync, sum(p.samples for p in pieces)
        if w.follow and self._precision.scaler is not None:  # Note [backward scale]
            count = overflowed(w, self._sync, self._params_with_grad(), self.device)
            if count is not None:
                self._known = count
                raise Restart

    def _backward_output(self, out: Any, piece: Piece) -> None:
        """Back-propagate what ``loss_fn`` returned for ``piece``. A mean of one term goes in one
        multiply, ``mean · (n · s)``; the window multiplies it by ``n`` at step time."""
        w, scales = self._window, self._window.scales or {}
        if isinstance(out, torch.Tensor) and (piece.pad_rows or self._sync.replicas > 1):
            raise ValueError(PAD_ROWS_NEED_SUMS if piece.pad_rows else SHARDS_NEED_SUMS)  # a mean
        if not isinstance(out, torch.Tensor) or w.follow or scales.keys() != {"loss"}:
            terms = as_terms(out, piece.samples)
            if piece.pad_rows:  # Note [compile buckets]: counts the pad rows cannot join
                check_pad_rows(terms)
            return self._backward(terms)
        check_scalar_loss(out, "loss_fn's return value")
        self._precision.backward(out * (piece.samples * scales["loss"]))
        w.add({"loss": Term(out, piece.samples)}, factor=piece.samples)

    def _before(
        self, batch: Batch, pieces: list[Piece], loss_fn: Any, count_fn: Any, stats_fn: Any
    ) -> tuple[Any, list[Any] | None]:
        """What runs before the window's backwards (Note [passes before the window]): the
        statistics pass, ``cached_loss``'s, the counts and the scales. Returns the loss of the
        pieces and the random states their forwards replay (``None``: no pass ran)."""
        states = counts = None
        if stats_fn is not None:
            outputs, states = self._prepass(lambda p: stats_fn(self.model, p.batch), pieces)
            loss_fn = with_stats(loss_fn, outputs, self._sync)
        if hasattr(loss_fn, "prepare"):  # a WindowLoss (cached_loss): sees the window first
            if any(p.pad_rows for p in pieces):
                raise ValueError("cached_loss takes no pad rows: drop pad_to_multiple_of for it.")
            rows = None if pieces[0].rows is None else [p.rows for p in pieces]
            with self._sync.micro_batch(False), self._precision.autocast():  # no backward
                loss_fn = loss_fn.prepare(self.model, batch, [p.batch for p in pieces], rows)
        if count_fn is not None:
            counts = [count_fn(p.batch) for p in pieces]
        elif self._known is not None:  # a window redone at its known count (fp16 overflow)
            counts, self._known = [self._known], None
        elif self._count_pass:  # Note [named terms]

            def count(p: Piece) -> dict[str, Any]:
                terms = as_terms(loss_fn(self.model, p.batch), p.samples)
                return {name: t.count for name, t in terms.items()}

            counts, states = self._prepass(count, pieces, states)
        plan(
            self._window,
            batch,
            counts,
            sum(p.samples for p in pieces),
            self._sync,
            self._precision.scaler is not None,
        )
        return loss_fn, states

    def _prepass(
        self, fn: Callable[[Piece], Any], pieces: list[Piece], states: list[Any] | None = None
    ) -> tuple[list[Any], list[Any]]:
        """``prepass`` under autocast over the buffers and the tracked tensors, its outcome agreed
        across ranks before the collective that follows it (Note [passes before the window])."""
        state = [*self.model.buffers(), *(t for tensors in self._runner.tracked for t in tensors())]

        def run() -> tuple[list[Any], list[Any]]:
            with self._precision.autocast():
                return prepass(state, pieces, fn, self.device, states)

        return agree(run, getattr(self._sync, "group", None), self._sync.world_size, self.device)

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
        if self._sync.owns_step and w.expected is None:  # Note [DeepSpeed windows]: C first
            self._need_counts(terms, COUNTS_FIRST)
        if self._last is None and w.pending_forwards:  # Note [several forwards]
            w.pending_forwards -= 1  # the backward of a forward run earlier
        elif self._last is None and self._precision.autocast_dtype is not None:
            raise RuntimeError(
                f"precision={self.precision!r} needs the forward under autocast: run it inside "
                "`with acc.micro_batch(last=...):` (and backward() there or after it)."
            )
        if w.scales is None:  # the low-level path: nothing known before the window
            w.scales, w.follow = {"loss": 1.0}, "all" if self._precision.scaler is not None else ""
        if terms.keys() != w.scales.keys():
            if len(terms) == len(w.scales) == 1 and w.expected is None:  # one term, any name
                w.scales = {next(iter(terms)): next(iter(w.scales.values()))}
            else:
                self._need_counts(terms)
        if w.follow:
            count = terms["loss"].count if "loss" in terms else None
            if w.follow == "all" or isinstance(count, torch.Tensor):
                follow(w, count, bool(self._last), self._sync, self._params_with_grad)
        self._precision.backward(scaled_sum(terms, w.scales))
        w.add(terms)

    def _need_counts(self, terms: Mapping[str, Term], why: str = "") -> None:
        """Several terms (or DeepSpeed: ``why``) and no counts known before the window
        (Note [named terms]); ``train_step`` then restarts with a count pass."""
        w = self._window
        if self._last is not None and w.scales and not w.micro_batches and not self._count_pass:
            self._count_pass = True  # train_step: this window and the next ones count first
            raise Restart
        raise ValueError(
            why
            or f"loss_fn returned the terms {sorted(terms)}, but the counts known before the window "
            f"are for {sorted(self._window.scales or {})}: each term's count is needed before the "
            "first backward. Return the same terms each time, give count_fn -> {name: count}, "
            "or use train_step."
        )

    def accumulate_grads(
        self,
        grads: Mapping[torch.Tensor, torch.Tensor] | Iterable[torch.Tensor | None],
        count: torch.Tensor | int | float,
        loss_sum: torch.Tensor | float = 0.0,
    ) -> None:
        """Add gradients computed elsewhere to the window, as if a micro-batch had produced them.

        Args:
            grads: gradients of a loss SUM over ``count`` items: ``{parameter: gradient}`` for
                parameters of the optimizer, or a list (any iterable: a tuple, a generator) in
                the order of the optimizer's parameters (``None`` for none).
            count: the items that sum covers (samples, tokens).
            loss_sum: the sum's value, for the reported loss (a number or a one-element tensor).

        Raises:
            ValueError, TypeError: a gradient whose shape is not its parameter's, a parameter
                the optimizer does not hold, a bad count or loss_sum; FSDP (sharded gradients).
                A refused call changes nothing.
        """
        self._sync.refuse_grads()  # FSDP's are sharded, DeepSpeed's its own
        pairs = pair_grads(self.optimizer, grads)  # every check before anything changes
        count = check_count(count, "count")
        value = torch.as_tensor(loss_sum, dtype=torch.float64, device=self.device)
        check_scalar_loss(value, "loss_sum")
        w = self._window
        w.scales = w.scales or {"loss": 1.0}
        if set(w.scales) != {"loss"}:
            self._need_counts({"loss": Term(value, count)})
        for p, g in pairs:  # p.grad += s · g
            scaled = g.detach().to(p.dtype) * w.scales["loss"]
            p.grad = scaled if p.grad is None else p.grad + scaled
        w.deferred = w.deferred or self._sync.can_defer  # DDP saw no backward: sync at step
        w.add({"loss": Term(value, count)})

    def step(self) -> StepResult:
        """Normalise the window's gradients, clip, step the optimizer and scheduler, zero grads.

        Raises:
            RuntimeError: nothing was accumulated since the last step.
            ValueError: a count was negative / not finite, or a term's count is 0 and its sum is
                not (a window that counted nothing steps with a zero gradient: Note [window
                checks]).
            NonFiniteError: the loss or gradient is NaN / infinite and ``nonfinite="raise"``.
            In each case the window is discarded and nothing else changed.
        """
        if self._window.micro_batches == 0:
            raise RuntimeError(
                "step() called with nothing accumulated: call backward(loss_sum, count) for at "
                "least one micro-batch first (or use train_step(batch, loss_fn))."
            )
        try:
            return self._apply()
        except BaseException:
            self._discard_window()
            raise

    def _apply(self, **fields: Any) -> StepResult:
        try:
            return self._stepper.apply(self._window, **fields)
        finally:
            self._window = Window()

    # ------------------------------------------------------------------ helpers
    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for p in params_of(self.optimizer) if p.grad is not None]

    def _discard_window(self) -> None:
        """Drop the window's partial gradients (a failed micro-batch may have left some in .grad)."""
        self.optimizer.zero_grad(set_to_none=True)
        torch.nn.Module.zero_grad(self.model, set_to_none=True)  # a DeepSpeed engine's takes none
        self._precision.discard()
        self._window = Window()

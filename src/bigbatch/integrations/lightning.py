"""Lightning's ``Trainer(accumulate_grad_batches=k)`` made exact, and audited.

Needs Lightning (``pip install "bigbatch[lightning]"``)::

    trainer = L.Trainer(accumulate_grad_batches=8, callbacks=[bigbatch.lightning.Exact()])
    report = bigbatch.lightning.audit(trainer)   # any Lightning trainer: is its step right?

Note [lightning window]
    Lightning divides every ``training_step`` loss by ``accumulate_grad_batches`` and steps after
    that many batches (fewer at the end of an epoch): a mean of micro-batch means, wrong when the
    micro-batches hold different numbers of tokens, and a short last window scaled by ``m / k``.
    ``Exact`` lets ``training_step`` return ``(loss_sum, count)`` (or a mean over its samples):
    it hands Lightning ``loss_sum · s``, ``s`` fixed for the window and the same on every rank
    (one over the first micro-batches' mean count: the magnitude of a mean, for fp16; one
    all-reduce, since DDP averages what the ranks back-propagate), records the counts, and in
    ``on_before_optimizer_step`` (after fp16 unscaling, before clipping) multiplies the gradients
    by ``k · W / (s · C)``: ``C`` the window's count over every rank (one all-reduce), ``W`` the
    ranks DDP averages over. The gradient is then ``∇(Σ loss_sum) / C`` over the window, the
    full batch's (Note [window normalisation] in ``bigbatch.core.loss``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from bigbatch.core._stepping import EMPTY_WINDOW, params_of, scale_grads_
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.loss import check_count
from bigbatch.core.split import batch_size
from bigbatch.integrations import _audit, _batches, _frameworks

__all__ = ["Exact", "audit"]
_pl = _frameworks.need("lightning.pytorch", "lightning")


def _sum_and_count(out: Any, batch: Any, count: Any = batch_size) -> tuple[torch.Tensor, Any]:
    """A ``training_step`` result as ``(loss_sum, count)``: a pair, or a mean over ``count(batch)``
    items (its samples)."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if isinstance(loss, (tuple, list)) and len(loss) == 2:
        return loss[0], check_count(loss[1], "training_step's count")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"training_step returned {type(out).__name__}: with bigbatch.lightning return "
            "(loss_sum, count), {'loss': (loss_sum, count)} or a mean over the batch's samples."
        )
    n = count(batch)
    return loss * n, n


def _wrap_training_step(pl_module: Any, after: Any) -> None:
    """``pl_module.training_step`` becomes ``after(its result, batch)``."""
    step = pl_module.training_step

    @functools.wraps(step)
    def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
        return after(step(batch, *args, **kwargs), batch)

    # what the first wrapper replaced: None for the class's own method
    own = getattr(step, "bigbatch_own", vars(pl_module).get("training_step"))
    training_step.bigbatch_own = own  # type: ignore[attr-defined]
    pl_module.training_step = training_step


def _unwrap_training_step(pl_module: Any) -> None:
    """Undo every ``_wrap_training_step`` (at teardown, or when fit fails): a second fit wraps
    the module's own ``training_step``, not the last fit's wrappers."""
    if hasattr(vars(pl_module).get("training_step"), "bigbatch_own"):
        own = vars(pl_module).pop("training_step").bigbatch_own
        if own is not None:
            pl_module.training_step = own


def _refuse_deepspeed(trainer: Any, what: str) -> None:
    """Refuse Lightning's DeepSpeed strategy: its ZeRO keeps the window's gradients in its own
    buffers, out of the ``.grad`` that ``Exact`` rescales and the audit reads."""
    if any(c.__name__ == "DeepSpeedStrategy" for c in type(trainer.strategy).__mro__):
        raise ValueError(
            f"{what} cannot run under Lightning's DeepSpeedStrategy (ZeRO keeps the gradients "
            "out of .grad): use DDP or FSDP, or bigbatch.Accumulator on a deepspeed engine."
        )


class Exact(_pl.Callback):  # type: ignore[misc, name-defined]
    """A callback that makes ``accumulate_grad_batches`` exact (Note [lightning window]).

    ``training_step`` returns ``(loss_sum, count)`` (e.g. ``bigbatch.token_cross_entropy``),
    ``{"loss": (loss_sum, count), ...}``, or a mean over its samples; each optimizer step is then
    the step of the whole window as one batch: every token weighs the same whatever micro-batch
    it is in, the short last window of an epoch included, on every rank.

    Example:
        >>> trainer = L.Trainer(accumulate_grad_batches=8, callbacks=[Exact()])  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []  # each micro-batch's (loss_sum, count), float64
        self.last: list[torch.Tensor] = []  # the last window's
        self.scale: Any = None
        self.window_loss: Any = None  # the last window's loss, Σ sum / C

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError(
                "bigbatch.lightning.Exact needs automatic optimization; with manual "
                "optimization accumulate with bigbatch.Accumulator in your training_step."
            )
        _refuse_deepspeed(trainer, "bigbatch.lightning.Exact")
        self.seen, self.scale = [], None  # nothing from a fit that raised mid-window
        self.strategy = trainer.strategy
        _wrap_training_step(pl_module, self._record)

    def teardown(self, trainer: Any, pl_module: Any, stage: Any = None) -> None:
        _unwrap_training_step(pl_module)

    on_exception = teardown

    def _record(self, out: Any, batch: Any) -> dict[str, Any]:
        loss_sum, count = _sum_and_count(out, batch)
        n = torch.as_tensor(count, dtype=torch.float64, device=loss_sum.device)
        if self.scale is None:  # the window's first micro-batch
            self.scale = 1.0 / self.strategy.reduce(n, reduce_op="mean").clamp_min(1.0)
        self.seen.append(torch.stack([loss_sum.detach().to(torch.float64), n]))
        rest = out if isinstance(out, Mapping) else {}  # its "loss" is replaced
        return {**rest, "loss": loss_sum * self.scale.to(loss_sum.dtype)}

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        (seen, scale), self.seen, self.scale = (self.seen, self.scale), [], None
        pairs = torch.stack(seen).to(pl_module.device)
        bad = (~(pairs[:, 1] >= 0) | ~pairs[:, 1].isfinite()).any().to(pairs.dtype)[None]
        mine = torch.cat([pairs.sum(0), bad])  # the window's sums and its bad counts
        loss_sum, total, wrong = trainer.strategy.reduce(mine, reduce_op="sum")  # every rank's
        if wrong:
            raise ValueError(
                "training_step returned a count that is negative or not finite in this window: "
                "a count is the number of items its loss_sum adds up (finite, >= 0). The "
                "optimizer did not step."
            )
        if total == 0:  # Note [window checks] in bigbatch.core.engine: a zero-gradient step
            warnings.warn(EMPTY_WINDOW, BigBatchWarning, stacklevel=2)
        self.window_loss = loss_sum / total if total else loss_sum * 0
        factor = trainer.accumulate_grad_batches * trainer.world_size / (scale * total)
        scale_grads_(params_of(optimizer), factor if total else 0.0)
        self.last = seen


def audit(trainer: Any, steps: int | tuple[int, ...] = 1) -> _audit.Audit:
    """``bigbatch.hf.audit`` for a Lightning ``Trainer``: at the optimizer steps asked for,
    compare the accumulated gradient with the same ``training_step`` on the window as one batch.

    Call it before ``trainer.fit``, after any ``Exact`` in the trainer's callbacks. The audited
    step holds the whole window as one batch (about ``accumulate_grad_batches`` times a step's
    activations): audit where the window fits (Note [audit]). With dropout on, both sides are
    compared with dropout off, the window replayed (Note [audit dropout]).

    Returns:
        An ``Audit`` whose ``.results`` gains one ``AuditResult`` per audited step; when
        training ends, ``.not_reached`` holds the steps it never reached, named in a warning.

    Raises:
        TypeError: ``trainer`` is not a Lightning ``Trainer``. ValueError: bad ``steps``.
    """
    if not isinstance(trainer, _pl.Trainer):
        raise TypeError(f"audit() takes a lightning Trainer, got {type(trainer).__name__}.")
    _refuse_deepspeed(trainer, "bigbatch.lightning.audit")
    trainer.callbacks.append(watch := _Watch(_audit.Audit(_audit.check_steps(steps))))
    return watch.report


class _Watch(_pl.Callback):  # type: ignore[misc, name-defined]
    """``audit``'s callback: records the audited window, compares at its optimizer step."""

    def __init__(self, log: _audit.Audit) -> None:
        self.report: _audit.Audit = log
        self.window: _audit.Window | None = None
        self.exact: Exact | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.exact = next((c for c in trainer.callbacks if isinstance(c, Exact)), None)
        _wrap_training_step(pl_module, self._record)

    def teardown(self, trainer: Any, pl_module: Any, stage: Any = None) -> None:
        _unwrap_training_step(pl_module)

    on_exception = teardown

    def _record(self, out: Any, batch: Any) -> Any:
        if self.window is not None and self.exact is None:  # what Lightning back-propagates
            loss_sum, count = _sum_and_count(out, batch)
            self.window.returns.append(float(loss_sum / count) / self.window.accumulation_steps)
        return out

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        k = trainer.accumulate_grad_batches
        if idx % k == 0:
            self.window = _audit.start(self.report, trainer.global_step + 1, k, pl_module.device)
        if self.window is not None:
            self.window.batches.append(batch)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        _audit.finish(self.report, trainer.global_step)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        w, self.window = self.window, None
        if w is None:
            return
        self._settle(w)
        own = functools.partial(self._own, pl_module)
        loss = functools.partial(self._loss, pl_module, _batches.join(w.batches))
        scope = trainer.precision_plugin.train_step_context
        replay = functools.partial(self._replay, trainer, pl_module, optimizer, w)
        _audit.check(self.report, w, pl_module, loss, own, trainer.world_size > 1, scope, replay)

    def _settle(self, w: _audit.Window) -> None:
        if self.exact is not None:  # each micro-batch over the window's count
            seen = zip(w.batches, self.exact.last, strict=True)
            w.returns = _audit.shares([(b, tuple(s)) for b, s in seen])

    def _replay(self, trainer: Any, pl_module: Any, optimizer: Any, w: _audit.Window) -> None:
        """The window again as Lightning runs it (Note [audit dropout]): each ``training_step``
        (through the strategy: DDP, autocast; with ``Exact``'s and the audit's wrappers) ÷
        ``accumulate_grad_batches``, back-propagated; then ``Exact``'s rescaling; ``w`` gets what
        each back-propagated."""
        self.window, w.returns = w, []
        for i, batch in enumerate(w.batches):
            out = trainer.strategy.training_step(batch, i)
            loss = out["loss"] if isinstance(out, Mapping) else out
            (loss / trainer.accumulate_grad_batches).backward()
        self.window = None
        if self.exact is not None:
            kept = self.exact.window_loss  # the loss the trainer's window had
            self.exact.on_before_optimizer_step(trainer, pl_module, optimizer)
            self.exact.window_loss = kept
        self._settle(w)

    def _loss(self, pl_module: Any, batch: Any) -> torch.Tensor:
        """The module's own ``training_step`` (not a callback's wrapper) on ``batch``: with
        ``Exact`` over the window's count on every rank, else Lightning's mean."""
        loss_sum, count = _sum_and_count(type(pl_module).training_step(pl_module, batch, 0), batch)
        return _audit.window_mean((loss_sum, count), 0) if self.exact else loss_sum / count

    def _own(self, pl_module: Any, batch: Any) -> tuple[float, float]:
        """A micro-batch's own loss and its items: its labels (else its samples), or the
        count its loss gives where that is within a row each of them (shifted labels); a count of
        1 for a token loss is a mean returned as a sum, not its items."""
        out = type(pl_module).training_step(pl_module, batch, 0)
        loss_sum, count = _sum_and_count(out, batch, _batches.count_items)
        items = float(_batches.count_items(batch))
        near = abs(float(count) - items) <= batch_size(batch)
        return float(loss_sum / count), float(count) if near else items

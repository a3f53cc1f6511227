"""transformers' ``Trainer`` (and TRL's) with bigbatch's exact accumulation, and an audit for any.

Needs transformers (``pip install "bigbatch[hf]"``)::

    from bigbatch.hf import Trainer            # a drop-in subclass of transformers.Trainer
    trainer = Trainer(model=model, args=args, train_dataset=data)    # the same arguments
    report = bigbatch.hf.audit(any_trainer)    # is its accumulation right? (Note [audit])

Note [trainer window]
    ``Trainer`` prefetches each optimizer step's ``gradient_accumulation_steps`` batches
    (``get_batch_samples``) and calls ``training_step`` once per batch, inside ``no_sync`` for
    all but the last. ``exact(TrainerClass)`` keeps that loop and changes one thing: the first
    calls of a window return a zero loss without work, and the last (where the Trainer
    synchronises) joins the window's batches into one (``bigbatch.integrations._audit.join``) and
    runs it through an ``Accumulator`` over the Trainer's (maybe DDP-wrapped) model. Its optimizer
    is the Trainer's parameters with a ``step`` and ``zero_grad`` that do nothing, so
    the normalised gradient stays in ``.grad`` for the Trainer's own clipping, optimizer, scheduler
    and logging; its backward is the Trainer's ``accelerator.backward`` (its loss scaler). Each
    micro-batch is trimmed back to its longest sample. The loss is the Trainer's ``compute_loss``
    read as the loss contract wants it: where transformers' own ``compute_loss`` passes
    ``num_items_in_batch`` (the model's loss, label smoothing, ``compute_loss_func``), it gets the
    window's count, as in the one-batch run, and returns ``sum / N``; anywhere else it gets
    ``None`` and returns the micro-batch's mean, multiplied back by its count: the labels that
    are not -100 (shifted for a causal LM, found also inside a wrapper), else its samples, pairs
    for DPO and reward trainers. A ``(sum, count)`` pair or named terms pass through, and so does
    a bigbatch ``loss_fn`` (``cached_loss`` included).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from bigbatch.core._precision import Precision
from bigbatch.core._tokens import make_cut
from bigbatch.core._units import parse_bytes
from bigbatch.core.engine import Accumulator
from bigbatch.core.loss import WindowLoss, as_terms, mean_of
from bigbatch.core.split import batch_size
from bigbatch.integrations._audit import (
    Audit,
    aside,
    check_steps,
    count_items,
    gradients,
    join,
    judge,
    one_batch,
    start,
)

__all__ = ["Trainer", "audit", "exact"]

PAIRED = ("DPOTrainer", "RewardTrainer")
"""Trainers whose batches hold pairs as two halves (chosen rows, then rejected rows)."""


def _transformers() -> Any:
    try:
        import transformers
    except ModuleNotFoundError as exc:
        raise ImportError('bigbatch.hf needs transformers: pip install "bigbatch[hf]"') from exc
    return transformers


def exact(trainer_class: type) -> type:
    """A subclass of ``trainer_class`` whose gradient accumulation is bigbatch's.

    Each optimizer step equals the same trainer's step on the window's batches joined into one
    (Note [trainer window]): on padded variable-length text, for a model whose loss takes no
    ``num_items_in_batch``, with label smoothing, ``compute_loss_func``, a custom ``compute_loss``
    returning a mean, ``(loss_sum, count)`` or named terms ``{name: (sum, count[, weight])}``.
    TRL's DPO and reward trainers are normalised per pair, SFT per token.

    Args:
        trainer_class: ``transformers.Trainer`` or a subclass (TRL's ``SFTTrainer``, ...).

    Returns:
        The subclass. Besides the trainer's own arguments it takes ``micro_batch_size`` (rows per
        micro-batch, ``"auto"`` for the largest that fits; default
        ``per_device_train_batch_size``), ``micro_batch_tokens`` (cut by tokens, or ``"auto"``),
        ``memory_budget`` and ``pad_to_multiple_of`` as ``bigbatch.Accumulator`` does, and
        ``loss_fn``: a bigbatch ``loss_fn(model, batch)`` used instead of ``compute_loss``.

    Raises:
        TypeError: ``trainer_class`` is not a ``transformers.Trainer`` subclass.

    Example:
        >>> from trl import DPOTrainer  # doctest: +SKIP
        >>> trainer = bigbatch.hf.exact(DPOTrainer)(model=model, args=args, ...)  # doctest: +SKIP
    """
    base = _transformers().Trainer
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, base)):
        raise TypeError(
            f"exact() takes a transformers.Trainer subclass, got {trainer_class!r}: e.g. "
            "bigbatch.hf.exact(trl.SFTTrainer)."
        )
    if "bigbatch" in vars(trainer_class):
        return trainer_class

    class Exact(trainer_class):  # type: ignore[valid-type, misc]
        bigbatch = True

        def __init__(  # the trainer's arguments, and how bigbatch cuts its windows
            self, *args: Any, micro_batch_size: int | str | None = None,
            micro_batch_tokens: int | str | None = None, memory_budget: int | str | None = None,
            pad_to_multiple_of: int | None = None, loss_fn: Any = None, **kwargs: Any,
        ) -> None:  # fmt: skip
            make_cut(micro_batch_size, micro_batch_tokens, pad_to_multiple_of)  # refuse early
            parse_bytes(memory_budget)
            super().__init__(*args, **kwargs)
            cut = dict(micro_batch_tokens=micro_batch_tokens, pad_to_multiple_of=pad_to_multiple_of)
            self.bigbatch_window = TrainerWindow(
                self, micro_batch_size, memory_budget, cut, loss_fn
            )

        def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
            self.bigbatch_window.pending, self.bigbatch_window.calls = list(batches), 0
            return batches, n

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            return self.bigbatch_window.training_step(model, inputs, num_items_in_batch)

    Exact.__name__ = Exact.__qualname__ = trainer_class.__name__
    Exact.__doc__ = f"``{trainer_class.__name__}`` with bigbatch's exact accumulation (``exact``)."
    return Exact


class TrainerWindow:
    """The state ``exact`` adds to a trainer: the window's batches and the ``Accumulator``."""

    def __init__(
        self, trainer: Any, size: Any, budget: Any, cut: dict[str, Any], loss_fn: Any
    ) -> None:
        self.trainer, self.size, self.budget, self.cut, self.loss_fn = (
            trainer, size, budget, cut, loss_fn
        )  # fmt: skip
        self.pending: list[Any] = []
        self.calls = 0
        self.acc: Accumulator | None = None
        stock = loss_fn is None and stock_compute_loss(type(trainer))
        self.plain: bool | None = True if stock else None  # the loss has one term: count first
        self.last: Any = None  # the last window's StepResult
        self.paired = paired(type(trainer))
        self.shifts = shifts_labels(trainer.model)

    def training_step(self, model: Any, inputs: Any, num_items: Any) -> torch.Tensor:
        """Nothing until the window's last batch, then the whole window (Note [trainer window])."""
        t = self.trainer
        self.calls += 1
        if self.calls < len(self.pending):
            return torch.zeros((), device=t.args.device)
        window, self.pending, self.calls = self.pending or [inputs], [], 0
        model.train()
        batches = [t._prepare_inputs(b) for b in window]
        batch = join([pairs(b) for b in batches] if self.paired else batches, pad_id(t))
        loss_fn: Any = self.loss_fn
        if not isinstance(self.loss_fn, WindowLoss):
            if num_items is not None:  # the Trainer's count may miss the shift (GPT-2): recount
                num_items = self.window_count(batch)
            loss_fn = functools.partial(self._loss, self.loss_fn, num_items)
        count_fn = self.count if self.plain and self.loss_fn is None else None
        with t.compute_loss_context_manager(), one_step(t):
            self.last = self._accumulator(model).train_step(batch, loss_fn, count_fn=count_fn)
        return torch.tensor(self.last.loss, device=t.args.device)

    def _accumulator(self, model: Any) -> Accumulator:
        t = self.trainer
        if self.acc is None or self.acc.model is not model:
            size = self.size or (None if self.cut["micro_batch_tokens"] else t.args.per_device_train_batch_size)  # fmt: skip
            # The Trainer's optimizer, its step and zero_grad left to the Trainer (which clips,
            # steps and schedules after the window); its accelerator back-propagates (its scaler).
            held = SimpleNamespace(
                param_groups=t.optimizer.param_groups, step=_nothing, zero_grad=_nothing
            )
            precision = Precision("fp32", torch.device(t.args.device).type)
            precision.backward = t.accelerator.backward  # type: ignore[method-assign]
            self.acc = Accumulator(
                model, held, size, precision=precision, memory_budget=self.budget,  # type: ignore[arg-type]
                nonfinite="apply", **self.cut,
            )  # fmt: skip
        return self.acc

    def _loss(self, loss_fn: Any, num_items: Any, model: Any, micro_batch: Any) -> Any:
        """The micro-batch's loss as the loss contract reads it (Note [trainer window])."""
        t, count = self.trainer, self.count(micro_batch)  # rows of pairs: pairs
        mb = trim(unpairs(micro_batch) if self.paired else micro_batch)
        if loss_fn is not None:
            return loss_fn(model, mb)
        n = num_items if stock_compute_loss(type(t)) else None
        out = t.compute_loss(model, dict(mb), num_items_in_batch=n)
        if self.plain is None:
            self.plain = not isinstance(out, Mapping)
        if not isinstance(out, torch.Tensor):
            return out
        if n is None:
            return out * count, count
        return out * (n / self.ranks()), count  # compute_loss multiplied by the ranks DDP averages

    def window_count(self, batch: Any) -> torch.Tensor:
        """The window's count, every rank's where the Trainer averages tokens across them."""
        n = torch.as_tensor(count_items(batch, self.shifts), device=self.trainer.args.device)
        if self.ranks() > 1:
            torch.distributed.all_reduce(n)
        return n

    def ranks(self) -> int:
        """The ranks transformers' ``compute_loss`` multiplies a ``num_items`` loss by."""
        t = self.trainer
        return t.accelerator.num_processes if t.args.average_tokens_across_devices else 1

    def count(self, micro_batch: Any) -> Any:
        """``count_items`` with this trainer's shift (the engine's ``count_fn``)."""
        return count_items(micro_batch, self.shifts)


@contextlib.contextmanager
def one_step(trainer: Any) -> Iterator[None]:
    """Within the block the trainer's accumulation steps are 1, as in its one-batch run: a loss
    that divides by them (``current_gradient_accumulation_steps``, ``args``) sees one batch."""
    args, before = trainer.args, (trainer.args.gradient_accumulation_steps, trainer.current_gradient_accumulation_steps)  # fmt: skip
    args.gradient_accumulation_steps = trainer.current_gradient_accumulation_steps = 1
    try:
        yield
    finally:
        args.gradient_accumulation_steps, trainer.current_gradient_accumulation_steps = before


def _nothing(*args: Any, **kwargs: Any) -> None:
    pass


def paired(trainer_class: type) -> bool:
    """Whether the trainer's batches hold pairs as halves (TRL's DPO and reward trainers)."""
    return any(c.__name__ in PAIRED for c in trainer_class.__mro__)


def pairs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A batch of ``2B`` rows (chosen, then rejected) as ``B`` rows of pairs ``[B, 2, ...]``."""
    n = batch_size(batch)
    return {
        k: torch.stack(v.chunk(2), 1)
        if isinstance(v, torch.Tensor) and v.dim() and len(v) == n
        else v
        for k, v in batch.items()
    }


def unpairs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``pairs`` undone: rows of pairs back to chosen rows, then rejected rows."""
    return {
        k: torch.cat(v.unbind(1))
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == 2
        else v
        for k, v in batch.items()
    }


def trim(batch: Any) -> Any:
    """A right-padded micro-batch cut back to its longest sample (the columns that are padding in
    every row go; a left-padded batch keeps them all)."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask[:, -1:].eq(0).all()):
        return batch
    used = mask.ne(0).any(0).nonzero()
    width, full = (int(used.max()) + 1 if len(used) else 1), mask.shape[1]
    return {
        k: v[:, :width]
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == full
        else v
        for k, v in batch.items()
    }


def stock_compute_loss(trainer_class: type) -> bool:
    """Whether ``compute_loss`` is transformers' own (which honours ``num_items_in_batch``)."""
    owner = next(c for c in trainer_class.__mro__ if "compute_loss" in vars(c))
    return owner.__module__.startswith("transformers.")


def shifts_labels(model: Any) -> bool:
    """Whether the model's loss shifts its labels (a causal LM), looking inside wrappers."""
    tf = _transformers()
    from transformers.loss.loss_utils import ForCausalLMLoss

    for m in model.modules() if isinstance(model, torch.nn.Module) else []:
        if isinstance(m, tf.PreTrainedModel):  # the loss it computes (GPT-2's loss_type is None)
            decoder_only = not getattr(m.config, "is_encoder_decoder", False)
            return decoder_only and m.loss_function is ForCausalLMLoss
    return False


def pad_id(trainer: Any) -> int:
    """The tokenizer's pad id, else the model's, else 0."""
    for owner in (
        getattr(trainer, "processing_class", None),
        getattr(trainer.model, "config", None),
    ):
        value = getattr(owner, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0


def audit(trainer: Any, steps: int | tuple[int, ...] = 1) -> Audit:
    """Check, inside training, that a trainer's accumulated step equals its one-batch step.

    Attaches to any ``transformers.Trainer`` (bigbatch's, TRL's, your subclass): at the optimizer
    steps asked for, after the window's last backward and before clipping, it recomputes the
    window as one batch from the same weights and random state and compares the gradients
    (Note [audit] in ``bigbatch.integrations._audit``); training goes on unchanged. Costs one
    forward and backward of the window, per audited step; a wrong step costs one more forward to
    say why (Note [audit diagnosis]). Logs one line per audited step (logger ``"bigbatch"``).

    Args:
        trainer: the trainer, before ``trainer.train()``.
        steps: the optimizer steps to audit (1 is the first), an int or a tuple of ints.

    Returns:
        An ``Audit`` whose ``.results`` gains one ``AuditResult`` (``exact``,
        ``grad_norm_ratio``, ``loss_ratio``, ``diagnosis``) per audited step.

    Raises:
        TypeError: ``trainer`` is not a ``transformers.Trainer``.
        ValueError: bad ``steps``.

    Example:
        >>> report = bigbatch.hf.audit(trainer)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        >>> report.results[0].exact, report.results[0].diagnosis  # doctest: +SKIP
        (False, 'per-micro-batch mean on padded data')
    """
    if not isinstance(trainer, _transformers().Trainer):
        raise TypeError(f"audit() takes a transformers.Trainer, got {type(trainer).__name__}.")
    log = Audit(check_steps(steps))
    _Watch(trainer, log)
    return log


class _Watch:
    """``audit``'s hold on a trainer: its ``get_batch_samples`` and ``training_step``, wrapped on
    the instance (the class is untouched)."""

    def __init__(self, trainer: Any, log: Audit) -> None:
        self.trainer, self.log, self.window = trainer, log, None
        self.get, self.step = trainer.get_batch_samples, trainer.training_step
        trainer.get_batch_samples, trainer.training_step = (
            self.get_batch_samples,
            self.training_step,
        )
        self.paired, self.shifts = paired(type(trainer)), shifts_labels(trainer.model)

    def get_batch_samples(self, iterator: Any, num_batches: int, device: Any) -> Any:
        batches, n = self.get(iterator, num_batches, device)
        t, step = self.trainer, self.trainer.state.global_step + 1
        if step in self.log.steps and batches:
            k = t.args.gradient_accumulation_steps
            self.window = start(step, list(batches), k, t.args.device)  # type: ignore[assignment]
        return batches, n

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = self.step(model, inputs, num_items_in_batch)
        w = self.window
        if w is not None:
            w.returns.append(float(loss))
            if len(w.returns) == len(w.batches):
                self.window = None
                self.log.results.append(self._compare(model, w))
        return loss

    def _compare(self, model: Any, w: Any) -> Any:
        t, acc = self.trainer, gradients(model)
        batches = [t._prepare_inputs(b) for b in w.batches]
        joined = join([pairs(b) for b in batches] if self.paired else batches, pad_id(t))
        with aside(model, w, t.args.device), one_step(t):
            one = one_batch(model, lambda: self._loss(model, joined), average=False)
            mine = getattr(t, "bigbatch_window", None) is not None
            return judge(w, acc, one, None if mine else lambda: self._weights(model, batches))

    def _loss(self, model: Any, batch: Any) -> torch.Tensor:
        """The trainer's loss on ``batch`` as one batch (what it does with one accumulation
        step); bigbatch's reads it as its window does (Note [trainer window])."""
        t, window = self.trainer, getattr(self.trainer, "bigbatch_window", None)
        if window is not None:
            n = window.window_count(batch) if window.plain and window.loss_fn is None else None
            out = window._loss(window.loss_fn, n, model, batch)
        else:
            batch = unpairs(batch) if self.paired else batch
            n = t._get_num_items_in_batch([batch], t.args.device)
            out = t.compute_loss(model, dict(batch), num_items_in_batch=n)
        return mean_of(as_terms(out, batch_size(batch)))

    def _weights(self, model: Any, batches: list[Any]) -> tuple[list[float], list[float]]:
        with torch.no_grad():
            own = [float(self._loss(model, pairs(b) if self.paired else b)) for b in batches]
        return own, [float(count_items(b, self.shifts)) for b in batches]


Trainer: type = exact(_transformers().Trainer)

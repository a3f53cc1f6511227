"""``bigbatch.hf.audit``: a transformers Trainer's accumulated step against its one-batch step.

What the audit wraps on a trainer to record a window, replay it and compute its loss as one batch;
the comparison, its tolerance and its diagnosis are the audit core's, shared with Lightning
(``bigbatch.integrations._audit``: Note [audit]).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, cast

import torch

from bigbatch.core._tree import map_tensors
from bigbatch.core.split import batch_size
from bigbatch.integrations import _audit, _batches, _frameworks
from bigbatch.integrations._audit_zero import EngineReads
from bigbatch.integrations._hf_window import Reader, one_step, pairs, unpairs


def audit(trainer: Any, steps: int | tuple[int, ...] = 1) -> _audit.Audit:
    """Check, inside training, that a trainer's accumulated step equals its one-batch step.

    Attaches to any ``transformers.Trainer`` (bigbatch's, TRL's, your subclass): at the optimizer
    steps asked for, after the window's last backward and before clipping, it recomputes the
    window as one batch from the same weights and random state and compares the gradients
    (Note [audit] in ``bigbatch.integrations._audit``); training goes on unchanged. Costs one
    forward and backward of the window, per audited step (two with dropout on: both sides are
    compared with dropout off, the trainer's window replayed, Note [audit dropout]); a wrong step
    costs one more forward to say why (Note [audit diagnosis]). Logs one line per audited step
    (logger ``"bigbatch"``). Memory: the audited step holds the whole window as one batch, its
    activations at once (about ``gradient_accumulation_steps`` times a step's: 224 MiB against
    25 MiB in issue 30's run): audit where the window fits (a short run, or fewer rows per window).
    TRL's flattened batches (``padding_free=True``, ``packing=True``) are joined as one flattened
    row of the window's sequences, as TRL's one-batch run has them (Note [flattened batches]);
    both are exact under accumulation (SFT's loss is a token sum over ``num_items_in_batch``).
    ``padding_free`` keeps the batch (a sample is a text); ``packing`` does not (a sample is a
    row of texts packed before batching, a text longer than a row truncated under ``bfd``: a step
    holds as many texts as its rows do), which no audit of a step can see.
    Under DeepSpeed (ZeRO 1-3) it audits inside the engine's step, before its optimizer steps
    (Note [audit under DeepSpeed] in ``bigbatch.integrations._audit_zero``).

    Args:
        trainer: the trainer, before ``trainer.train()``.
        steps: the optimizer steps to audit (1 is the first), an int or a tuple of ints.

    Returns:
        An ``Audit`` whose ``.results`` gains one ``AuditResult`` (``exact``: ``None`` where the
        loss draws random numbers besides dropout and it cannot tell; ``grad_norm_ratio``,
        ``loss_ratio``, ``tolerance``, ``diagnosis``) per audited step; when
        ``train()`` ends, ``.not_reached`` holds the steps it never reached, named in a warning.

    Raises:
        TypeError: ``trainer`` is not a ``transformers.Trainer``.
        ValueError: bad ``steps``.

    Example:
        >>> report = bigbatch.hf.audit(trainer)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        >>> report.results[0].exact, report.results[0].diagnosis  # doctest: +SKIP
        (False, 'per-micro-batch mean on padded data')
    """
    if not isinstance(trainer, _frameworks.need("transformers", "hf").Trainer):
        raise TypeError(f"audit() takes a transformers.Trainer, got {type(trainer).__name__}.")
    return _Watch(trainer, _audit.Audit(_audit.check_steps(steps))).log


class _Watch:
    """``audit``'s hold on a trainer: its ``get_batch_samples``, ``_prepare_inputs`` and
    ``training_step``, wrapped on the instance (the class is untouched). The window's batches are
    recorded as the trainer prepared them (GRPO generates there), not prepared again."""

    def __init__(self, trainer: Any, log: _audit.Audit) -> None:
        self.trainer, self.log, self.reader, self.size = trainer, log, Reader(trainer), 0
        self.window: _audit.Window | None = None  # size: its batches
        self.wrapped = trainer.get_batch_samples, trainer._prepare_inputs, trainer.training_step
        trainer.get_batch_samples, trainer._prepare_inputs, trainer.training_step = (
            self.get_batch_samples,
            self.prepare_inputs,
            self.training_step,
        )
        self.train_fn, trainer.train = trainer.train, self.train
        self.seen: list[tuple[Any, Any]] = []  # bigbatch's micro-batches and their losses
        if (window := getattr(trainer, "bigbatch_window", None)) is not None:
            window.loss = functools.partial(self.record, window.loss)

    def record(self, loss: Any, *args: Any) -> Any:
        out = loss(*args)
        if self.window is not None:  # an audited window's micro-batch, its loss detached
            self.seen.append((args[-1], map_tensors(torch.Tensor.detach, out)))
        return out

    def train(self, *args: Any, **kwargs: Any) -> Any:
        out = self.train_fn(*args, **kwargs)
        _audit.finish(self.log, self.trainer.state.global_step)
        return out

    def get_batch_samples(self, iterator: Any, num_batches: int, device: Any) -> Any:
        batches, n = self.wrapped[0](iterator, num_batches, device)
        t, self.size = self.trainer, len(batches)
        step, k = t.state.global_step + 1, t.args.gradient_accumulation_steps
        self.window = _audit.start(self.log, step, k, device)
        return batches, n

    def prepare_inputs(self, inputs: Any) -> Any:
        prepared = self.wrapped[1](inputs)
        if self.window is not None:  # a copy: compute_loss may pop the labels
            kept = {**prepared} if isinstance(prepared, Mapping) else prepared
            self.window.batches.append(pairs(kept) if self.reader.paired else kept)
        return prepared

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        t, w = self.trainer, self.window
        last = w is not None and len(w.returns) == self.size - 1
        if last and getattr(t, "is_deepspeed_enabled", False):
            return self._in_engine_step(model, inputs, num_items_in_batch)
        loss = self.wrapped[2](model, inputs, num_items_in_batch)
        if w is not None:
            w.returns.append(float(loss))
            if last:
                self._check(model, num_items_in_batch)
        return loss

    def _in_engine_step(self, engine: Any, inputs: Any, num_items: Any) -> Any:
        """The window's last ``training_step`` under DeepSpeed, audited inside the engine's step,
        before its optimizer steps (Note [audit under DeepSpeed])."""
        losses: list[float] = []  # what each micro-batch gave engine.backward
        backward, step = engine.backward, engine.optimizer.step
        t, k = self.trainer, "gradient_accumulation_steps"  # bigbatch's window runs in one_step
        steps = [(t.args, k, t.args.gradient_accumulation_steps), (t, f"current_{k}", self.size)]

        def recorded(loss: Any, *args: Any, **kwargs: Any) -> Any:
            losses.append(float(loss))
            return backward(loss, *args, **kwargs)

        def audited(*args: Any, **kwargs: Any) -> Any:
            if (w := self.window) is not None:  # the Trainer's own returns the loss it gave
                w.returns.append(losses[-1])
                with _frameworks.held(steps):  # the trainer's own, for the replay
                    self._check(engine, num_items, len(losses), EngineReads(engine))
            return step(*args, **kwargs)

        with _frameworks.held(
            [(engine, "backward", recorded), (engine.optimizer, "step", audited)]
        ):
            return self.wrapped[2](engine, inputs, num_items)

    def _check(self, model: Any, num_items: Any, backwards: int = 0, reads: Any = None) -> None:
        """The window's accumulated gradients against its one-batch gradients (Note [audit])."""
        t, w = self.trainer, self.window
        assert w is not None
        self.window = None
        rows = self.reader.unflatten(w.batches)  # Note [flattened batches]
        joined = _batches.join(rows, self.reader.pad_id)  # rows of pairs if paired
        raw = [unpairs(b) if self.reader.paired else b for b in w.batches]
        self._settle(w, backwards)
        own, scope = functools.partial(self._own, model), functools.partial(one_step, t)
        once = functools.partial(self._loss, model, joined)
        replay = functools.partial(self._replay, model, w, raw, num_items)
        counters = {k: v for k, v in vars(t).items() if isinstance(v, (int, float))}
        graded = model.module if reads is not None else model  # the engine's module
        _audit.check(self.log, w, graded, once, own, reads is not None, scope, replay, reads)
        vars(t).update(counters)  # TRL's: GRPO's _step, SFT's token count

    def _settle(self, w: _audit.Window, backwards: int = 0) -> None:
        """On bigbatch's trainers the window's micro-batches and what each added to its loss
        (``backwards``: how many it back-propagated, where its result is not kept yet)."""
        if self.seen:  # its last pass's micro-batches (not a count pass's)
            n = backwards or self.trainer.bigbatch_window.last.micro_batches
            seen = self.seen[-n:]
            w.batches, w.returns = [b for b, _ in seen], _audit.shares(seen)
            w.accumulation_steps, self.seen = len(seen), []

    def _replay(self, model: Any, w: _audit.Window, raw: list[Any], num_items: Any) -> None:
        """The trainer's ``training_step`` over the window's batches again (Note [audit
        dropout]); ``w`` gets what each returned."""
        t = self.trainer  # its batches prepared already (GRPO would generate again)
        held = [(self, "window", w), (t, "_prepare_inputs", lambda inputs: inputs)]
        if (own := getattr(t, "bigbatch_window", None)) is not None:  # its step's result, ledger
            held += [(own, "last", own.last), (own, "counted", own.counted)]
            if getattr(t, "is_deepspeed_enabled", False):  # its own is inside the engine's step
                held.append((own, "acc", None))
        with _frameworks.held(held):
            w.returns = [float(self.wrapped[2](model, b, num_items)) for b in raw]
            self._settle(w)

    def _loss(self, model: Any, batch: Any) -> torch.Tensor:
        """The trainer's loss on ``batch`` as one batch (what it does with one accumulation
        step); bigbatch's reads it as its window does (Note [trainer window])."""
        t, window = self.trainer, getattr(self.trainer, "bigbatch_window", None)
        plain = unpairs(batch) if self.reader.paired else batch
        if self.reader.varlen is not None:  # one flattened row, as the trainer's batches
            plain = _batches.flatten(plain, self.reader.varlen)
        n = t._get_num_items_in_batch([plain], t.args.device)  # what the Trainer would pass
        if window is None:
            return cast(torch.Tensor, t.compute_loss(model, dict(plain), num_items_in_batch=n))
        loss_fn = window.window_loss(model, batch, n is not None)[0]
        return _audit.window_mean(loss_fn(model, batch), batch_size(batch))

    def _own(self, model: Any, batch: Any) -> tuple[float, ...]:
        r = self.reader  # the labels counted the other way too (Note [audit diagnosis])
        other = batch_size(batch) if r.paired else _batches.count_items(batch, not r.shifts)
        return float(self._loss(model, batch)), float(r.count(batch)), float(other)

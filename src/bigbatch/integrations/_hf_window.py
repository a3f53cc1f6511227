"""A transformers ``Trainer``'s window made exact: its batches kept, joined, counted, run as one.

``TrainerWindow`` is the state ``bigbatch.hf.exact`` adds to a trainer (Note [trainer window]);
``Reader`` says how a trainer's batches read (TRL's pairs, the pad id, what transformers counts),
for the window and for ``bigbatch.hf.audit``; ``loss_form`` finds what ``compute_loss`` does
with ``num_items_in_batch``, ``one_step`` runs the trainer's loss as its one-batch run would.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from bigbatch.core import _rng
from bigbatch.core._precision import Precision
from bigbatch.core._tokens import fit_columns, padded_length, right_padded
from bigbatch.core._tree import take
from bigbatch.core.cut import Cut
from bigbatch.core.engine import Accumulator
from bigbatch.core.loss import WindowLoss
from bigbatch.core.split import batch_size
from bigbatch.integrations import _batches, _frameworks

FORMS = ("sum", "mean", "own")  # what loss_form reads (None: undecided)
PAIRED = ("DPOTrainer", "RewardTrainer")
"""Trainers whose batches hold pairs as two halves (chosen rows, then rejected rows)."""


class TrainerWindow:
    """The state ``exact`` adds to a trainer: the window's batches and the ``Accumulator``, which
    cuts each window as ``cut`` says (the ``Cut`` built from ``exact``'s settings).

    Note [trainer window]
        ``Trainer`` prefetches each optimizer step's ``gradient_accumulation_steps`` batches
        (``get_batch_samples``) and calls ``training_step`` once per batch, inside ``no_sync`` for
        all but the last; ``current_gradient_accumulation_steps`` is the window's number of batches.
        ``exact(TrainerClass)`` keeps that loop and changes one thing: the first calls of a window
        keep their batch and return a zero loss without work, and the last (where the Trainer
        synchronises) joins the window's batches into one (``join``) and runs it through an
        ``Accumulator`` over the Trainer's (maybe DDP-wrapped) model: on several ranks each rank
        joins its own window and the count is every rank's. Its optimizer is the Trainer's
        parameters with a ``step`` and ``zero_grad`` that do nothing, so the normalised gradient
        stays in ``.grad`` for the Trainer's own clipping, optimizer, scheduler and logging; its
        backward is the Trainer's ``accelerator.backward`` (its loss scaler). Each micro-batch is
        trimmed back to its longest sample. The loss is the Trainer's ``compute_loss`` read as the
        loss contract wants it. What it does with ``num_items_in_batch`` is read from what it
        returns, once, before the first window (``loss_form``: its loss on two samples without
        gradient, given 1 and 2), not from the model's signature as transformers reads it (a
        ``forward`` taking ``**kwargs`` may return a mean: transformers #47688). A loss that returns
        ``sum / N`` gets the window's count as transformers counts it (``counts_shifted_labels``:
        every label where ``LOSS_MAPPING`` does not know the model's ``loss_type``: GPT-2's), as in
        the one-batch run; a loss that ignores it, or that the Trainer gives ``None``, is a mean
        over the micro-batch, multiplied back by its count: the labels that are not -100 (shifted
        for a causal LM, found also inside a wrapper), else its samples, pairs for DPO and reward
        trainers. Knowing the form before the first window, the engine gets the counts before every
        window (``count_fn``): each backward then runs at the one-batch run's scale, so a bf16 run
        rounds as the stock one does (a form still undecided, the window's first rows counting
        nothing, is a sum until read: as transformers assumes, counted as it counts). The ranks
        agree on the form (``agreed``): it decides what is all-reduced. A ``(sum, count)`` pair or
        named terms pass through, and so does a bigbatch ``loss_fn`` (``cached_loss`` included).
    """

    def __init__(self, trainer: Any, cut: Cut, loss_fn: Any) -> None:
        self.trainer, self.cut, self.loss_fn, self.reader = trainer, cut, loss_fn, Reader(trainer)
        self.pending: list[Any] = []  # the window's batches so far
        self.acc: Accumulator | None = None
        self.last: Any = None  # the last window's StepResult
        self.form: str | None = None  # how compute_loss reads num_items_in_batch (loss_form)
        self.counted = [0, 0, 0.0]  # real and computed tokens, model FLOPs, since the last log

    def training_step(self, model: Any, inputs: Any, num_items: Any) -> torch.Tensor:
        """Nothing until the window's last batch, then the whole window (Note [trainer window])."""
        t = self.trainer
        self.pending.append(inputs)
        if len(self.pending) < t.current_gradient_accumulation_steps:  # the window's batches
            return torch.zeros((), device=t.args.device)
        window, self.pending = self.pending, []
        model.train()
        batch = self.reader.join([t._prepare_inputs(b) for b in window])
        with t.compute_loss_context_manager(), one_step(t):
            loss_fn, count_fn = self.window_loss(model, batch, num_items is not None)
            self.last = self._accumulator(model).train_step(batch, loss_fn, count_fn=count_fn)
        if (ledger := self.last.ledger) is not None:  # Note [step ledger]
            step = [ledger.input_tokens, ledger.computed_tokens, ledger.model_flops]
            self.counted = [a + b for a, b in zip(self.counted, step, strict=True)]
        return torch.tensor(self.last.loss, device=t.args.device)

    def ledger_logs(self) -> dict[str, float]:
        """The step ledger since the last log, beside transformers' own numbers: real and computed
        tokens, the padding computed, the model's FLOPs (attention by each sample's own length;
        transformers' ``total_flos`` counts ``6 · numel · N``, padding in, attention out)."""
        (real, computed, flops), self.counted = self.counted, [0, 0, 0.0]
        if not computed:
            return {}
        return {
            "real_tokens": real,
            "computed_tokens": computed,
            "padding": 1 - real / computed,
            "model_flos": flops,
        }

    def _accumulator(self, model: Any) -> Accumulator:
        t = self.trainer
        if self.acc is None or self.acc.model is not model:
            if getattr(t, "is_deepspeed_enabled", False):  # Note [trainer window under DeepSpeed]
                self.acc = engine_window(model, self.cut)
                return self.acc
            # The Trainer's optimizer, its step and zero_grad left to the Trainer (which clips,
            # steps and schedules after the window); its accelerator back-propagates (its scaler).
            held: Any = SimpleNamespace(param_groups=t.optimizer.param_groups)
            held.step = held.zero_grad = lambda *args, **kwargs: None
            precision = Precision("fp32", torch.device(t.args.device).type)
            precision.backward = t.accelerator.backward  # type: ignore[method-assign]
            # nonfinite="apply": the Trainer's scaler and step decide
            self.acc = Accumulator(model, held, self.cut, precision=precision, nonfinite="apply")
        return self.acc

    def window_loss(self, model: Any, batch: Any, given: bool) -> tuple[Any, Any]:
        """The window's ``loss_fn`` and ``count_fn`` (``given``: the Trainer passes its loss a
        ``num_items_in_batch``). The loss's form is read first, once (``loss_form``): a loss that
        ignores ``num_items_in_batch`` is a mean, counted as one (Note [trainer window])."""
        if self.loss_fn is not None:  # a bigbatch loss_fn, cached_loss's window as it is
            wrapped = functools.partial(self.loss, self.loss_fn, None)
            wrapped.shifts_labels = getattr(self.loss_fn, "shifts_labels", False)  # type: ignore[attr-defined]
            return (self.loss_fn if isinstance(self.loss_fn, WindowLoss) else wrapped), None
        if self.form is None:
            rows = take(batch, slice(0, 2), batch_size(batch))  # a pair: BatchNorm takes it
            form = loss_form(self.trainer, model, self.micro(rows), given)
            self.form = agreed(form, self.trainer)
        sums = given and self.form != "mean"  # undecided: as transformers assumes
        n = self.window_count(batch) if sums else None
        counted = self.form != "own"  # the counts known before the window (undecided: sums)
        count_fn = functools.partial(self.reader.count, given=sums) if counted else None
        own = functools.partial(self.loss, None, n)
        own.shifts_labels = True  # type: ignore[attr-defined]  # the model's own loss: it shifts
        return own, count_fn

    def micro(self, batch: Any) -> Any:
        """A micro-batch as the trainer's loss takes it: pairs undone, trimmed; flattened where
        the trainer's batches are (Note [flattened batches]), unless packed already."""
        if self.reader.varlen is not None:
            return _batches.flatten(batch, self.reader.varlen)
        return trim(unpairs(batch) if self.reader.paired else batch)

    def loss(self, loss_fn: Any, num_items: Any, model: Any, micro_batch: Any) -> Any:
        """The micro-batch's loss as the loss contract reads it (Note [trainer window])."""
        t, mb = self.trainer, self.micro(micro_batch)
        if loss_fn is not None:
            return loss_fn(model, mb)
        out = t.compute_loss(model, dict(mb), num_items_in_batch=num_items)
        if not isinstance(out, torch.Tensor):
            return out
        count = self.reader.count(micro_batch, given=num_items is not None)
        # transformers' compute_loss multiplies a num_items loss by the ranks DDP averages over
        ranks = t.accelerator.num_processes if t.args.average_tokens_across_devices else 1
        return (out * count, count) if num_items is None else (out * (num_items / ranks), count)

    def window_count(self, batch: Any) -> torch.Tensor:
        """The window's ``num_items_in_batch`` as the Trainer counts it, every rank's where it
        averages tokens across them."""
        n = torch.as_tensor(self.reader.count(batch, given=True), device=self.trainer.args.device)
        if self.trainer.accelerator.num_processes > 1:
            torch.distributed.all_reduce(n)
        return n


class Reader:
    """How a trainer's batches read: paired (TRL's DPO, reward), joined, counted."""

    def __init__(self, trainer: Any) -> None:
        # the tokenizer's pad id, else the model's, else 0
        owners = getattr(trainer, "processing_class", None), getattr(trainer.model, "config", None)
        ids = (getattr(owner, "pad_token_id", None) for owner in owners)
        self.pad_id = next((i for i in ids if isinstance(i, int)), 0)
        self.paired = descends_from(type(trainer), PAIRED)
        self.shifts = shifts_labels(trainer.model)  # what a mean over a micro-batch counts
        self.given_shifts = counts_shifted_labels(trainer)  # transformers' num_items_in_batch
        self.varlen: bool | None = None  # flattened batches: with cu_seq_lens (None: not flat)

    def join(self, batches: list[Any]) -> Any:
        """The batches as one, rows of pairs for a paired trainer, rows of sequences for
        flattened batches (Note [flattened batches])."""
        rows = self.unflatten(batches)
        return _batches.join([pairs(b) for b in rows] if self.paired else rows, self.pad_id)

    def unflatten(self, batches: list[Any]) -> list[Any]:
        """Flattened batches as rows of their sequences, noting whether they had the varlen
        arguments (Note [flattened batches]); other batches as they are."""
        rows = [_batches.unflatten(b, self.pad_id) for b in batches]
        if rows[0] is not batches[0]:
            self.varlen = "cu_seq_lens_q" in batches[0]
        return rows

    def count(self, batch: Any, given: bool = False) -> Any:
        """What a mean over ``batch`` (rows of pairs if paired) averages, or (``given``) what
        transformers counts as its ``num_items_in_batch`` (the engine's ``count_fn``)."""
        shifts = self.given_shifts if given else self.shifts
        return batch_size(batch) if self.paired else _batches.count_items(batch, shifts)


def one_step(trainer: Any) -> contextlib.AbstractContextManager[None]:
    """Within the block the trainer's accumulation steps are 1, as in its one-batch run: a loss
    that divides by them (``current_gradient_accumulation_steps``, ``args``; GRPO's
    ``steps_per_generation``) sees one batch."""
    args, k = trainer.args, "gradient_accumulation_steps"
    named = [(args, k), (args, "steps_per_generation"), (trainer, "current_" + k)]
    return _frameworks.held([(owner, name, 1) for owner, name in named if hasattr(owner, name)])


def loss_form(trainer: Any, model: Any, rows: Any, given: bool) -> str | None:
    """How ``trainer.compute_loss`` reads ``num_items_in_batch``, from its loss on ``rows``
    without gradient, in eval mode, from the same random state (nothing it draws or changes
    stays): ``"sum"`` (it returns ``sum / num_items_in_batch``), ``"mean"`` (it ignores it, or is
    given none: ``given`` False), ``"own"`` (a pair or named terms, counted by themselves), ``None``
    (undecided: a zero or non-finite loss). Decided by behaviour, not by signature: a model that
    takes ``**kwargs`` may still return a mean (transformers #47688)."""
    device, outs, mode = torch.device(trainer.args.device), [], model.training
    state = _rng.capture(device)
    model.eval()  # no BatchNorm update, no count of trained tokens (TRL's num_tokens)
    try:
        for n in [1, 2] if given else [None]:
            with torch.no_grad():
                outs.append(trainer.compute_loss(model, dict(rows), num_items_in_batch=n))
            _rng.restore(state, device)
    finally:
        model.train(mode)
        _frameworks.reshard(model)
    if not isinstance(outs[0], torch.Tensor) or not given:
        return "mean" if isinstance(outs[0], torch.Tensor) else "own"
    one, two = float(outs[0]), float(outs[1])
    if not math.isfinite(one) or one == 0:
        return None
    return "sum" if abs(one - 2 * two) < abs(one - two) else "mean"


def agreed(form: str | None, trainer: Any) -> str | None:
    """The loss's form that every rank takes (one all-reduce while undecided): the form decides
    the window's collectives (``window_count``, the engine's counts), and a rank whose first rows
    count nothing decides none (``None``; transformers' ``test_loss_averaging`` data: gloo
    aborted on a mismatched collective). The form most ranks read, ``None`` if none read one."""
    if trainer.accelerator.num_processes == 1:
        return form
    votes = torch.tensor([form == f for f in FORMS], device=trainer.args.device).long()
    torch.distributed.all_reduce(votes)
    return FORMS[int(votes.argmax())] if bool(votes.any()) else None


def engine_window(engine: Any, cut: Cut) -> Accumulator:
    """The window of a trainer under DeepSpeed: an ``Accumulator`` over its engine, which
    back-propagates each micro-batch and steps once per window (Note [trainer window under
    DeepSpeed]); the engine's optimizer, scheduler, clipping and precision.

    Note [trainer window under DeepSpeed]
        Under accelerate's DeepSpeed plugin the Trainer's ``model_wrapped`` is the engine and its
        optimizer's ``step`` and ``zero_grad`` do nothing (``DeepSpeedOptimizerWrapper``): the
        stock Trainer's ``accelerator.backward`` calls ``engine.backward`` on every batch and
        ``engine.step()`` after the window's last, the engine managing the accumulation.
        ``exact`` takes the window from it: ``unmanaged`` sets ``"managed_gradient_accumulation":
        false`` in the Trainer's DeepSpeed config when it is built (a copy of the user's; a
        config that sets it otherwise is refused, not overridden), and the window's
        ``Accumulator`` is built over the engine (Note [DeepSpeed windows] in
        ``bigbatch.core._deepspeed``): each micro-batch goes to ``engine.backward(W · loss_sum /
        C, scale_wrt_gas=False)`` with the window's global count known before it, and the window
        ends in one ``engine.step()`` inside its last ``training_step``, where accelerate would
        have stepped. ``accelerator.backward`` is never called, so nothing divides or steps
        again: the Trainer's ``optimizer.step()`` is the wrapper's no-op, its ``lr_scheduler`` is
        stepped by the engine (given to ``deepspeed.initialize``) or by the Trainer once per
        window as in its own runs, its gradient norm is the engine's. The config's
        ``gradient_accumulation_steps`` is the Trainer's window (transformers fills it and checks
        it against the ``TrainingArguments``), so DeepSpeedSync's warning about it is not given.
        ``chunked_head=True`` under ZeRO 3 computes its loss inside the output layer's call
        (Note [head under ZeRO 3] in ``bigbatch.core.head``); ``audit`` audits inside the
        engine's step (Note [audit under DeepSpeed]).
    """
    with warnings.catch_warnings():  # the config's gradient_accumulation_steps: the Trainer's
        warnings.filterwarnings("ignore", "DeepSpeed's gradient_accumulation_steps")
        return Accumulator(engine, engine.optimizer, cut, nonfinite="apply")


def unmanaged(trainer: Any, what: str) -> None:
    """Set ``"managed_gradient_accumulation": false`` in the DeepSpeed config of a trainer that
    runs DeepSpeed, before its engine is made (Note [trainer window under DeepSpeed]).

    Raises:
        ValueError: the config sets it to anything else.
    """
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return
    plugin = trainer.accelerator.state.deepspeed_plugin
    managed = plugin.deepspeed_config.setdefault("managed_gradient_accumulation", False)
    if managed is not False:
        raise ValueError(
            f'{what} steps once per window: set "managed_gradient_accumulation": false in the '
            f"DeepSpeed config, or leave it out (it has {managed!r})."
        )


def descends_from(trainer_class: type, names: tuple[str, ...]) -> bool:
    """Whether ``trainer_class`` or a base of it has one of ``names`` (TRL's trainers, known by
    name: TRL is never imported)."""
    return any(c.__name__ in names for c in trainer_class.__mro__)


def pairs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A batch of ``2B`` rows (chosen, then rejected) as ``B`` rows of pairs ``[B, 2, ...]``."""
    n = batch_size(batch)
    rows = {k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() and len(v) == n}
    return {k: torch.stack(v.chunk(2), 1) if k in rows else v for k, v in batch.items()}


def unpairs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``pairs`` undone: rows of pairs back to chosen rows, then rejected rows."""
    return {k: torch.cat(v.unbind(1)) if _wide(v, 2) else v for k, v in batch.items()}


def trim(batch: Any) -> Any:
    """A right-padded micro-batch cut back to its longest sample, as the ``Accumulator`` trims
    (Note [per-token tensors] in ``bigbatch.core._tokens``); a left-padded batch stays whole."""
    if (counted := right_padded(batch)) is None or counted[1]:  # labels on the padding: whole
        return batch
    try:  # a tensor that may be per-token: the whole width is exact
        return fit_columns(batch, padded_length(batch), max(counted[0]))
    except ValueError:
        return batch


def _wide(value: Any, width: int) -> bool:
    """Whether ``value`` is a tensor of ``width`` columns (a per-token or per-pair tensor)."""
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == width


def shifts_labels(model: Any) -> bool:
    """Whether the model's loss shifts its labels (a causal LM), looking inside wrappers: the
    loss its ``loss_type`` maps to, else (a ``loss_type`` transformers does not know, whose
    ``loss_function`` defaults to ``ForCausalLMLoss``) whether it generates: GPT-2 does, a token
    tagger of one's own does not (its labels were counted shifted: 0.9% off the step)."""
    from transformers import GenerationMixin, PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    modules = model.modules() if isinstance(model, torch.nn.Module) else []
    m = next((m for m in modules if isinstance(m, PreTrainedModel)), None)
    if m is None or getattr(m.config, "is_encoder_decoder", False):
        return False
    if "_loss_function" in vars(m) or getattr(m, "loss_type", None) in LOSS_MAPPING:
        return m.loss_function is ForCausalLMLoss  # the loss it computes
    return isinstance(m, GenerationMixin)


def counts_shifted_labels(trainer: Any) -> bool:
    """Whether the trainer counts its ``num_items_in_batch`` over each row's labels but the first
    (``labels[..., 1:]``): transformers' ``Trainer._loss_shifts_labels``, set in its ``__init__``
    where ``LOSS_MAPPING`` maps the model's ``loss_type`` to ``ForCausalLMLoss`` and the model is
    not an encoder-decoder (GPT-2's ``loss_type`` is ``None``: every label counted). A
    transformers without it (before transformers#46204) counted every label: ``False``."""
    return bool(getattr(trainer, "_loss_shifts_labels", False))

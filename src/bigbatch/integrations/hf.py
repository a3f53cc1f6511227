"""transformers' ``Trainer`` (and TRL's) with bigbatch's exact accumulation, and an audit for any.

Needs transformers (``pip install "bigbatch[hf]"``)::

    from bigbatch.hf import Trainer            # a drop-in subclass of transformers.Trainer
    trainer = Trainer(model=model, args=args, train_dataset=data)    # the same arguments
    report = bigbatch.hf.audit(any_trainer)    # is its accumulation right? (Note [audit])

Note [trainer window]
    ``Trainer`` prefetches each optimizer step's ``gradient_accumulation_steps`` batches
    (``get_batch_samples``) and calls ``training_step`` once per batch, inside ``no_sync`` for
    all but the last; ``current_gradient_accumulation_steps`` is the window's number of batches.
    ``exact(TrainerClass)`` keeps that loop and changes one thing: the first calls of a window
    keep their batch and return a zero loss without work, and the last (where the Trainer
    synchronises) joins the window's batches into one (``bigbatch.integrations._batches.join``) and
    runs it through an ``Accumulator`` over the Trainer's (maybe DDP-wrapped) model: on several
    ranks each rank joins its own window and the count is every rank's. Its optimizer
    is the Trainer's parameters with a ``step`` and ``zero_grad`` that do nothing, so
    the normalised gradient stays in ``.grad`` for the Trainer's own clipping, optimizer, scheduler
    and logging; its backward is the Trainer's ``accelerator.backward`` (its loss scaler). Each
    micro-batch is trimmed back to its longest sample. The loss is the Trainer's ``compute_loss``
    read as the loss contract wants it. What it does with ``num_items_in_batch`` is read from
    what it returns, once, before the first window (``loss_form``: its loss on two samples
    without gradient, given 1 and 2), not from the model's signature as transformers reads it (a
    ``forward`` taking ``**kwargs`` may return a mean: transformers #47688). A loss that returns
    ``sum / N`` gets the window's count as transformers counts it (every label where
    ``LOSS_MAPPING`` does not know the model's ``loss_type``: GPT-2's), as in the one-batch run; a
    loss that ignores it, or that the Trainer gives ``None``, is a mean over the micro-batch,
    multiplied back by its count: the labels that are not -100 (shifted for a causal LM, found
    also inside a wrapper), else its samples, pairs for DPO and reward trainers. Knowing the form
    before the first window, the engine gets the counts before every window (``count_fn``): each
    backward then runs at the one-batch run's scale, so a bf16 run rounds as the stock one does.
    A ``(sum, count)`` pair or named terms pass through, and so does
    a bigbatch ``loss_fn`` (``cached_loss`` included).

Note [generating trainers]
    ``exact`` refuses TRL's GRPO and RLOO trainers. They generate completions for the whole
    window in the first ``training_step`` and hand out one slice per call, counted by their own
    ``training_step`` (``_step``), which ``exact`` replaces; and TRL already normalises them over
    the window: each generation batch is cut into equal micro-batches, ``loss_type="grpo"``
    (each sequence's token mean) and ``"dr_grpo"`` (a sum over a constant length) average equal
    micro-batches, and ``"dapo"`` divides by the generation batch's token count on every rank.
    ``"bnpo"`` is a token mean per micro-batch, as its name says (batch-normalised); under
    accumulation that is a mean of micro-batch means, which ``audit`` reports. Making it a token
    mean over the window would take TRL's whole loss rewritten as named terms
    (``bigbatch.losses.terms.policy_gradient`` has the three units) in an ``Accumulator`` loop.

Note [chunked head in a trainer]
    With ``chunked_head=True`` the window's loss is not ``compute_loss``: it is the causal LM's
    own loss computed without its logits. The model runs with its labels taken out and its
    output layer deferred (Note [deferred head] in ``bigbatch.core.head``); what the layer
    received goes to ``head_cross_entropy``, shifted, with ``label_smoothing_factor``: the loss
    transformers' ``ForCausalLMLoss`` and ``LabelSmoother`` compute from the logits, and TRL's
    SFT loss (``loss_type="nll"``). A logit scale (Cohere, Granite) is applied exactly. Refused
    when made, in one line naming the cause, where that would not be the trainer's loss: a
    ``loss_fn``, a ``compute_loss_func``, a ``compute_loss`` of another trainer, TRL's other
    ``loss_type``, a model that is not a causal LM, final-logit soft-capping
    (``final_logit_softcapping``), an MoE auxiliary loss added in the forward
    (``output_router_logits``). Only training changes: evaluation runs the trainer's own
    ``compute_loss``, and TRL's SFT metrics computed from the logits (entropy, token accuracy)
    are not logged in training.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any, cast

import torch

from bigbatch.core import _rng
from bigbatch.core._precision import Precision
from bigbatch.core._tokens import fit_columns, padded_length, right_padded
from bigbatch.core._tree import map_tensors, take
from bigbatch.core.cut import Cut
from bigbatch.core.engine import Accumulator
from bigbatch.core.head import HeadLogits, deferred_head, output_layer
from bigbatch.core.loss import LossFn, WindowLoss
from bigbatch.core.split import batch_size
from bigbatch.integrations import _audit, _batches, _frameworks

__all__ = ["Trainer", "audit", "exact"]

PAIRED = ("DPOTrainer", "RewardTrainer")
"""Trainers whose batches hold pairs as two halves (chosen rows, then rejected rows)."""
_transformers = _frameworks.need("transformers", "hf")
GENERATING = ("GRPOTrainer", "RLOOTrainer")
"""Trainers that generate in ``training_step``: ``exact`` refuses them (Note [generating
trainers])."""


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
        ``memory_budget``, ``pad_to_multiple_of`` and ``pad_values`` (the per-token keys beyond
        transformers', Note [per-token tensors]) as ``bigbatch.Accumulator`` does,
        ``loss_fn``: a bigbatch ``loss_fn(model, batch)`` used instead of ``compute_loss``, and
        ``chunked_head``: a causal LM's loss computed from its hidden states in chunks, never
        holding the logits (Note [chunked head in a trainer]). Building one under DeepSpeed
        raises ``ValueError`` (``refuse_deepspeed``); FSDP (FSDP2's ``fully_shard`` too) and DDP
        are exact.

    Raises:
        TypeError: ``trainer_class`` is not a ``transformers.Trainer`` subclass, or is TRL's GRPO
            or RLOO trainer (Note [generating trainers]).
        ValueError: ``chunked_head=True`` with a loss it cannot compute (Note [chunked head in a
            trainer]), when the trainer is made.

    Example:
        >>> from trl import DPOTrainer  # doctest: +SKIP
        >>> trainer = bigbatch.hf.exact(DPOTrainer)(model=model, args=args, ...)  # doctest: +SKIP
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, _transformers.Trainer)):
        raise TypeError(
            f"exact() takes a transformers.Trainer subclass, got {trainer_class!r}: e.g. "
            "bigbatch.hf.exact(trl.SFTTrainer)."
        )
    if _named(trainer_class, GENERATING):  # Note [generating trainers]
        raise TypeError(
            f"exact() does not take {trainer_class.__name__}, which generates inside "
            "training_step: use it as it is (loss_type 'grpo', 'dr_grpo', 'dapo' are exact under "
            "accumulation; 'bnpo' averages micro-batch means) and check with bigbatch.hf.audit."
        )
    if "bigbatch" in vars(trainer_class):
        return trainer_class

    class Exact(trainer_class):  # type: ignore[valid-type, misc]
        bigbatch = True

        def __init__(  # the trainer's arguments, and how bigbatch cuts its windows
            self,
            *args: Any,
            micro_batch_size: int | str | None = None,
            micro_batch_tokens: int | str | None = None,
            memory_budget: int | str | None = None,
            pad_to_multiple_of: int | None = None,
            pad_values: Mapping[str, Any] | None = None,
            loss_fn: Any = None,
            chunked_head: bool = False,
            **kwargs: Any,
        ) -> None:
            cut = Cut(  # refused early, before the trainer is built
                micro_batch_size,
                micro_batch_tokens,
                pad_to_multiple_of,
                pad_values=pad_values,
                memory_budget=memory_budget,
            )
            super().__init__(*args, **kwargs)
            refuse_deepspeed(self, f"bigbatch.hf.exact({trainer_class.__name__})")
            if chunked_head:  # Note [chunked head in a trainer]
                loss_fn = chunked_loss(self, loss_fn)
            if micro_batch_size is None and micro_batch_tokens is None:
                cut = cut.replace(micro_batch_size=self.args.per_device_train_batch_size)
            self.bigbatch_window = TrainerWindow(self, cut, loss_fn)

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            if self.optimizer is None or not hasattr(self, "current_gradient_accumulation_steps"):
                return super().training_step(model, inputs, num_items_in_batch)  # outside train()
            return self.bigbatch_window.training_step(model, inputs, num_items_in_batch)

    Exact.__name__ = Exact.__qualname__ = trainer_class.__name__
    Exact.__doc__ = f"``{trainer_class.__name__}`` with bigbatch's exact accumulation (``exact``)."
    return Exact


def chunked_loss(trainer: Any, loss_fn: Any) -> LossFn:
    """``chunked_head=True``'s loss: the causal LM's own, without its logits (Note [chunked head
    in a trainer]).

    Raises:
        ValueError: naming the setting, attribute or method the chunked head would ignore.
        TypeError: the model has no output layer (``get_output_embeddings()``).
    """
    cause = chunked_refusal(trainer, loss_fn)
    if cause is not None:
        raise ValueError(f"chunked_head=True cannot compute this trainer's loss: {cause}.")
    output_layer(trainer.model)
    smoothing = trainer.args.label_smoothing_factor
    shifted = getattr(trainer, "_loss_shifts_labels", True) or not trainer.model_accepts_loss_kwargs

    def loss(model: Any, batch: Any) -> Any:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with deferred_head(model):
            logits = model(**inputs).logits
        if not isinstance(logits, HeadLogits):
            raise TypeError(
                f"chunked_head=True: {type(trainer.model).__name__}'s logits do not "
                "come from its get_output_embeddings() layer."
            )
        loss_sum, count = logits.cross_entropy(
            batch["labels"], shift=True, label_smoothing=smoothing
        )
        # counted as transformers counts num_items_in_batch: every label where LOSS_MAPPING does
        # not know the model's loss_type (GPT-2's None), the shifted ones otherwise
        return loss_sum, (count if shifted else _batches.count_items(batch, False))

    return loss


def chunked_refusal(trainer: Any, loss_fn: Any) -> str | None:
    """Why the chunked head would not compute ``trainer``'s loss, or ``None``."""
    name, model = type(trainer).__name__, trainer.model
    sft = (
        getattr(trainer.args, "loss_type", "nll") if _named(type(trainer), ("SFTTrainer",)) else ""
    )
    if loss_fn is not None or trainer.compute_loss_func is not None:
        return "a loss_fn or compute_loss_func replaces the model's loss: give one or the other"
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in vars(c))
    if not (owner.__module__.startswith("transformers.") or sft):
        return f"{name}.compute_loss is not transformers' (nor TRL SFTTrainer's)"
    if sft not in ("", "nll"):
        return f"loss_type={sft!r} is not the token cross-entropy (loss_type='nll')"
    if not shifts_labels(model):
        return f"{type(model).__name__} is not a causal LM (its loss does not shift labels)"
    inner = next(m for m in model.modules() if isinstance(m, _transformers.PreTrainedModel))
    config = inner.config.get_text_config()
    if getattr(config, "final_logit_softcapping", None) is not None:
        return f"final_logit_softcapping={config.final_logit_softcapping} caps the logits (tanh)"
    if getattr(config, "output_router_logits", False):
        return "output_router_logits=True adds an MoE auxiliary loss in the model's forward"
    return None


class TrainerWindow:
    """The state ``exact`` adds to a trainer: the window's batches and the ``Accumulator``."""

    def __init__(self, trainer: Any, cut: Cut, loss_fn: Any) -> None:
        self.trainer, self.cut, self.loss_fn, self.reader = trainer, cut, loss_fn, Reader(trainer)
        self.pending: list[Any] = []  # the window's batches so far
        self.acc: Accumulator | None = None
        self.last: Any = None  # the last window's StepResult
        self.form: str | None = None  # how compute_loss reads num_items_in_batch (loss_form)

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
        return torch.tensor(self.last.loss, device=t.args.device)

    def _accumulator(self, model: Any) -> Accumulator:
        t = self.trainer
        if self.acc is None or self.acc.model is not model:
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
            return (self.loss_fn if isinstance(self.loss_fn, WindowLoss) else wrapped), None
        if self.form is None:
            rows = take(batch, slice(0, 2), batch_size(batch))  # a pair: BatchNorm takes it
            self.form = loss_form(self.trainer, model, self.micro(rows), given)
        sums = given and self.form != "mean"  # undecided: as transformers assumes
        n = self.window_count(batch) if sums else None
        counted = self.form in ("sum", "mean")  # the counts known before the window
        count_fn = functools.partial(self.reader.count, given=sums) if counted else None
        return functools.partial(self.loss, None, n), count_fn

    def micro(self, batch: Any) -> Any:
        """A micro-batch as the trainer's loss takes it: pairs undone, trimmed."""
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
        self.paired, self.shifts = _named(type(trainer), PAIRED), shifts_labels(trainer.model)
        # transformers' own rule for num_items_in_batch: shifted where its LOSS_MAPPING maps the
        # model's loss_type to ForCausalLMLoss (GPT-2's None: every label counted)
        self.given_shifts = bool(getattr(trainer, "_loss_shifts_labels", False))

    def join(self, batches: list[Any]) -> Any:
        """The batches as one, rows of pairs for a paired trainer."""
        return _batches.join([pairs(b) for b in batches] if self.paired else batches, self.pad_id)

    def count(self, batch: Any, given: bool = False) -> Any:
        """What a mean over ``batch`` (rows of pairs if paired) averages, or (``given``) what
        transformers counts as its ``num_items_in_batch`` (the engine's ``count_fn``)."""
        shifts = self.given_shifts if given else self.shifts
        return batch_size(batch) if self.paired else _batches.count_items(batch, shifts)


@contextlib.contextmanager
def one_step(trainer: Any) -> Iterator[None]:
    """Within the block the trainer's accumulation steps are 1, as in its one-batch run: a loss
    that divides by them (``current_gradient_accumulation_steps``, ``args``; GRPO's
    ``steps_per_generation``) sees one batch."""
    args, k = trainer.args, "gradient_accumulation_steps"
    named = [(args, k), (args, "steps_per_generation"), (trainer, "current_" + k)]
    held = [(owner, name, getattr(owner, name)) for owner, name in named if hasattr(owner, name)]
    for owner, name, _ in held:
        setattr(owner, name, 1)
    try:
        yield
    finally:
        for owner, name, value in held:
            setattr(owner, name, value)


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


def refuse_deepspeed(trainer: Any, what: str) -> None:
    """Refuse a trainer whose accelerator runs DeepSpeed (Note [trainer window]: its engine
    divides each backward by its own accumulation steps, steps inside ``training_step`` and keeps
    ZeRO's gradients out of ``.grad``, so neither bigbatch's window nor the audit can hold them).

    Raises:
        ValueError: DeepSpeed is enabled (the message says what to use instead).
    """
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError(
            f"{what} does not run under DeepSpeed: its engine divides every backward by its own "
            "gradient_accumulation_steps, steps inside training_step and keeps ZeRO's gradients "
            "out of .grad (transformers#45305, accelerate#3552). Use FSDP (fsdp=True, "
            'fsdp_config={"version": 2}) or DDP with bigbatch.hf.Trainer, or DeepSpeed with the '
            "stock transformers.Trainer."
        )


def _named(trainer_class: type, names: tuple[str, ...]) -> bool:
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
    """Whether the model's loss shifts its labels (a causal LM), looking inside wrappers."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    modules = model.modules() if isinstance(model, torch.nn.Module) else []
    m = next((m for m in modules if isinstance(m, _transformers.PreTrainedModel)), None)
    if m is None or getattr(m.config, "is_encoder_decoder", False):
        return False
    return m.loss_function is ForCausalLMLoss  # the loss it computes (GPT-2's loss_type is None)


def audit(trainer: Any, steps: int | tuple[int, ...] = 1) -> _audit.Audit:
    """Check, inside training, that a trainer's accumulated step equals its one-batch step.

    Attaches to any ``transformers.Trainer`` (bigbatch's, TRL's, your subclass): at the optimizer
    steps asked for, after the window's last backward and before clipping, it recomputes the
    window as one batch from the same weights and random state and compares the gradients
    (Note [audit] in ``bigbatch.integrations._audit``); training goes on unchanged. Costs one
    forward and backward of the window, per audited step (two with dropout on: both sides are
    compared with dropout off, the trainer's window replayed, Note [audit dropout]); a wrong step
    costs one more forward to say why (Note [audit diagnosis]). Logs one line per audited step (logger ``"bigbatch"``).
    Memory: the audited step holds the whole window as one batch, its activations at once
    (about ``gradient_accumulation_steps`` times a step's: 224 MiB against 25 MiB in issue 30's
    run): audit where the window fits (a short run, or fewer rows per window).

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
        ValueError: bad ``steps``; the trainer runs DeepSpeed (``refuse_deepspeed``).

    Example:
        >>> report = bigbatch.hf.audit(trainer)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        >>> report.results[0].exact, report.results[0].diagnosis  # doctest: +SKIP
        (False, 'per-micro-batch mean on padded data')
    """
    if not isinstance(trainer, _transformers.Trainer):
        raise TypeError(f"audit() takes a transformers.Trainer, got {type(trainer).__name__}.")
    refuse_deepspeed(trainer, "bigbatch.hf.audit()")
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
        loss, t = self.wrapped[2](model, inputs, num_items_in_batch), self.trainer
        if (w := self.window) is not None:
            w.returns.append(float(loss))
            if len(w.returns) == self.size:
                self.window = None
                joined = _batches.join(w.batches, self.reader.pad_id)  # rows of pairs if paired
                raw = [unpairs(b) if self.reader.paired else b for b in w.batches]
                self._settle(w)
                own, scope = functools.partial(self._own, model), functools.partial(one_step, t)
                once = functools.partial(self._loss, model, joined)
                replay = functools.partial(self._replay, model, w, raw, num_items_in_batch)
                counters = {k: v for k, v in vars(t).items() if isinstance(v, (int, float))}
                _audit.check(self.log, w, model, once, own, False, scope, replay)
                vars(t).update(counters)  # TRL's: GRPO's _step, SFT's token count
        return loss

    def _settle(self, w: _audit.Window) -> None:
        """On bigbatch's trainers the window's micro-batches and what each added to its loss."""
        if self.seen:  # its last pass's micro-batches (not a count pass's)
            seen = self.seen[-self.trainer.bigbatch_window.last.micro_batches :]
            w.batches, w.returns = [b for b, _ in seen], _audit.shares(seen)
            w.accumulation_steps, self.seen = len(seen), []

    def _replay(self, model: Any, w: _audit.Window, raw: list[Any], num_items: Any) -> None:
        """The trainer's ``training_step`` over the window's batches again (Note [audit
        dropout]); ``w`` gets what each returned."""
        t = self.trainer  # its batches prepared already (GRPO would generate again)
        self.window, t._prepare_inputs = w, lambda inputs: inputs
        try:
            w.returns = [float(self.wrapped[2](model, b, num_items)) for b in raw]
        finally:
            self.window, t._prepare_inputs = None, self.prepare_inputs
        self._settle(w)

    def _loss(self, model: Any, batch: Any) -> torch.Tensor:
        """The trainer's loss on ``batch`` as one batch (what it does with one accumulation
        step); bigbatch's reads it as its window does (Note [trainer window])."""
        t, window = self.trainer, getattr(self.trainer, "bigbatch_window", None)
        plain = unpairs(batch) if self.reader.paired else batch
        n = t._get_num_items_in_batch([plain], t.args.device)  # what the Trainer would pass
        if window is None:
            return cast(torch.Tensor, t.compute_loss(model, dict(plain), num_items_in_batch=n))
        loss_fn = window.window_loss(model, batch, n is not None)[0]
        return _audit.window_mean(loss_fn(model, batch), batch_size(batch))

    def _own(self, model: Any, batch: Any) -> tuple[float, float]:
        return float(self._loss(model, batch)), float(self.reader.count(batch))


Trainer: type = exact(_transformers.Trainer)

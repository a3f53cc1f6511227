"""transformers' ``Trainer`` (and TRL's) with bigbatch's exact accumulation: the drop-in.

Needs transformers (``pip install "bigbatch[hf]"``)::

    from bigbatch.hf import Trainer            # a drop-in subclass of transformers.Trainer
    trainer = Trainer(model=model, args=args, train_dataset=data)    # the same arguments
    trainer = bigbatch.hf.exact(trl.SFTTrainer)(model=model, args=args, ...)   # any Trainer class

``exact(TrainerClass)`` puts ``Exact`` (bigbatch's settings and ``training_step``) in front of the
class; the window it runs is ``bigbatch.integrations._hf_window.TrainerWindow`` (Note [trainer
window]); ``chunked_head=True`` computes a causal LM's loss without its logits. The audit of any
trainer, ``bigbatch.hf.audit``, is in ``bigbatch.integrations._hf_audit``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from bigbatch.core.cut import Cut
from bigbatch.core.head import HeadLogits, deferred_head, output_layer
from bigbatch.core.loss import LossFn, accepts
from bigbatch.integrations import _batches, _frameworks, _hf_window

__all__ = ["Exact", "Trainer", "exact"]

_transformers = _frameworks.need("transformers", "hf")
GENERATING = ("GRPOTrainer", "RLOOTrainer")
"""Trainers that generate in ``training_step``: ``exact`` refuses them.

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
"""


def exact(trainer_class: type) -> type:
    """A subclass of ``trainer_class`` whose gradient accumulation is bigbatch's.

    Each optimizer step equals the same trainer's step on the window's batches joined into one
    (Note [trainer window]): on padded variable-length text, for a model whose loss takes no
    ``num_items_in_batch``, with label smoothing, ``compute_loss_func``, a custom ``compute_loss``
    returning a mean, ``(loss_sum, count)`` or named terms ``{name: (sum, count[, weight])}``.
    TRL's DPO and reward trainers are normalised per pair, SFT per token; TRL's flattened batches
    (``padding_free=True``, ``packing=True``) are cut by their sequences (Note [flattened batches]).

    Args:
        trainer_class: ``transformers.Trainer`` or a subclass (TRL's ``SFTTrainer``, ...).

    Returns:
        The subclass. Besides the trainer's own arguments it takes ``micro_batch_size`` (rows per
        micro-batch, ``"auto"`` for the largest that fits; default
        ``per_device_train_batch_size``), ``micro_batch_tokens`` (cut by tokens, or ``"auto"``),
        ``memory_budget``, ``pad_to_multiple_of``, ``pad_values`` (the per-token keys beyond
        transformers', Note [per-token tensors]) and ``pack`` (each window's samples packed into
        rows of this many tokens: Note [packed windows]) as ``bigbatch.Accumulator`` does,
        ``loss_fn``: a bigbatch ``loss_fn(model, batch)`` used instead of ``compute_loss``, and
        ``chunked_head``: a causal LM's loss computed from its hidden states in chunks, never
        holding the logits (Note [chunked head in a trainer]). DDP, FSDP (FSDP2's
        ``fully_shard`` too) and DeepSpeed ZeRO 1-3 are exact (Note [trainer window under
        DeepSpeed]).

    Raises:
        TypeError: ``trainer_class`` is not a ``transformers.Trainer`` subclass, or is TRL's GRPO
            or RLOO trainer (Note [generating trainers]).
        ValueError: ``chunked_head=True`` with a loss it cannot compute (Note [chunked head in a
            trainer]), ``pack`` with ``use_cache=True``, a DeepSpeed config
            with ``"managed_gradient_accumulation": true``, when the trainer is made.

    Example:
        >>> from trl import DPOTrainer  # doctest: +SKIP
        >>> trainer = bigbatch.hf.exact(DPOTrainer)(model=model, args=args, ...)  # doctest: +SKIP
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, _transformers.Trainer)):
        raise TypeError(
            f"exact() takes a transformers.Trainer subclass, got {trainer_class!r}: e.g. "
            "bigbatch.hf.exact(trl.SFTTrainer)."
        )
    if _hf_window.descends_from(trainer_class, GENERATING):  # Note [generating trainers]
        raise TypeError(
            f"exact() does not take {trainer_class.__name__}, which generates inside "
            "training_step: use it as it is (loss_type 'grpo', 'dr_grpo', 'dapo' are exact under "
            "accumulation; 'bnpo' averages micro-batch means) and check with bigbatch.hf.audit."
        )
    if "bigbatch" in vars(trainer_class):
        return trainer_class
    # Exact first, so that its super() is the trainer class (a subclass of one has it already)
    bases = (trainer_class,) if issubclass(trainer_class, Exact) else (Exact, trainer_class)
    doc = f"``{trainer_class.__name__}`` with bigbatch's exact accumulation (``exact``)."
    return type(trainer_class.__name__, bases, {"bigbatch": True, "__doc__": doc})


class Exact(_transformers.Trainer):  # type: ignore[name-defined]  # a module, imported by need()
    """What ``exact`` puts in front of a trainer class: its ``__init__`` takes bigbatch's
    settings besides the trainer's (``exact`` lists them) and builds the ``TrainerWindow``; its
    ``training_step`` hands each batch to the window (Note [trainer window])."""

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
        pack: int | None = None,
        **kwargs: Any,
    ) -> None:
        check_loss(loss_fn, chunked_head)
        cut = Cut(  # refused early, before the trainer is built
            micro_batch_size,
            micro_batch_tokens,
            pad_to_multiple_of,
            pad_values=pad_values,
            memory_budget=memory_budget,
            pack=pack,
        )
        super().__init__(*args, **kwargs)
        if pack is not None and self.args.use_cache:  # Note [packing traps]
            raise ValueError(
                "use_cache=True with pack: a cache lets packed samples attend each "
                "other; use TrainingArguments(use_cache=False), its default."
            )
        # named for the class exact() made (the first, if exact() was given one of its subclasses)
        made = next((c for c in reversed(type(self).__mro__) if "bigbatch" in vars(c)), Exact)
        _hf_window.unmanaged(self, f"bigbatch.hf.exact({made.__name__})")
        if chunked_head:  # Note [chunked head in a trainer]
            loss_fn = chunked_loss(self, loss_fn)
        if micro_batch_size is None and micro_batch_tokens is None:
            cut = dataclasses.replace(cut, micro_batch_size=self.args.per_device_train_batch_size)
        self.bigbatch_window = _hf_window.TrainerWindow(self, cut, loss_fn)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """transformers' log, a training log with bigbatch's step ledger beside its numbers."""
        if "loss" in logs:  # (not evaluation's)
            logs.update(self.bigbatch_window.ledger_logs())
        super().log(logs, *args, **kwargs)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        if self.optimizer is None or not hasattr(self, "current_gradient_accumulation_steps"):
            return super().training_step(model, inputs, num_items_in_batch)  # outside train()
        return self.bigbatch_window.training_step(model, inputs, num_items_in_batch)


def check_loss(loss_fn: Any, chunked_head: Any) -> None:
    """Refuse, before the trainer is built, a ``loss_fn`` that is not a function of ``(model,
    batch)`` and a ``chunked_head`` that is not a bool (``"no"`` turned it on).

    Raises:
        TypeError: naming the argument and the value given.
    """
    if not isinstance(chunked_head, bool):
        raise TypeError(f"chunked_head={chunked_head!r} is not allowed: use True or False.")
    if loss_fn is not None and not (callable(loss_fn) and accepts(loss_fn, 2)):
        raise TypeError(
            f"loss_fn={loss_fn!r} is not allowed: use a function loss_fn(model, batch) "
            "returning a mean, (loss_sum, count) or named terms."
        )


def chunked_loss(trainer: Any, loss_fn: Any) -> LossFn:
    """``chunked_head=True``'s loss: the causal LM's own, without its logits (``head_loss``).

    Note [chunked head in a trainer]
        With ``chunked_head=True`` the window's loss is not ``compute_loss``: it is the causal LM's
        own loss computed without its logits. The model runs with its labels taken out and its
        output layer deferred (Note [deferred head] in ``bigbatch.core.head``); what the layer
        received goes to ``head_cross_entropy``, shifted, with ``label_smoothing_factor``: the loss
        transformers' ``ForCausalLMLoss`` and ``LabelSmoother`` compute from the logits, and TRL's
        SFT loss (``loss_type="nll"``). A logit scale (Cohere, Granite) and final-logit
        soft-capping (Gemma 2's ``final_logit_softcapping``) are computed exactly. Refused when
        made, in one line naming the cause, where that would not be the trainer's loss: a
        ``loss_fn``, a ``compute_loss_func``, a ``compute_loss`` of another trainer, TRL's other
        ``loss_type``, a model that is not a causal LM, an MoE auxiliary loss added in the forward
        (``output_router_logits``). The labels are read under ``labels``, as the Trainer's own
        loss reads them in training (``label_names`` names them for evaluation), refused in one
        line where a batch has none. Only training changes: evaluation runs the trainer's own
        ``compute_loss``, and TRL's SFT metrics computed from the logits (entropy, token accuracy)
        are not logged in training.

    Raises:
        ValueError: naming the setting, attribute or method the chunked head would ignore.
        TypeError: the model has no output layer (``get_output_embeddings()``).
    """
    cause = chunked_refusal(trainer, loss_fn)
    if cause is not None:
        raise ValueError(f"chunked_head=True cannot compute this trainer's loss: {cause}.")
    output_layer(trainer.model)
    smoothing = trainer.args.label_smoothing_factor
    # counted as transformers counts num_items_in_batch where the model takes it, else shifted
    shifted = _hf_window.counts_shifted_labels(trainer) or not trainer.model_accepts_loss_kwargs
    loss = functools.partial(head_loss, trainer, smoothing, shifted)
    loss.shifts_labels = True  # type: ignore[attr-defined]  # (counted as transformers counts)
    return loss


def head_loss(trainer: Any, smoothing: float, shifted: bool, model: Any, batch: Any) -> Any:
    """The causal LM's ``(loss_sum, count)`` on ``batch`` from what its output layer received,
    never its logits (Note [chunked head in a trainer]): counted over the ``shifted`` labels, or
    over every label as transformers counts a model whose ``loss_type`` it does not know."""
    if "labels" not in batch:  # the key transformers' training reads (label_names: evaluation's)
        keys, names = ", ".join(map(str, batch)), trainer.args.label_names
        names = f" (label_names={names!r} is read in evaluation only)" if names else ""
        raise ValueError(
            f"chunked_head=True: the batch has no 'labels' (its keys: {keys}), which the causal "
            f"LM's loss reads in training, as transformers' Trainer does{names}: put the labels "
            "under 'labels'."
        )
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with deferred_head(model):
        logits = model(**inputs).logits
    if not isinstance(logits, HeadLogits):
        raise TypeError(
            f"chunked_head=True: {type(trainer.model).__name__}'s logits do not "
            "come from its get_output_embeddings() layer."
        )
    loss_sum, count = logits.cross_entropy(batch["labels"], shift=True, label_smoothing=smoothing)
    return loss_sum, (count if shifted else _batches.count_items(batch, False))


def chunked_refusal(trainer: Any, loss_fn: Any) -> str | None:
    """Why the chunked head would not compute ``trainer``'s loss, or ``None``."""
    name, model = type(trainer).__name__, trainer.model
    sft = _hf_window.descends_from(type(trainer), ("SFTTrainer",))
    loss_type = getattr(trainer.args, "loss_type", "nll") if sft else ""
    if loss_fn is not None or trainer.compute_loss_func is not None:
        return "a loss_fn or compute_loss_func replaces the model's loss: give one or the other"
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in vars(c))
    if not (owner.__module__.startswith("transformers.") or loss_type):
        return f"{name}.compute_loss is not transformers' (nor TRL SFTTrainer's)"
    if loss_type not in ("", "nll"):
        return f"loss_type={loss_type!r} is not the token cross-entropy (loss_type='nll')"
    if not _hf_window.shifts_labels(model):
        return f"{type(model).__name__} is not a causal LM (its loss does not shift labels)"
    inner = next(m for m in model.modules() if isinstance(m, _transformers.PreTrainedModel))
    if getattr(inner.config.get_text_config(), "output_router_logits", False):
        return "output_router_logits=True adds an MoE auxiliary loss in the model's forward"
    return None


Trainer: type = exact(_transformers.Trainer)

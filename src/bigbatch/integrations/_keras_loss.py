"""A Keras model's loss as named terms for the engine (used by ``bigbatch.keras``).

Note [keras loss terms]
    Keras reduces each compiled loss term k to ``v_k = S_k / D_k``: the weighted sum of its
    per-item losses over the batch divided by a divisor that its ``reduction`` chooses: the
    number of items (``"sum_over_batch_size"``, ``"mean"``; the number of *unmasked* items when
    ``y_pred`` or the loss's values carry a Keras mask), the sum of the sample weights
    (``"mean_with_sample_weight"``), or 1 (``"sum"``). The full-batch loss is
    ``L = Σ_k w_k S_k / D_k + R``, ``w_k`` its ``loss_weights`` and ``R`` the model's own losses
    (weight and activity regularisers, ``add_loss``, a ``compute_loss`` of the user's), which
    Keras keeps as per-sample means or constants.

    Micro-batch ``i`` (``n_i`` of the window's ``N`` samples) gives the engine named terms (Note
    [named terms] in ``bigbatch.core.loss``), which it totals over the window before dividing:

    * a term whose divisor grows with the samples (no mask, and no ``"mean_with_sample_weight"``
      with sample weights: ``D_{k,i} = q_k n_i``, ``q_k`` the items per sample, the same in every
      micro-batch cut from one batch) stays in Keras' total ``T_i``, and so does a ``"sum"``
      term, multiplied by ``N / n_i``. ``T_i`` (with ``R_i``) is the per-sample term
      ``"loss": (T_i n_i, n_i)``: ``Σ_i T_i n_i / N = Σ_k w_k S_k / D_k + R``;
    * a term whose divisor depends on the data (a mask, or sample weights it divides by) is a
      term of its own, ``(v_{k,i} D_{k,i}, D_{k,i}, w_k)``, and adds 0 to ``T_i``.

    One term needs nothing before the window. A data-dependent divisor beside other terms needs
    its total before the first backward, which the engine counts in a pass without gradients
    (``bigbatch.keras`` puts back what that pass's forwards move). ``D_{k,i}`` is counted by
    Keras' own code: the term is reduced again, without gradients, with every per-item loss
    replaced by 1 and the reduction set to ``"sum"`` (``divisor``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from bigbatch.core.loss import Term

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


@dataclass
class Recording:
    """One micro-batch's compiled terms, as seen while Keras computes its loss.

    Attributes:
        samples: ``n_i``, samples in the micro-batch.
        window_samples: ``N``, samples in the window.
        data: the terms whose divisor depends on the data, by their index in the compiled loss.
        folded: how many compiled terms stayed in Keras' total.
    """

    samples: int
    window_samples: int
    data: dict[int, Term] = field(default_factory=dict)
    folded: int = 0


class _Term:
    """Stands in for one compiled loss term while a micro-batch's loss is computed."""

    def __init__(self, loss: Any, index: int, weight: float | None, record: Recording) -> None:
        self.loss, self.index, self.record = loss, index, record
        self.weight = 1.0 if weight is None else float(weight)

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        seen: list[Any] = []
        real_call = self.loss.call

        def recording_call(y_t: Any, y_p: Any) -> Any:
            seen.append(real_call(y_t, y_p))
            return seen[-1]

        with _calling(self.loss, recording_call):
            value = self.loss(y_true, y_pred, sample_weight)
        if len(seen) != 1:
            raise TypeError(
                f"loss {getattr(self.loss, 'name', self.loss)!r} ({type(self.loss).__name__}) did "
                "not compute its per-item losses through Loss.call, so bigbatch.keras cannot tell "
                "what Keras divides them by: implement call(y_true, y_pred) instead of __call__."
            )
        record, kind = self.record, _kind(self.loss, seen[0], y_pred, sample_weight)
        if kind == "data":
            d = divisor(self.loss, seen[0], y_true, y_pred, sample_weight)
            record.data[self.index] = Term(value * d, d, self.weight)
            return value * 0.0
        record.folded += 1
        return value * (record.window_samples / record.samples) if kind == "sum" else value

    def __getattr__(self, name: str) -> Any:  # name, reduction, ... as the loss it stands for
        return getattr(self.loss, name)


def _kind(loss: Any, values: Any, y_pred: Any, sample_weight: Any) -> str:
    """``"sum"``, ``"sample"`` (divisor proportional to the samples) or ``"data"``."""
    reduction = getattr(loss, "reduction", None)
    if reduction == "sum":
        return "sum"
    if reduction not in MEAN_REDUCTIONS:
        raise ValueError(
            f"loss {getattr(loss, 'name', loss)!r} has reduction={reduction!r}; fit needs a "
            'scalar loss: compile with reduction="sum_over_batch_size" (the default), "mean", '
            '"mean_with_sample_weight" or "sum".'
        )
    masked = _mask(y_pred) is not None or _mask(values) is not None
    weighted = reduction == "mean_with_sample_weight" and sample_weight is not None
    return "data" if masked or weighted else "sample"


def divisor(loss: Any, values: Any, y_true: Any, y_pred: Any, sample_weight: Any) -> torch.Tensor:
    """What Keras divided ``loss``'s weighted sum by, as a float64 0-dim tensor (no host sync).

    ``values`` are the per-item losses that ``loss.call`` returned for this batch. Keras' own
    ``loss.__call__`` runs again with them replaced by ones and ``reduction="sum"``, without
    gradients: it applies the same masks (``y_pred``'s and the values' own) and, for
    ``"mean_with_sample_weight"``, the same sample weights, and so counts its divisor. ``y_pred``
    is passed as a one-element stand-in carrying its mask (no copy of the logits is made).
    """
    ones, stand_in = torch.ones_like(values), values.new_zeros(1)
    for source, target in ((values, ones), (y_pred, stand_in)):  # a loss may mask its own values
        if _mask(source) is not None:
            target._keras_mask = _mask(source)  # type: ignore[union-attr]
    weight = sample_weight if loss.reduction == "mean_with_sample_weight" else None
    if isinstance(weight, torch.Tensor):  # Keras multiplies the mask into it in place
        weight = weight.clone()
    with _calling(loss, lambda y_t, y_p: ones, "sum"), torch.no_grad():
        return torch.as_tensor(loss(y_true, stand_in, weight)).to(torch.float64)


def _mask(tensor: Any) -> Any:
    return getattr(tensor, "_keras_mask", None)  # where Keras keeps a tensor's mask on torch


@contextlib.contextmanager
def _calling(loss: Any, call: Any, reduction: Any = None) -> Iterator[None]:
    """``loss.call`` (and ``loss.reduction`` when given) replaced on the instance for the block."""
    own_call, own_reduction = vars(loss).get("call"), loss.reduction
    loss.call, loss.reduction = call, reduction or own_reduction
    try:
        yield
    finally:
        loss.reduction = own_reduction
        if own_call is None:
            del loss.call
        else:
            loss.call = own_call


@contextlib.contextmanager
def recording(model: Any, record: Recording, y: Any, y_pred: Any, weight: Any) -> Iterator[None]:
    """Within the block the model's compiled loss fills ``record`` (Note [keras loss terms]).

    The compiled loss is built first if it is not (Keras builds it on its first call), without
    recording anything; a model compiled without a loss is left as it is.
    """
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None:
        yield
        return
    if not compiled.built:
        with torch.no_grad():
            compiled(y, y_pred, weight)
        for metric in compiled.metrics:  # per-output loss trackers created just now by build
            metric.reset_state()
    entries = getattr(compiled, "_flat_losses", None)
    if entries is None:
        raise RuntimeError(
            "bigbatch.keras found no model._compile_loss._flat_losses: this Keras version is "
            'not supported; pip install "bigbatch[keras]" for a tested one.'
        )
    original = list(entries)
    entries[:] = [
        e._replace(loss=_Term(e.loss, k, e.loss_weights, record)) for k, e in enumerate(original)
    ]
    try:
        yield
    finally:
        entries[:] = original


def add_to_trackers(model: Any, values: dict[int, float], samples: int) -> None:
    """Give the per-output loss trackers their data-dependent terms' window values.

    Keras updated them on every micro-batch with what each term returned, weighted by its
    samples: right for the terms left in its total, 0 for the data-dependent ones, whose value
    ``Σ S / Σ D`` is known only after the window (Note [keras loss terms]).
    """
    trackers = model._compile_loss.metrics  # one per compiled term when there are several
    for k, value in values.items():
        if len(trackers) > k:
            trackers[k].total.assign_add(value * samples)

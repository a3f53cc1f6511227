"""Each micro-batch's share of a Keras model's full-batch loss (used by ``bigbatch.keras``).

Note [keras loss shares]
    Keras reduces each compiled loss term k to ``S_k / D_k``: the weighted sum of its per-item
    losses over the batch divided by a divisor that its ``reduction`` chooses: the number of
    items (``"sum_over_batch_size"``, ``"mean"``; the number of *unmasked* items when ``y_pred``
    carries a Keras mask), the sum of the sample weights (``"mean_with_sample_weight"``), or 1
    (``"sum"``). The full-batch loss is ``L = Σ_k w_k S_k / D_k + R``, ``R`` the model's own
    losses (weight and activity regularisers, ``add_loss``), which Keras keeps as per-sample
    means or constants.

    A micro-batch ``i`` holding ``n_i`` of the window's ``N`` samples back-propagates its share

        ℓ_i = Σ_k w_k S_{k,i} / D_k + (n_i / N) R_i,        Σ_i ℓ_i = L,

    so the gradients the micro-batches leave in ``.grad`` add up to the full-batch gradient and
    nothing is divided afterwards. Keras itself computes the micro-batch's loss, with its own
    masking, sample weighting and reduction, as ``L_{k,i} = S_{k,i} / D_{k,i}``; bigbatch
    multiplies term k by ``g_{k,i} = N D_{k,i} / (n_i D_k)`` (``N / n_i`` for ``"sum"``) and
    the whole loss by ``n_i / N``. ``D_{k,i}`` is measured by Keras' own code: the term is
    reduced once more, without gradients, with every per-item loss replaced by 1 and the
    reduction set to ``"sum"`` (see ``divisor``).

    The window's divisor ``D_k`` is only known after the last micro-batch. It is predicted from
    the first one (``D_{k,1} N / n_1``, right whenever the divisor grows with the samples: no
    mask, no ``"mean_with_sample_weight"``) and checked at the end (``Divisors.missed``). When
    the prediction was wrong, a window with one loss term and nothing else in the loss is fixed
    by scaling the gradient by ``predicted / measured``; any other window is redone with the
    divisors it measured, which makes the redo exact by construction.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


@dataclass
class Divisors:
    """The window's divisor bookkeeping (Note [keras loss shares]).

    Attributes:
        samples: ``N``, samples in the window.
        known: the exact ``D_k`` per term (a redone window); ``None`` to predict them.
        predicted: ``D_k`` as predicted from each term's first micro-batch.
        seen: ``Σ_i D_{k,i}`` measured so far.
        micro_samples: ``n_i``, samples in the micro-batch being computed.
    """

    samples: int
    known: dict[int, float] | None = None
    predicted: dict[int, float] = field(default_factory=dict)
    seen: dict[int, float] = field(default_factory=dict)
    micro_samples: int = 0

    def factor(self, term: int, divisor: float | None) -> float:
        """``g_{k,i}`` for term ``term`` whose micro-batch divisor is ``divisor`` (None: "sum")."""
        if divisor is None:
            return self.samples / self.micro_samples
        self.seen[term] = self.seen.get(term, 0.0) + divisor
        if self.known is not None:
            total = self.known[term]
        else:
            total = self.predicted.setdefault(term, divisor * self.samples / self.micro_samples)
        return self.samples * divisor / (self.micro_samples * total) if total > 0 else 0.0

    def missed(self) -> dict[int, tuple[float, float]]:
        """``{term: (predicted, measured)}`` for every term whose prediction was wrong."""
        used = self.known if self.known is not None else self.predicted
        return {
            k: (used[k], seen)
            for k, seen in self.seen.items()
            if not math.isclose(used[k], seen, rel_tol=1e-12, abs_tol=0.0)
        }


class _Term:
    """Stands in for one compiled loss term while a bigbatch step runs: Keras' value times g."""

    def __init__(self, loss: Any, index: int, divisors: Divisors) -> None:
        self.loss, self.index, self.divisors = loss, index, divisors

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        seen: list[Any] = []

        def recording(y_t: Any, y_p: Any) -> Any:
            values = real_call(y_t, y_p)
            seen.append(values)
            return values

        real_call = self.loss.call
        with _calling(self.loss, recording, self.loss.reduction):
            value = self.loss(y_true, y_pred, sample_weight)
        if len(seen) != 1:
            raise TypeError(
                f"loss {getattr(self.loss, 'name', self.loss)!r} ({type(self.loss).__name__}) did "
                "not compute its per-item losses through Loss.call, so bigbatch.keras cannot tell "
                "what Keras divides them by: implement call(y_true, y_pred) instead of __call__."
            )
        d = divisor(self.loss, seen[0], y_true, y_pred, sample_weight)
        g = self.divisors.factor(self.index, d)
        return value if g == 1.0 else value * g

    def __getattr__(self, name: str) -> Any:  # name, reduction, ... as the loss it stands for
        return getattr(self.loss, name)


def divisor(
    loss: Any, values: Any, y_true: Any, y_pred: Any, sample_weight: Any = None
) -> float | None:
    """What Keras divided ``loss``'s weighted sum by; ``None`` for ``"sum"``.

    ``values`` are the per-item losses that ``loss.call`` returned for this batch. Keras' own
    ``loss.__call__`` runs again with them replaced by ones and ``reduction="sum"``, without
    gradients: it applies the same masks (``y_pred``'s and the values' own) and, for
    ``"mean_with_sample_weight"``, the same sample weights, and so counts its divisor. ``y_pred``
    is passed as a one-element stand-in carrying its mask (no copy of the logits is made).

    Raises:
        ValueError: the loss is not reduced to a scalar (``reduction=None`` or ``"none"``).
    """
    reduction = getattr(loss, "reduction", None)
    if reduction == "sum":
        return None
    if reduction not in MEAN_REDUCTIONS:
        raise ValueError(
            f"loss {getattr(loss, 'name', loss)!r} has reduction={reduction!r}; fit needs a "
            'scalar loss: compile with reduction="sum_over_batch_size" (the default), "mean", '
            '"mean_with_sample_weight" or "sum".'
        )
    ones = torch.ones(values.shape, dtype=values.dtype, device=values.device)
    _carry_mask(values, ones)  # a loss may mask its own values
    stand_in = torch.zeros(1, dtype=values.dtype, device=values.device)
    _carry_mask(y_pred, stand_in)
    weight = sample_weight if reduction == "mean_with_sample_weight" else None
    if isinstance(weight, torch.Tensor):  # Keras multiplies the mask into it in place
        weight = weight.clone()
    with _calling(loss, lambda y_t, y_p: ones, "sum"), torch.no_grad():
        return float(loss(y_true, stand_in, weight))


def _carry_mask(source: Any, target: torch.Tensor) -> None:
    mask = getattr(source, "_keras_mask", None)  # where Keras keeps a tensor's mask on torch
    if mask is not None:
        target._keras_mask = mask  # type: ignore[attr-defined]


@contextlib.contextmanager
def _calling(loss: Any, call: Any, reduction: Any) -> Iterator[None]:
    """``loss.call`` and ``loss.reduction`` replaced on the instance for the block."""
    own_call, own_reduction = vars(loss).get("call"), loss.reduction
    loss.call, loss.reduction = call, reduction
    try:
        yield
    finally:
        loss.reduction = own_reduction
        if own_call is None:
            del loss.call
        else:
            loss.call = own_call


@contextlib.contextmanager
def shares(model: Any, divisors: Divisors) -> Iterator[int]:
    """Within the context the model's compiled loss computes shares; yields the term count.

    The compiled loss must be built (``ensure_built``). A model compiled without a loss (its
    own ``compute_loss``) yields 0 and is left as it is.
    """
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None:
        yield 0
        return
    entries = getattr(compiled, "_flat_losses", None)
    if entries is None:
        raise RuntimeError(
            "bigbatch.keras could not find the compiled loss's terms (model._compile_loss."
            "_flat_losses); this Keras version is not supported: pip install "
            '"bigbatch[keras]" for a tested one.'
        )
    original = list(entries)
    entries[:] = [e._replace(loss=_Term(e.loss, k, divisors)) for k, e in enumerate(original)]
    try:
        yield len(original)
    finally:
        entries[:] = original


def ensure_built(model: Any, y: Any, y_pred: Any, sample_weight: Any) -> None:
    """Build the compiled loss (Keras builds it on its first call) without recording anything."""
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None or compiled.built:
        return
    with torch.no_grad():
        compiled(y, y_pred, sample_weight)
    for metric in compiled.metrics:  # per-output loss trackers created just now by build
        metric.reset_state()

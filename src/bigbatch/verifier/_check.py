"""``check(model, batch, loss_fn)``: is accumulation exact for *this* model and loss?

On float64 deep copies (the user's model, its running statistics and the global RNG are left
as they were), with the same seed for both runs and dropout off (Note [dropout in check]), it
computes the full-batch gradient of the mean loss and the gradient that
``Accumulator.train_step`` really accumulates (Σ loss_sum / Σ count), and compares them per
parameter, within the rounding of the precision the copy really computes in (Note [float32
islands] in ``_probes``). When they differ it diagnoses why: non-finite inputs, weights, outputs
or losses; modules whose output for one sample depends on the other samples (found by replaying
every module, not by class name: Note [replay without caches]); a loss that returns a mean as if
it were a ``(loss_sum, count)`` pair (a mean over samples or over tokens); a batch-coupled loss
(in-batch negatives); a named term normalised inside the micro-batch, or one that depends on
a statistic of its micro-batch where a statistics pass (``stats_fn``) is needed (each named term
is compared alone: ``CheckReport.term_differences``); or non-determinism. When blocks of the
model are checkpointed (``enable_checkpointing``) it also checks that the gradient is the same
without.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from bigbatch.core._tree import map_tensors
from bigbatch.core.batchnorm import label
from bigbatch.core.loss import LossFn
from bigbatch.core.split import Batch, batch_size
from bigbatch.memory.checkpointing import checkpointed_blocks
from bigbatch.verifier import _runs
from bigbatch.verifier._diagnoses import Diagnosis, checkpointing, diagnose, nonfinite
from bigbatch.verifier._probes import LOSS_FN, ROUNDING


@dataclass
class CheckReport:
    """The result of ``check``.

    Attributes:
        exact: every parameter's relative difference is within ``tolerance``.
        differences: per parameter, ``‖g_acc − g_full‖ / ‖g_full‖`` (see ``differences``);
            NaN when a gradient is not finite.
        batch_size, micro_batch_size: the batch compared and how it was cut.
        tolerance: the relative difference counted as rounding: the ``tolerance`` asked for,
            raised to the rounding of ``compute_dtype`` when that is below float64.
        diagnoses: why it is not exact (empty when exact).
        compute_dtype: the lowest precision the float64 copy really computed in: float64, or
            float32 (or a half type) where the model or loss casts down (Note [float32 islands]).
        low_precision_in: where it computed in ``compute_dtype`` (modules, or ``loss_fn``);
            empty when that is float64.
        dropout_off: the modules whose dropout ``check`` turned off (Note [dropout in check]);
            with dropout on, the accumulated gradient is equal to the full batch's in
            distribution, not in value.
        term_differences: when not exact and ``loss_fn`` returns named terms, per term the
            largest relative difference of the gradient accumulated from that term alone.
    """

    exact: bool
    differences: dict[str, float]
    batch_size: int
    micro_batch_size: int
    tolerance: float
    diagnoses: list[Diagnosis] = field(default_factory=list)
    compute_dtype: torch.dtype = torch.float64
    low_precision_in: tuple[str, ...] = ()
    dropout_off: tuple[str, ...] = ()
    term_differences: dict[str, float] = field(default_factory=dict)

    @property
    def max_difference(self) -> float:
        """The largest per-parameter relative difference (NaN if any is NaN)."""
        return max(self.differences.values(), key=_nan_largest, default=0.0)

    def worst(self, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` parameters with the largest relative difference, largest (or NaN) first."""
        return sorted(self.differences.items(), key=lambda kv: -_nan_largest(kv[1]))[:k]

    def summary(self) -> str:
        """One paragraph: the verdict, the precision it holds to, dropout, each diagnosis."""
        verdict = "exact" if self.exact else "NOT exact"
        if self.dropout_off:
            verdict += " (dropout off)" + ("; with dropout on, equal in distribution" * self.exact)
        dtype = str(self.compute_dtype).removeprefix("torch.")
        notes = [  # (shown, line)
            (self.dropout_off, f"dropout off in {_by_class(self.dropout_off)} (dropout_off names "
             "them): micro-batches draw other masks, from the same distribution"),
            (dtype != "float64", f"tolerance {self.tolerance:.0e}: the float64 copy computes "
             f"partly in {dtype} (in {_by_class(self.low_precision_in)}: low_precision_in names "
             f"them), so differences up to {dtype} rounding are not counted"),
            *((True, f"{d.kind}: {d.message}") for d in self.diagnoses),
        ]  # fmt: skip
        head = f"{verdict}: max relative difference {self.max_difference:.2e} (batch "
        head += f"{self.batch_size}, micro-batches of {self.micro_batch_size})"
        return "\n".join([head, *(f"- {line}" for shown, line in notes if shown)])


def _nan_largest(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _by_class(labels: tuple[str, ...]) -> str:
    """``'a.norm' (RMSNorm)``, ``'b.norm' (RMSNorm)``, ``loss_fn`` -> ``RMSNorm ×2, loss_fn``."""
    counts = Counter(label.rpartition(" (")[2].rstrip(")") for label in labels)
    return ", ".join(name if k == 1 else f"{name} ×{k}" for name, k in counts.items())


class NotExactError(AssertionError):
    """Accumulated and full-batch gradients differ; ``.report`` holds the ``CheckReport``."""

    def __init__(self, report: CheckReport) -> None:
        super().__init__(report.summary())
        self.report = report


def check(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    micro_batch_size: int | None = None,
    *,
    tolerance: float = 1e-10,
    seed: int = 0,
    raise_on_failure: bool = False,
) -> CheckReport:
    """Compare the accumulated gradient with the full-batch gradient on one batch, in float64.

    Works on any ``nn.Module``, transformers models included (their key/value caches are never
    replayed; their float32 islands set the tolerance, and the report says so). Dropout is
    turned off in every run, and the report names where (Note [dropout in check]): with it on,
    micro-batches draw other masks than the full batch, which is expected, not a bug.

    Args:
        model: the model, in the mode (train / eval) it trains in; it is not changed.
        batch: one logical batch (at least 2 samples).
        loss_fn: ``loss_fn(model, micro_batch)`` as given to the ``Accumulator`` (a mean, a
            ``(loss_sum, count)`` pair or named terms).
        micro_batch_size: samples per micro-batch; default about a third of the batch
            (uneven: 10 samples give 4 + 4 + 2).
        tolerance: relative difference counted as rounding in float64, a number >= 0; raised to
            ``ROUNDING`` of a lower precision the copy computes in (``CheckReport.compute_dtype``).
        seed: the seed both runs start from (randomness other than dropout).
        raise_on_failure: raise ``NotExactError`` instead of returning a report that is not exact.

    Returns:
        The ``CheckReport``.

    Raises:
        ValueError: the batch has fewer than 2 samples, ``micro_batch_size`` is not positive or
            covers it all, ``tolerance`` is negative or not finite, the model has no trainable
            parameter, or no gradient reaches one from the loss.
        TypeError: ``tolerance`` is not a number.
        NotExactError: not exact and ``raise_on_failure`` is set.

    Example:
        >>> m = torch.nn.Linear(3, 1)
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> check(m, (torch.randn(10, 3), torch.randn(10, 1)), mse).exact
        True
    """
    n, size = _check_arguments(model, batch, micro_batch_size, tolerance)
    batch = map_tensors(lambda t: t.double() if t.is_floating_point() else t, batch)
    case = _runs.Case(model, batch, loss_fn, size, seed)
    full = _runs.full_run(case)
    tolerance = max(tolerance, ROUNDING.get(full.observed.dtype, 0.0))
    acc, acc_loss = _runs.accumulated_grads(case) if full.finite else ({}, math.nan)
    diffs = (
        _runs.differences(acc, full.grads) if full.finite else dict.fromkeys(full.grads, math.nan)
    )
    found = nonfinite(case, full, acc, acc_loss)
    within = all(d <= tolerance for d in diffs.values())
    terms = {} if within or found else {k: _runs.term_difference(case, k) for k in full.terms}
    diagnoses = [found] if found else [] if within else diagnose(case, tolerance, full.grads, terms)
    if checkpointed_blocks(model) and found is None:
        diagnoses += checkpointing(case, full.grads, tolerance)
    report = CheckReport(  # the fields in order
        within and not diagnoses, diffs, n, size, tolerance, diagnoses, full.observed.dtype,
        _labels(model, full.observed.where), _labels(model, full.observed.dropout), terms,
    )  # fmt: skip
    if raise_on_failure and not report.exact:
        raise NotExactError(report)
    return report


def _check_arguments(
    model: nn.Module, batch: Batch, micro_batch_size: int | None, tolerance: object
) -> tuple[int, int]:
    """``(samples, micro-batch size)``, or one clear error about the argument at fault."""
    n = batch_size(batch)
    if n < 2:
        raise ValueError(f"check needs a batch of at least 2 samples to cut; got {n}.")
    m = max(1, (n + 2) // 3) if micro_batch_size is None else micro_batch_size
    if isinstance(m, bool) or not isinstance(m, int) or not 0 < m < n:
        raise ValueError(
            f"micro_batch_size={m!r} is not allowed: use a positive integer smaller than the batch "
            f"({n} samples: one micro-batch of all of it leaves nothing to compare), or None for "
            "about a third of it."
        )
    allowed = "use a relative difference >= 0, e.g. tolerance=1e-10 (float64 rounding)."
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise TypeError(f"tolerance={tolerance!r} is not allowed: {allowed}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance={tolerance!r} is not allowed: {allowed}")
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        held = f"all {len(params)} of its parameters have requires_grad=False"
        raise ValueError(
            f"check needs a model with trainable parameters, and {type(model).__name__} has none "
            f"({held if params else 'it has no parameters'}): pass the module holding the weights "
            "you train, or requires_grad_(True) them."
        )
    return n, m


def _labels(model: nn.Module, names: list[str]) -> tuple[str, ...]:
    return tuple(n if n == LOSS_FN else label(n, model.get_submodule(n)) for n in names)

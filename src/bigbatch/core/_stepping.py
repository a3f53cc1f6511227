"""The optimizer-step half of a window: what is checked when the ``Accumulator`` is built, and the
gradient arithmetic of ``step`` (normalise, norm and clip, scheduler).

Everything a step needs to refuse is refused at construction, before any weight can change: an
optimizer that does not hold the model's trainable parameters (it would train nothing, and their
``.grad`` would grow step after step), a scheduler that cannot be stepped once per optimizer step,
a clipping norm that is not a positive number.

Note [one host sync]
    On a GPU the host must not wait for the device inside a window: each micro-batch's loss sum
    and count stay on the device (``Window``), and ``step`` reads them in one transfer
    (``Window.totals``), each gradient's norm with them. Normalising multiplies the gradients by
    a number known only after that read, so on one process with plain gradients and no loss
    scaler the norms are taken before (the norm of ``f·g`` is ``f`` times that of ``g``) and the
    factor and the clipping coefficient go in one multiply. With a loss scaler (which reads its
    own verdict), several ranks, or sharded or sparse gradients, the gradients are normalised
    first and their norm is one more read.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.ledger import Ledger
from bigbatch.core.loss import accepts
from bigbatch.core.split import check_choice

NONFINITE = ("raise", "skip", "apply")


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    Attributes:
        loss: the window's true loss, ``Σ loss_sum / Σ count`` over all ranks (for named terms
            ``Σ_k w_k Σ loss_sum_k / Σ count_k``; a term that counted nothing is 0).
        count: the window's total count over all ranks (samples, or tokens for a token loss; the
            first term's for named terms).
        micro_batches: micro-batches accumulated on this rank.
        micro_batch_size: samples per micro-batch (the last may be smaller); ``None`` under a
            token cut and when the caller cut the batch itself (``backward``/``step``).
        grad_norm: total 2-norm of the normalised gradient, before clipping.
        skipped: ``True`` when the optimizer did not step: fp16 found inf/NaN gradients, or
            ``nonfinite="skip"`` met a non-finite loss or gradient. The scheduler did not step.
        oom_retries: windows redone at a smaller micro-batch after running out of memory.
        samples: samples in the window on this rank (``None`` for ``backward`` / ``step``).
        nonfinite: the loss or the gradient norm was NaN or infinite.
        peak_bytes: memory the successful attempt of the window added at its peak (measured
            with ``micro_batch_size="auto"`` or a ``memory_budget``; else ``None``).
        terms: each named term's value ``Σ loss_sum_k / Σ count_k`` (one ``"loss"`` otherwise).
        tokens: real tokens in the window on this rank (token cuts, and sample cuts of text with
            an ``attention_mask``: Note [per-token tensors]), else ``None``.
        padded_tokens: tokens computed, padding included (where ``tokens`` is), else ``None``.
        micro_batch_tokens: the token budget of a token (or packed) cut, else ``None``.
        ledger: what the step counted and computed (Note [step ledger] in
            ``bigbatch.core.ledger``), where the cut knows each sample's tokens, else ``None``.
    """

    loss: float
    count: float
    micro_batches: int
    micro_batch_size: int | None
    grad_norm: float
    skipped: bool = False
    oom_retries: int = 0
    samples: int | None = None
    nonfinite: bool = False
    peak_bytes: int | None = None
    terms: dict[str, float] = field(default_factory=dict)
    tokens: int | None = None
    padded_tokens: int | None = None
    micro_batch_tokens: int | None = None
    ledger: Ledger | None = None


class NonFiniteError(FloatingPointError):
    """The window's loss or gradient norm is NaN or infinite; nothing was changed.

    Raised by ``Accumulator.step`` / ``train_step`` with ``nonfinite="raise"`` (the default)
    before ``optimizer.step()``: the parameters, the optimizer state, the scheduler and the
    gradients are as they were before the window.
    """


NONFINITE_FIX = (
    "nothing was changed. Look for NaN / inf in the data or a diverging loss (lower the learning "
    'rate, clip with max_grad_norm), or pass nonfinite="skip" to skip such windows.'
)


def check_window(
    sums: dict[str, float], counts: dict[str, float], bad_counts: float, expected: Any
) -> None:
    """Refuse a window whose counts cannot normalise it (Note [window checks] in the engine), or
    whose terms' counts are not the ones known before it (``expected``: ``count_fn``, a count
    pass), which would run the backward at another scale than the full batch's (fp16 skips).

    Raises:
        ValueError: a count was negative or not finite, a term's count is 0 and its sum is not,
            or a term's count is not the one ``count_fn`` gave.
    """
    if bad_counts:
        raise ValueError(
            f"{bad_counts:g} micro-batch count(s) were negative or not finite: a count must be the "
            "number of items summed over. The window was discarded; nothing was changed."
        )
    for name, count in counts.items():
        if not count and sums[name] != 0 and math.isfinite(sums[name]):
            raise ValueError(
                f"term {name!r} sums to {sums[name]:g} over a count of 0: with no item to average "
                "over it has no full-batch value (sum / 0). Return a count > 0 with that sum, or "
                "a sum of 0. The window was discarded; nothing was changed."
            )
    for name, count in counts.items() if expected is not None else ():
        want = expected.get(name, math.nan)  # numbers: read with the totals (Window.totals)
        if not math.isclose(want, count, rel_tol=1e-9, abs_tol=1e-9):
            term = f"term {name!r}: " if len(counts) > 1 else ""
            raise ValueError(
                f"{term}count_fn counted {want:g} before the window, loss_fn's counts add up to "
                f"{count:g}: count_fn must return the counts loss_fn will. Nothing changed."
            )


EMPTY_WINDOW = (
    "a window's total count is 0 (every label ignore_index, every sample masked or weighted 0?): "
    "with nothing to average over, the step applies a zero gradient, as the full batch does in "
    "transformers' Trainer and Keras (the optimizer still steps: AdamW decays, momentum moves); "
    "its loss is reported as 0. Said once."
)


def pair_grads(
    optimizer: Any, grads: Mapping[torch.Tensor, Any] | Iterable[torch.Tensor | None]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter, gradient)`` pairs from a dict, or any iterable (a list, a tuple, a
    generator) in the optimizer's order.

    Raises:
        TypeError: neither a mapping nor an iterable of gradients.
        ValueError: the wrong number of gradients, or one whose shape is not its parameter's.
    """
    params = params_of(optimizer)
    if isinstance(grads, torch.Tensor) or not isinstance(grads, (Mapping, Iterable)):
        raise TypeError(
            f"accumulate_grads() got grads of type {type(grads).__name__}: pass {{parameter: "
            "gradient}, or a list (any iterable) of one gradient per parameter, in its order."
        )
    grads = grads if isinstance(grads, Mapping) else list(grads)
    if not isinstance(grads, Mapping) and len(grads) != len(params):
        raise ValueError(
            f"accumulate_grads() got {len(grads)} gradients for the optimizer's {len(params)} "
            "parameters: pass one per parameter (or None) in its order, or {parameter: gradient}."
        )
    given = grads.items() if isinstance(grads, Mapping) else zip(params, grads, strict=True)
    pairs, held = [(p, g) for p, g in given if g is not None], set(map(id, params))
    for p, g in pairs:
        if id(p) not in held:
            raise ValueError(
                f"accumulate_grads(): a gradient for a tensor of shape {tuple(p.shape)} that the "
                "optimizer does not hold: key the dict by the optimizer's own parameters."
            )
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"accumulate_grads(): a gradient is {type(g).__name__}, not a tensor.")
        if g.shape != p.shape:
            raise ValueError(
                f"accumulate_grads(): a gradient of shape {tuple(g.shape)} for a "
                f"parameter of shape {tuple(p.shape)}."
            )
    return pairs


def check_step(
    model: torch.nn.Module, optimizer: Any, scheduler: Any, max_grad_norm: object, nonfinite: object
) -> tuple[Any, float | None, str]:
    """The step's settings, checked when the ``Accumulator`` is built, as the ``Stepper`` takes
    them: ``(scheduler, max_grad_norm, nonfinite)``.

    Raises:
        ValueError: ``max_grad_norm`` is not a positive finite number or ``None``; ``nonfinite``
            is not one of ``NONFINITE``; see also ``check_optimizer`` and ``check_scheduler``.
        TypeError: see ``check_optimizer`` and ``check_scheduler``.
    """
    real = isinstance(max_grad_norm, numbers.Real) and type(max_grad_norm) is not bool
    clip = float(max_grad_norm) if real else math.nan  # type: ignore[arg-type]  # a Real
    if max_grad_norm is not None and not 0 < clip < math.inf:
        raise ValueError(
            f"max_grad_norm={max_grad_norm!r} is not allowed: use a positive number or None "
            "(finite, e.g. max_grad_norm=1.0)."
        )
    check_choice("nonfinite", nonfinite, NONFINITE)
    check_optimizer(model, optimizer)
    clip_or_none = None if max_grad_norm is None else clip
    return check_scheduler(scheduler, optimizer), clip_or_none, str(nonfinite)


def check_optimizer(model: torch.nn.Module, optimizer: Any) -> None:
    """Refuse an optimizer that is not one, or that misses some of the model's trainable parameters.

    Raises:
        TypeError: ``optimizer`` has no ``param_groups`` / ``step`` / ``zero_grad``.
        ValueError: the model has trainable parameters the optimizer does not hold (named).
    """
    if not all(hasattr(optimizer, a) for a in ("param_groups", "step", "zero_grad")):
        raise TypeError(
            f"optimizer={type(optimizer).__name__} is not an optimizer: pass a torch.optim.Optimizer,"
            " e.g. torch.optim.AdamW(model.parameters())."
        )
    held = set(map(id, params_of(optimizer)))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in trainable if id(p) not in held]
    if trainable and len(missing) == len(trainable):
        raise ValueError(
            "the optimizer holds none of the model's trainable parameters (training would change "
            "nothing): build it over this model, e.g. torch.optim.AdamW(model.parameters())."
        )
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if missing[5:] else "")
        raise ValueError(
            f"the optimizer does not hold the trainable parameter(s) {shown}: their gradients "
            "would grow, unused. Give them to the optimizer, or call requires_grad_(False) on them."
        )


def check_scheduler(scheduler: Any, optimizer: Any) -> Any:
    """Return ``scheduler`` if it can be stepped once per optimizer step, else raise.

    Accepted: ``None``; any ``torch.optim.lr_scheduler`` scheduler; ``ReduceLROnPlateau`` (stepped
    with the window's loss); any object whose ``step()`` needs no argument.

    Raises:
        TypeError: anything else, or a scheduler of another optimizer.
    """
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    steppable = accepts(getattr(scheduler, "step", None), 0)
    if scheduler is not None and not plateau and not steppable:
        raise TypeError(
            f"scheduler={type(scheduler).__name__} cannot be stepped once per optimizer step: pass "
            "a torch.optim.lr_scheduler scheduler, an object whose step() takes no argument, or None."
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise TypeError(
            "the scheduler steps another optimizer than the Accumulator's: build it over the "
            "same optimizer, e.g. LambdaLR(optimizer, ...)."
        )
    return scheduler


def scale_grads_(params: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply every ``p.grad`` by ``factor`` in place (sparse gradients included)."""
    dense = [p.grad for p in params if p.grad is not None and not p.grad.is_sparse]
    if dense:
        torch._foreach_mul_(dense, factor)
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            p.grad.mul_(factor)


def clip_or_norm_(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The gradients' total 2-norm, clipping them to ``max_norm`` first when it is given."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if not any(g.is_sparse for g in grads):
        if max_norm is not None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        norms: Sequence[torch.Tensor] = torch._foreach_norm(grads)
    else:  # clip_grad_norm_'s foreach path does not take sparse tensors: its arithmetic, by hand
        norms = [g.coalesce().values().norm() if g.is_sparse else g.norm() for g in grads]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    if max_norm is not None:
        scale_grads_(params, (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


def scale_and_clip_(
    grads: list[torch.Tensor], factor: float, norm: float, max_norm: float | None
) -> float:
    """Multiply ``grads`` by ``factor`` and clip them to ``max_norm`` in one multiply, from
    ``norm``, their norm before (Note [one host sync]); return their norm after ``factor``."""
    norm = norm * factor
    clip = 1.0 if max_norm is None else max_norm / (norm + 1e-6)  # clip_grad_norm_'s arithmetic
    total = factor * (1.0 if clip >= 1.0 else clip)  # a NaN norm stays NaN, as there
    if not abs(total - 1.0) <= 4e-16:
        torch._foreach_mul_(grads, total)
    return norm


def params_of(optimizer: Any) -> list[torch.Tensor]:
    """Every parameter ``optimizer`` holds, in its order (no walk over the model's modules)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


@dataclass
class Stepper:
    """The optimizer-step half of a window: normalise, check, clip, step, schedule, zero.

    Attributes:
        optimizer, scheduler, max_grad_norm, nonfinite: as the ``Accumulator``'s (checked there).
        precision: the ``Precision`` (unscale, step through the loss scaler).
        sync: the gradient-sync control (the totals' all-reduce, a deferred window's reduce).
        warned: whether a window that counted nothing was warned about (once).
    """

    optimizer: Any
    scheduler: Any
    max_grad_norm: float | None
    nonfinite: str
    precision: Any
    sync: Any
    warned: bool = False  # about a window that counted nothing (EMPTY_WINDOW), once

    def apply(self, w: Any, **fields: Any) -> StepResult:
        """Step on the window ``w`` (a ``bigbatch.core._window.Window``); ``fields``: more of the
        ``StepResult`` (what the runner knows). Note [backward scale], Note [window checks]."""
        grads = self.plain_grads(w)  # their norms are read with the totals (Note [one host sync])
        totals, norms = w.totals([] if grads is None else list(torch._foreach_norm(grads)))
        if self.sync.world_size > 1:  # over all ranks (one all-reduce)
            totals = self.sync.all_reduce(torch.tensor(totals, dtype=torch.float64)).tolist()
        sums, counts = (dict(zip(w.factors, totals[i:-1:2], strict=True)) for i in (0, 1))
        check_window(sums, counts, totals[-1], w.expected)  # then the bad counts
        if not any(counts.values()) and not self.warned:  # Note [window checks]: nothing counted
            self.warned = True
            warnings.warn(EMPTY_WINDOW, BigBatchWarning, stacklevel=4)
        terms = {k: sums[k] / c if c else sums[k] * 0.0 for k, c in counts.items()}
        loss = sum(w.weights[k] * v for k, v in terms.items())
        count = next(iter(counts.values()))
        # In fp16 non-finite windows are the loss scaler's to skip.
        if not math.isfinite(loss) and self.nonfinite == "raise" and self.precision.scaler is None:
            raise NonFiniteError(f"the window's loss is {loss} (count {count:g}); " + NONFINITE_FIX)
        grad_norm = self.normalise(w, counts, grads, math.sqrt(sum(n * n for n in norms)))
        nonfinite = not (math.isfinite(loss) and math.isfinite(grad_norm))
        skipped = self.skips(nonfinite, grad_norm, count) or self.precision.step(self.optimizer)
        if not skipped and isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(loss)  # with the window's mean loss
        elif not skipped and self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(
            loss,
            count,
            w.micro_batches,
            fields.pop("micro_batch_size", None),
            grad_norm,
            skipped,
            nonfinite=nonfinite,
            samples=w.samples,
            terms=terms,
            **fields,
        )

    def normalise(
        self, w: Any, counts: dict[str, float], grads: list[Any] | None, norm: float
    ) -> float:
        """Multiply the gradients by ``W / (C s)`` (Note [backward scale]), reduce a deferred
        window's (Note [several forwards]), unscale and clip them; return their norm (``grads``,
        ``norm``: the plain gradients and their norm before, Note [one host sync])."""
        if self.sync.owns_step:  # the backend's engine steps (Note [DeepSpeed windows])
            return float(self.sync.finish(w.scales, counts))
        params, (first, count) = params_of(self.optimizer), next(iter(counts.items()))
        factor = float(self.sync.world_size)  # several terms: every s_k is exactly 1 / C_k
        if w.expected is None or len(counts) == 1:  # one term: whatever s was, W / (C s) is exact
            factor = factor / (count * float(w.scales[first])) if count else 1.0
        if grads is not None:
            return scale_and_clip_(grads, factor, norm, self.max_grad_norm)
        if w.deferred:  # each rank's own factor, then the average
            scale_grads_(params, factor)
            self.sync.reduce_grads(params)
        self.precision.unscale_(self.optimizer)
        with_grad = [p for p in params if p.grad is not None]
        if not w.deferred and abs(factor - 1.0) > 4e-16:
            scale_grads_(with_grad, factor)
        return float(clip_or_norm_(with_grad, self.max_grad_norm))

    def plain_grads(self, w: Any) -> list[torch.Tensor] | None:
        """The gradients when their norm can be read with the window's totals: one process, no
        loss scaler, not deferred, dense tensors on one device (Note [one host sync])."""
        if self.sync.world_size > 1 or w.deferred or self.precision.scaler is not None:
            return None
        grads = [p.grad for p in params_of(self.optimizer) if p.grad is not None]
        plain = all(type(g) is torch.Tensor and g.layout == torch.strided for g in grads)
        return grads if grads and plain and len({g.device for g in grads}) == 1 else None

    def skips(self, nonfinite: bool, grad_norm: float, count: float) -> bool:
        """Whether a non-finite window is skipped (then discarded: fp16 leaves it to the scaler)."""
        if not nonfinite or self.nonfinite == "apply" or self.precision.scaler is not None:
            return False  # fp16: the scaler skips it and lowers the scale, as a full batch would
        if self.nonfinite == "raise":
            raise NonFiniteError(
                f"the window's gradient norm is {grad_norm} (count {count:g}); " + NONFINITE_FIX
            )
        self.precision.discard()
        return True

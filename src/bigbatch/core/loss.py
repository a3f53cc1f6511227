"""The loss contract, and the arithmetic of a window.

A ``loss_fn(model, micro_batch)`` returns either

* a scalar tensor, read as the **mean** over the micro-batch's samples, or
* a pair ``(loss_sum, count)``: the **sum** of per-item losses and how many items (samples,
  tokens, pixels...) that sum covers.

Note [window normalisation]
    The step's gradient is ``∇(Σ_i loss_sum_i) / Σ_i count_i`` over every micro-batch ``i`` of
    the window (and every rank). Each micro-batch back-propagates its *sum*, and the gradients
    are divided once, at step time, by the window's total count. This is the gradient of the
    true mean over the whole logical batch however it was cut, which "divide each micro-batch
    mean by k" is not when micro-batches hold different numbers of items (padding, a short last
    micro-batch). A mean is turned into a sum by multiplying by the number of samples it
    averaged over, which is exact for any per-sample mean loss.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

LossOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | int | float]
"""What a ``loss_fn`` returns: a scalar mean, or a ``(loss_sum, count)`` pair."""

LossFn = Callable[[torch.nn.Module, Any], LossOutput]
"""``loss_fn(model, micro_batch) -> LossOutput``."""


@runtime_checkable
class WindowLoss(Protocol):
    """A loss that must see the whole window before any micro-batch's backward (``cached_loss``).

    ``Accumulator.train_step`` calls ``prepare`` once per attempt at a window, in the micro-batch
    context, and calls the ``LossFn`` it returns on each of ``pieces`` instead of the loss itself.
    """

    def prepare(self, model: torch.nn.Module, batch: Any, pieces: list[Any]) -> LossFn: ...


def as_sum_and_count(output: Any, n_samples: int) -> tuple[torch.Tensor, torch.Tensor | float]:
    """Turn a ``loss_fn`` output into ``(loss_sum, count)``.

    Args:
        output: a scalar tensor (mean over ``n_samples``) or a ``(loss_sum, count)`` pair.
        n_samples: samples in the micro-batch that produced ``output``.

    Returns:
        ``(loss_sum, count)`` where ``count`` is a float or a 0-dim tensor (kept on the device so
        that reading it needs no host synchronisation).

    Raises:
        TypeError: the output is neither a tensor nor a pair.
        ValueError: the loss is not a scalar.
    """
    if isinstance(output, torch.Tensor):
        check_scalar_loss(output, "loss_fn's return value")
        return output * n_samples, float(n_samples)
    if isinstance(output, (tuple, list)) and len(output) == 2:
        loss_sum, count = output
        if not isinstance(loss_sum, torch.Tensor):
            raise TypeError(
                f"loss_fn returned a pair whose first item is a {type(loss_sum).__name__}; it must "
                "be the loss sum as a scalar tensor: return (loss_sum, count)."
            )
        check_scalar_loss(loss_sum, "loss_fn's loss_sum")
        return loss_sum, check_count(count, "loss_fn's count")
    raise TypeError(
        f"loss_fn returned {type(output).__name__}; return a scalar tensor (the mean over the "
        "micro-batch) or a pair (loss_sum, count)."
    )


def check_scalar_loss(loss: torch.Tensor, name: str) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``loss`` is a one-element tensor."""
    if loss.numel() != 1:
        raise ValueError(
            f"{name} has shape {tuple(loss.shape)}; it must be a scalar. Reduce per-item losses "
            "with .sum() and return (loss_sum, count), or with .mean() and return the mean."
        )


def check_count(count: Any, name: str) -> torch.Tensor | float:
    """Return ``count`` as a float or 0-dim tensor, rejecting bad values.

    A Python or numpy number must be finite and non-negative. A tensor count is only checked for
    its shape here: its value lives on the device, and reading it would stall the device once per
    micro-batch, so the engine checks the window's counts at step time, before anything changes
    (Note [window checks] in ``bigbatch.core.engine``).

    Raises:
        TypeError: not a number (``bool`` included).
        ValueError: negative, NaN or infinite; a tensor of more than one element.
    """
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(f"{name} has shape {tuple(count.shape)}; it must be a scalar.")
        return count.detach().reshape(())
    if isinstance(count, bool) or not isinstance(count, numbers.Real):
        raise TypeError(f"{name}={count!r} is not a number; pass the number of items summed over.")
    value = float(count)
    if not math.isfinite(value) or value < 0:
        what = "negative" if value < 0 else "not finite"
        raise ValueError(
            f"{name}={count!r} is {what}; it must count the items summed over (a finite number "
            ">= 0)."
        )
    return value


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, shift: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level cross-entropy as ``(loss_sum, count)``, ignoring padding.

    Use it for language models on padded sequences: the window's gradient is then the gradient
    of the mean over every real token of the logical batch (see Note [window normalisation]).

    Args:
        logits: ``[..., vocab]`` scores.
        labels: ``[...]`` target ids; positions equal to ``ignore_index`` are not counted.
        ignore_index: label value that marks padding.
        shift: predict token ``t+1`` from position ``t`` (causal LM with unshifted labels).

    Returns:
        ``(loss_sum, count)``: summed loss over real tokens, and their number (a 0-dim tensor).

    Example:
        >>> import torch
        >>> logits, labels = torch.zeros(2, 3, 5), torch.tensor([[1, 2, -100], [0, -100, -100]])
        >>> loss_sum, count = token_cross_entropy(logits, labels)
        >>> int(count)
        3
    """
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    flat_logits = _upcast(logits.reshape(-1, logits.shape[-1]))
    flat_labels = labels.reshape(-1)
    loss_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum")
    count = (flat_labels != ignore_index).sum()
    return loss_sum, count


def sample_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per-sample cross-entropy for classification as ``(loss_sum, count)``."""
    return F.cross_entropy(_upcast(logits), targets, reduction="sum"), targets.shape[0]


def sample_mse(prediction: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean-squared error summed per sample (mean over features) as ``(loss_sum, count)``."""
    per_sample = (_upcast(prediction) - target).pow(2).reshape(prediction.shape[0], -1)
    return per_sample.mean(dim=1).sum(), prediction.shape[0]


def _upcast(t: torch.Tensor) -> torch.Tensor:
    # Half-precision logits lose too much in a sum over many tokens; float64 stays float64.
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

"""The loss contract, and the arithmetic of a window.

A ``loss_fn(model, micro_batch)`` returns either

* a scalar tensor, read as the **mean** over the micro-batch's samples, or
* a pair ``(loss_sum, count)``: the **sum** of per-item losses and how many items (samples,
  tokens, pixels...) that sum covers, or
* named terms ``{name: (loss_sum, count)}`` or ``{name: (loss_sum, count, weight)}``: a loss made
  of several terms, each a sum over its own items (Note [named terms]).

Note [window normalisation]
    The step's gradient is ``∇(Σ_i loss_sum_i) / Σ_i count_i`` over every micro-batch ``i`` of
    the window (and every rank). Each micro-batch back-propagates its *sum*, and the gradients
    are divided once, at step time, by the window's total count. This is the gradient of the
    true mean over the whole logical batch however it was cut, which "divide each micro-batch
    mean by k" is not when micro-batches hold different numbers of items (padding, a short last
    micro-batch). A mean is turned into a sum by multiplying by the number of samples it
    averaged over, which is exact for any per-sample mean loss.

Note [named terms]
    A loss of several terms (a token-mean language-model loss, a per-sequence auxiliary term, a
    per-pair preference term) is ``L = Σ_k w_k (Σ_i loss_sum_{k,i}) / (Σ_i count_{k,i})``: each
    term's sum and count are totalled over every micro-batch of the window and every rank, and
    weighted after. Dividing a term inside a micro-batch, or by the number of micro-batches, is
    what goes wrong elsewhere (an auxiliary term inflated by k). A single output is the one-term
    case (``"loss"``, weight 1). Because each term has its own denominator, the engine needs the
    terms' counts before a window's first backward: from ``count_fn`` (returning ``{name:
    count}``), else from a no-gradient count pass over the window (Note [passes before the
    window] in ``bigbatch.core._window``).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from bigbatch.core.head import HeadLogits

LossOutput = Any
"""What a ``loss_fn`` returns: a scalar mean, a ``(loss_sum, count)`` pair, or named terms."""


class Term(NamedTuple):
    """One term of a window's loss for one micro-batch (Note [named terms])."""

    loss_sum: torch.Tensor
    count: torch.Tensor | float  # type: ignore[assignment]  # the field, not tuple.count
    weight: float = 1.0


LossFn = Callable[[torch.nn.Module, Any], LossOutput]
"""``loss_fn(model, micro_batch) -> LossOutput``."""


@runtime_checkable
class WindowLoss(Protocol):
    """A loss that must see the whole window before any micro-batch's backward (``cached_loss``).

    ``Accumulator.train_step`` calls ``prepare`` once per attempt at a window, in the micro-batch
    context, and calls the ``LossFn`` it returns on each of ``pieces`` instead of the loss itself.
    ``rows`` gives each piece's rows in ``batch`` when the cut reorders them (token windows).
    """

    def prepare(
        self, model: torch.nn.Module, batch: Any, pieces: list[Any], rows: Any = None
    ) -> LossFn: ...


def as_sum_and_count(
    output: Any, n_samples: int, what: str = "loss_fn"
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """Turn a ``loss_fn`` output into ``(loss_sum, count)``.

    Args:
        output: a scalar tensor (mean over ``n_samples``) or a ``(loss_sum, count)`` pair.
        n_samples: samples in the micro-batch that produced ``output``.
        what: the function that returned it, for messages (``loss_fn``, ``batch_loss_fn``).

    Returns:
        ``(loss_sum, count)`` where ``count`` is a float or a 0-dim tensor (kept on the device so
        that reading it needs no host synchronisation).

    Raises:
        TypeError: the output is neither a tensor nor a pair.
        ValueError: the loss is not a scalar.
    """
    if isinstance(output, torch.Tensor):
        check_scalar_loss(output, f"{what}'s return value")
        return output * n_samples, float(n_samples)
    if isinstance(output, (tuple, list)) and len(output) == 2:
        loss_sum, count = output
        if not isinstance(loss_sum, torch.Tensor):
            raise TypeError(
                f"{what} returned a pair whose first item is a {type(loss_sum).__name__}; it "
                "must be the loss sum as a scalar tensor: return (loss_sum, count)."
            )
        check_scalar_loss(loss_sum, f"{what}'s loss_sum")
        if isinstance(count, (Mapping, tuple, list)) or torch.is_tensor(count) and count.dim() > 1:
            shown = f"shape {list(count.shape)}" if torch.is_tensor(count) else type(count).__name__
            raise TypeError(
                f"{what} returned (loss, a {shown}): a pair is (loss_sum, count), count the "
                "number of items loss_sum adds up. For transformers' (loss, outputs) form (as "
                "compute_loss(return_outputs=True) gives) return the loss alone (a mean)."
            )
        return loss_sum, check_count(count, f"{what}'s count")
    raise TypeError(
        f"{what} returned {type(output).__name__}; return a scalar tensor (the mean over its "
        "samples), a pair (loss_sum, count) or named terms {name: (loss_sum, count)}."
    )


def as_terms(output: Any, n_samples: int) -> dict[str, Term]:
    """A ``loss_fn`` output as named terms: one ``"loss"`` term for a mean or a pair.

    Raises:
        TypeError, ValueError: as ``as_sum_and_count``, for each term, naming it; a weight that
            is not a finite number; an empty mapping; two names that are the same text.
    """
    if isinstance(output, Term):  # one ready-made term (bigbatch.losses.terms)
        return as_terms({"loss": output}, n_samples)
    if not isinstance(output, Mapping):
        return {"loss": Term(*as_sum_and_count(output, n_samples))}
    if not output:
        raise ValueError("loss_fn returned an empty mapping: return at least one named term.")
    terms = {}
    for name, value in output.items():
        if not isinstance(value, (tuple, list)) or len(value) not in (2, 3):
            raise TypeError(
                f"loss_fn's term {name!r} is {type(value).__name__}; each named term must be "
                "(loss_sum, count) or (loss_sum, count, weight)."
            )
        loss_sum, count = as_sum_and_count(tuple(value[:2]), n_samples, f"term {name!r}")
        weight = value[2] if len(value) == 3 else 1.0
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise TypeError(f"loss_fn's term {name!r} has weight {weight!r}: use a number.")
        if not math.isfinite(weight):
            raise ValueError(f"loss_fn's term {name!r} has weight {weight!r}: use a finite number.")
        if str(name) in terms:  # 1 and "1": the window's totals are kept by text
            raise ValueError(
                f"loss_fn's term names {list(output)!r} hold {str(name)!r} twice "
                "as text: give each term a name of its own."
            )
        terms[str(name)] = Term(loss_sum, count, float(weight))
    return terms


def mean_of(terms: Mapping[str, Term]) -> torch.Tensor:
    """The loss the terms stand for, ``Σ_k w_k loss_sum_k / count_k`` (a full batch's value); a
    term that counts nothing adds its sum, which must be 0 (Note [window checks])."""

    def counted(c: Any) -> Any:  # a count of 0 divides by 1, not 0 (0 / 0 is NaN)
        return (
            torch.where(c > 0, c, torch.ones_like(c)) if isinstance(c, torch.Tensor) else c or 1.0
        )

    return sum(t.weight * t.loss_sum / counted(t.count) for t in terms.values())  # type: ignore[return-value]


def accepts(fn: Any, n: int) -> bool:
    """Whether ``fn`` is callable with ``n`` positional arguments (``True`` where its signature
    cannot be read: a builtin)."""
    try:
        return inspect.signature(fn).bind(*range(n)) is not None
    except ValueError:  # no signature: trust it
        return True
    except TypeError:  # not callable, or it takes other arguments
        return False


def check_stats_fn(loss_fn: Any, stats_fn: Any) -> None:
    """Refuse a ``stats_fn`` that is not callable, or given with a ``loss_fn`` that does not take
    the statistics (Note [passes before the window] in ``bigbatch.core._window``)."""
    if stats_fn is not None and not callable(stats_fn):
        raise TypeError(f"stats_fn={stats_fn!r} is not callable: pass stats_fn(model, mb).")
    if stats_fn is not None and callable(loss_fn) and not accepts(loss_fn, 3):
        raise TypeError(
            f"stats_fn is given, so loss_fn is called as loss_fn(model, batch, stats), but it "
            f"takes {inspect.signature(loss_fn)}: add the stats parameter, or drop stats_fn."
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
            f"{name}={count!r} is {what}; it must count the items summed over (finite, >= 0)."
        )
    return value


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, shift: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level cross-entropy as ``(loss_sum, count)``, ignoring padding.

    Use it for language models on padded sequences: the window's gradient is then the gradient
    of the mean over every real token of the logical batch (see Note [window normalisation]).

    Args:
        logits: ``[..., vocab]`` scores, or a model's logits under ``--chunked-head``, computed
            here in chunks (Note [deferred head] in ``bigbatch.core.head``).
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
    if isinstance(logits, HeadLogits):
        return logits.cross_entropy(labels, shift=shift, ignore_index=ignore_index)  # type: ignore[no-any-return]
    flat_logits, flat_labels, kept = flat_tokens(logits, labels, shift, ignore_index)
    loss_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum")
    return loss_sum, kept.sum()


def flat_tokens(
    logits: torch.Tensor, labels: torch.Tensor, shift: bool, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[tokens, vocab]`` logits (half precision upcast), ``[tokens]`` labels, and which tokens
    are labelled (``!= ignore_index``); ``shift`` pairs position ``t`` with label ``t+1``."""
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    flat_labels = labels.reshape(-1)
    return _upcast(logits.reshape(-1, logits.shape[-1])), flat_labels, flat_labels != ignore_index


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

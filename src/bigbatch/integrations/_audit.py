"""What the transformers and Lightning audits share: the audited window, joined as one batch,
the comparison with that batch's gradient, and the diagnosis in words.

Note [audit]
    An optimizer step under accumulation should equal the step the same trainer takes on the
    window's micro-batches joined into one batch. An audited window records its micro-batches,
    the random state before the first, and what each micro-batch back-propagated (its loss after
    the trainer's scaling). After the window's last backward, before clipping and the optimizer
    step, the audit keeps the accumulated gradients aside, restores that random state, runs the
    trainer's own loss on the joined batch once with gradients (the one extra forward and
    backward), compares, and puts the gradients and the random state back: training goes on as
    if nothing had happened. The tolerance is the rounding of the lowest precision that forward
    really computes in (Note [float32 islands] in ``bigbatch.verifier._runs``), so a float64
    model with float32 islands is not a false alarm. On several ranks every rank compares and
    all agree on the verdict (one all-reduce); a loss given as ``(sum, count)`` or named terms is
    read over every rank's count (``window_mean``), as the window normalises it.

Note [audit diagnosis]
    When a step is not exact, each micro-batch's loss is computed again without gradient (its
    own one-batch loss ``L_i``), and the weight the trainer gave it, ``a_i`` = what it
    back-propagated / ``L_i``, is read against its right weight ``w_i = n_i / N`` (its share of
    the window's tokens, or samples). ``a_i = 1/k`` (``k`` accumulation steps) where the ``n_i``
    differ: a mean of micro-batch means, "per-micro-batch mean on padded data"; ``a_i = 1``:
    "÷ accumulation steps missing"; ``a_i = 1/k²``: "÷ accumulation steps applied twice";
    ``a_i = 1/k`` on a short last window of ``m < k`` micro-batches: "last window mis-scaled";
    weights that follow none of these: "loss term normalised locally" (a term divided inside each
    micro-batch, so summed ``k`` times). With the right weights, gradients that differ between
    ranks mean "ranks did not synchronise"; else the loss of the joined batch is not the weighted
    mean of its micro-batches' losses: "loss couples samples across micro-batches" (contrastive,
    pairwise, a batch statistic: ``bigbatch.cached_loss`` or a statistics pass).
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bigbatch.core import _rng
from bigbatch.core._sync import wrapper_kind
from bigbatch.core._window import Backup
from bigbatch.core.loss import as_terms, mean_of
from bigbatch.core.split import batch_size
from bigbatch.verifier._runs import ROUNDING, Grads, differences, observe

logger = logging.getLogger("bigbatch")
Own = Callable[[Any], tuple[float, float]]  # a micro-batch's own one-batch loss and count


def need(module: str, extra: str) -> Any:
    """``import module``, or an ImportError naming the ``pip install`` that brings it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ImportError(f'{module} is missing: pip install "bigbatch[{extra}]"') from exc


@dataclass
class AuditResult:
    """One audited optimizer step.

    Attributes:
        step: the optimizer step (1 is the first).
        exact: every parameter's gradient is within ``tolerance`` of the one-batch gradient.
        grad_norm_ratio: ‖accumulated gradient‖ / ‖one-batch gradient‖ (1 when right).
        loss_ratio: the loss the trainer accumulated / the one-batch loss.
        difference: the largest relative difference of a parameter's gradient.
        tolerance: the rounding allowed, from the precision the model computes in.
        diagnosis: what went wrong, in words ("" when exact; Note [audit diagnosis]).
    """

    step: int
    exact: bool
    grad_norm_ratio: float
    loss_ratio: float
    difference: float
    tolerance: float
    diagnosis: str = ""

    def __str__(self) -> str:
        verdict = "exact" if self.exact else f"NOT exact: {self.diagnosis}"
        return (
            f"bigbatch audit, step {self.step}: {verdict} (gradient norm ×"
            f"{self.grad_norm_ratio:.4g}, loss ×{self.loss_ratio:.4g} of the one-batch step; "
            f"largest difference {self.difference:.1e}, tolerance {self.tolerance:.0e})"
        )


@dataclass
class Audit:
    """The steps to audit and, as training reaches them, one ``AuditResult`` each."""

    steps: tuple[int, ...]
    results: list[AuditResult] = field(default_factory=list)


def check_steps(steps: int | tuple[int, ...]) -> tuple[int, ...]:
    """``steps`` as a tuple of positive ints (an int is one step).

    Raises:
        ValueError: anything else.
    """
    found = (steps,) if isinstance(steps, int) else tuple(steps)
    if not found or not all(type(s) is int and s > 0 for s in found):
        raise ValueError(f"steps={steps!r} is not allowed: use positive ints, e.g. 1 or (1, 100).")
    return found


@dataclass
class Window:
    """An audited window as it runs (Note [audit]): the micro-batches as the trainer computed on
    them, the random state before the first, what each back-propagated."""

    step: int
    accumulation_steps: int
    rng: Any
    batches: list[Any] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)


def start(log: Audit, step: int, accumulation_steps: int, device: Any) -> Window | None:
    """A window about to run (its random state now) if ``step`` is audited, else ``None``."""
    audited = step in log.steps
    return Window(step, accumulation_steps, _rng.capture(torch.device(device))) if audited else None


def join(batches: Sequence[Any], pad_id: int = 0, key: str = "") -> Any:
    """The micro-batches as one batch: rows concatenated in order, per-token tensors right-padded
    to the longest (``labels`` with -100, ``*input_ids`` with ``pad_id``, the rest with 0)."""
    first = batches[0]
    if isinstance(first, Mapping):
        return {k: join([b[k] for b in batches], pad_id, str(k)) for k in first}
    if isinstance(first, tuple):
        return tuple(join(list(parts), pad_id) for parts in zip(*batches, strict=True))
    if isinstance(first, list):
        return [x for b in batches for x in b]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return first
    shape = [max(t.shape[d] for t in batches) for d in range(first.dim())]
    value = -100 if key == "labels" else pad_id if key.endswith("input_ids") else 0

    def pad(t: torch.Tensor) -> torch.Tensor:  # the last dimension first, as F.pad reads them
        widths = [(0, want - n) for want, n in zip(shape[:0:-1], t.shape[:0:-1], strict=True)]
        return torch.nn.functional.pad(t, [w for pair in widths for w in pair], value=value)

    return torch.cat([pad(t) for t in batches])


def count_items(batch: Any, shifts: bool = False) -> Any:
    """The items a mean over ``batch`` averages: its labels that are not -100 (without the first
    of each row when the loss ``shifts``; ``shift_labels`` as given), else its completion tokens
    (``completion_mask``: TRL's GRPO), else its rows."""
    if not isinstance(batch, Mapping):
        return batch_size(batch)
    labels, given = batch.get("shift_labels"), batch.get("labels")
    if labels is None and given is not None:
        labels = given[..., 1:] if shifts and given.dim() >= 2 else given
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        return (labels != -100).sum()
    if isinstance(batch.get("completion_mask"), torch.Tensor):
        return batch["completion_mask"].sum()
    return next(len(v) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim())


def window_mean(out: Any, rows: int) -> torch.Tensor:
    """A loss (a mean over ``rows`` samples, ``(sum, count)`` or named terms) as one batch: each
    term over its count on every rank, times the ranks (whose gradients are averaged)."""
    terms, world = as_terms(out, rows), _world()
    if world == 1:
        return mean_of(terms)
    counts = torch.tensor([float(t.count) for t in terms.values()], dtype=torch.float64)
    torch.distributed.all_reduce(counts)
    each = [t.weight * t.loss_sum / c for t, c in zip(terms.values(), counts.tolist(), strict=True)]
    return world * sum(each)  # type: ignore[return-value]


def gradients(model: torch.nn.Module) -> Grads:
    """Every trainable parameter's gradient by name (zeros where there is none), detached."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {n: torch.zeros(p.shape, dtype=p.dtype, device=p.device) if p.grad is None
            else _whole(p.grad.detach()).clone() for n, p in named}  # fmt: skip


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """A sharded gradient (FSDP2's ``DTensor``) gathered whole on every rank; others as they are."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def check(
    log: Audit, window: Window, model: torch.nn.Module, loss: Callable[[], torch.Tensor],
    own: Own | None, average: bool, scope: Any,
) -> None:  # fmt: skip
    """Compare the window's accumulated gradients with the gradient of ``loss()``, the trainer's
    loss on the joined batch (within the context manager ``scope``), and add the ``AuditResult``
    to ``log``.

    ``average``: average the one-batch gradients over the ranks (a model DDP does not wrap);
    ``own(micro_batch)``: its own one-batch loss and count, for the diagnosis (``None`` when the
    trainer weighs micro-batches right by construction: bigbatch's own).
    """
    acc, params = gradients(model), list(model.parameters())
    device, kept = params[0].device, [p.grad for p in params]
    backup = Backup(model, [], None, device)  # the buffers and the random state (Note [audit])
    model.zero_grad(set_to_none=True)
    _rng.restore(window.rng, device)  # the window's first
    try:
        with scope:
            with observe(model) as precision:
                value = loss()
            value.backward()
            grads = gradients(model)
            for g in grads.values() if average else ():
                torch.distributed.all_reduce(g)
                g /= torch.distributed.get_world_size()
            tolerance = max(1e-10, ROUNDING.get(precision.dtype, 0.0))
            log.results.append(judge(window, acc, grads, float(value.detach()), tolerance, own))
    finally:  # the gradients, the buffers and the random state as they were
        backup.restore(lambda: None)
        for p, old in zip(params, kept, strict=True):
            p.grad = old
        for m in model.modules():  # FSDP2 leaves some units unsharded after a forward without
            reshard = getattr(m, "reshard", None)  # gradients (the diagnosis's): the optimizer
            if wrapper_kind(m) == "fsdp" and callable(reshard):  # steps the shards, and the
                reshard()  # next forward must gather them again


def judge(
    window: Window, acc: Grads, grads: Grads, loss: float, tolerance: float, own: Own | None
) -> AuditResult:
    """Compare the accumulated gradients ``acc`` with the one-batch gradients ``grads`` (of
    ``loss``); diagnose a difference (Note [audit diagnosis])."""
    worst = max(differences(acc, grads).values(), default=0.0)
    returned, whole, disagree = sum(window.returns), loss, 0.0
    if _world() > 1:  # every rank takes the same path from here: agree on the worst difference
        norms = torch.stack([g.double().norm() for g in acc.values()])
        spread = torch.cat([torch.tensor([worst], dtype=torch.float64), norms, -norms])
        torch.distributed.all_reduce(spread, op=torch.distributed.ReduceOp.MAX)
        worst, (highest, lowest) = float(spread[0]), spread[1:].view(2, -1)  # lowest: negated
        disagree = float((highest + lowest).abs().max())
        totals = torch.tensor([returned, loss], dtype=torch.float64)
        torch.distributed.all_reduce(totals)  # the loss ratio of the whole window
        returned, whole = totals.tolist()
    result = AuditResult(
        window.step, worst <= tolerance, _norm(acc) / max(_norm(grads), 1e-300),
        returned / whole if whole else math.nan, worst, tolerance,
    )  # fmt: skip
    if not result.exact:
        result.diagnosis = _diagnose(window, loss, disagree > 1e-9 * _norm(acc), own, tolerance)
    (logger.info if result.exact else logger.warning)(str(result))
    return result


def _diagnose(
    window: Window, loss: float, ranks_differ: bool, own: Own | None, tolerance: float
) -> str:
    if ranks_differ:
        return "ranks did not synchronise"
    if own is None:
        return "loss couples samples across micro-batches"
    with torch.no_grad():
        losses, counts = zip(*[own(b) for b in window.batches], strict=True)
    k, m, total = window.accumulation_steps, len(losses), sum(counts)
    a = [r / x if x else math.nan for r, x in zip(window.returns, losses, strict=True)]

    def close(inverse: list[float]) -> bool:  # a_i = 1 / inverse_i for every micro-batch
        return all(abs(ai * t - 1) < 1e-3 for ai, t in zip(a, inverse, strict=True))

    if k > 1 and close([k] * m) and (m < k or len(set(counts)) > 1):
        return "last window mis-scaled" if m < k else "per-micro-batch mean on padded data"
    if k > 1 and close([1.0] * m):
        return "÷ accumulation steps missing"
    if k > 1 and close([k * k] * m):
        return "÷ accumulation steps applied twice"
    if not close([total / n if n else math.inf for n in counts]):  # not the right weights
        return "loss term normalised locally"
    weighted = sum(x * n for x, n in zip(losses, counts, strict=True)) / total
    if abs(weighted - loss) > max(tolerance, 1e-6) * abs(loss):
        return "loss couples samples across micro-batches"
    return "gradients differ where the losses agree"


def _norm(grads: Grads) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads.values()])))


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

"""The backward scale of a window: what each micro-batch's loss sum is multiplied by.

Note [backward scale]
    Every micro-batch back-propagates ``Σ_k w_k · loss_sum_k · s_k`` (one scale ``s_k`` per loss
    term) and the step multiplies the gradients by ``W / (C · s)`` (``W`` ranks, whose average
    DDP / FSDP take; ``C`` the window's total count): the step is exact whatever ``s`` is, and
    ``s`` only sets the magnitude of what flows through the backward, which matters in fp16 (the
    loss scaler skips a step whose gradients overflow). The best ``s`` is ``1 / C``: every
    backward then runs at the scale of the full batch's mean, what a plain fp16 loop runs. So:

    * counts known before the window (``count_fn``, a count pass): ``s_k = 1 / C_k`` exactly,
      on several ranks the global ``C_k`` (one small all-reduce before the window). A loss of
      several terms needs this (Note [named terms] in ``bigbatch.core.loss``): its first window
      without ``count_fn`` restarts with a count pass, and so do the windows after it.
    * otherwise, one term: ``s = 1 / N`` (the window's samples: exactly ``1 / C`` for a mean
      over samples). In fp16, ``s = 1 / Ĉ`` with ``Ĉ`` the batch's labelled tokens when the batch
      says (a mapping with integer ``labels``: ``labels != -100``); else a loss whose counts are
      tensors (tokens) *follows* the count: ``s = 1 / (count seen so far)``, the gradients
      already accumulated rescaled as counts arrive, and on several ranks the global count is
      agreed at each rank's last micro-batch (whose backward synchronises). Following never
      back-propagates at a scale smaller than the full batch's (the count so far is at most the
      total), but an unrepresentative first micro-batch (a few tokens) can make it larger: if
      the window's gradients overflowed on any rank, it is redone once at ``s = 1 / C``, its
      count now known (``overflowed``), so it skips exactly when the full batch would. The
      low-level path (``backward`` / ``step``, nothing known before the window) follows every
      count in fp16 and cannot be redone: give it counts, or use ``train_step``.
    * fp32 / bf16 on several ranks: ``s = 1`` (float32's range cannot overflow; no collective).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from bigbatch.core._stepping import scale_grads_
from bigbatch.core._sync import GradSync
from bigbatch.core._window import Window
from bigbatch.core.loss import check_count


def plan(
    w: Window, batch: Any, counts: Sequence[Any] | None, samples: int, sync: GradSync, fp16: bool
) -> None:
    """Choose the window's scales before it runs (``counts``: each piece's, when known)."""
    if counts is not None:  # exactly 1 / C_k (a count may be a fraction: a sum of weights)
        totals: dict[str, Any] = {}  # each term's total over the pieces: a number or {name: count}
        for c in counts:
            if isinstance(c, Mapping) and len(set(map(str, c))) < len(c):  # as loss_fn's names
                raise ValueError(
                    f"count_fn's names {list(c)!r} hold the same text twice: use "
                    "distinct names, the loss_fn's term names (kept by text)."
                )
            for name, value in c.items() if isinstance(c, Mapping) else [("loss", c)]:
                count = check_count(value, f"count_fn's result {name!r}")
                totals[str(name)] = totals.get(str(name), 0.0) + count
        w.expected = global_counts(totals, samples, sync)[0]
        w.scales = {k: _reciprocal(c) for k, c in w.expected.items()}
    elif sync.world_size > 1 and not fp16 and not sync.owns_step:  # DeepSpeed: 1 / N exactly
        w.scales = {"loss": 1.0}  # fp32 / bf16 do not overflow: no collective (slow links)
    else:
        # fp16: the labelled tokens (labels != -100) of a batch in the transformers convention
        labels: Any = batch.get("labels") if fp16 and isinstance(batch, Mapping) else None
        tokens = torch.is_tensor(labels) and labels.dim() >= 2 and not labels.is_floating_point()
        totals, n = global_counts({"loss": (labels != -100).sum()} if tokens else {}, samples, sync)
        w.scales = {"loss": 1.0 / clamp_count(totals.get("loss", n))}
        w.follow = "tensors" if fp16 and not tokens else ""


def follow(
    w: Window, count: Any, last: bool, sync: GradSync, grads: Callable[[], list[torch.Tensor]]
) -> None:
    """fp16 without counts known before: ``s = 1 / (count seen so far)``, rescaling the gradients
    already accumulated; on several ranks agreed at the backward that synchronises."""
    seen = w.count("loss") + count
    if last and sync.world_size > 1 and not w.deferred:  # DDP all-reduces in this backward
        seen = sync.all_reduce(torch.as_tensor(seen, dtype=torch.float64).reshape(()))
    scale = 1.0 / clamp_count(seen)
    if w.micro_batches:
        scale_grads_(grads(), scale / w.scales["loss"])  # type: ignore[index]
    w.scales["loss"] = scale  # type: ignore[index]


def global_counts(local: dict[str, Any], n: int, sync: GradSync) -> tuple[dict[str, Any], float]:
    """``local`` counts and the ``n`` samples summed over ranks (one all-reduce; none on one); the
    samples once where ranks hold shards of the same ones (Note [count groups] in ``_sync``)."""
    if sync.world_size == 1:
        return local, float(n)
    total = sync.all_reduce(stack_values([*local.values(), float(n)]))
    return dict(zip(local, total[:-1], strict=True)), float(total[-1]) / sync.replicas


def overflowed(
    w: Window, sync: GradSync, params: list[torch.Tensor], device: torch.device
) -> float | None:
    """After a window that followed its count in fp16: this rank's count when the gradients of
    ``params`` overflowed on any rank (the window is then redone at the exact scale), else
    ``None``."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads) if grads else [torch.zeros((), device=device)]
    bad = (~torch.isfinite(torch.stack([n.to(device) for n in norms]).sum())).to(torch.float64)
    local = stack_values([bad, w.count("loss")], device)
    any_bad = float(sync.all_reduce(local)[0]) if sync.world_size > 1 else float(bad)
    return float(local[1]) if any_bad else None


def scaled_sum(terms: Mapping[str, Any], scales: Mapping[str, Any]) -> torch.Tensor:
    """``Σ_k w_k · loss_sum_k · s_k`` over the ``Term`` s, multiplying only by factors that are
    not exactly 1."""
    factors = [(t.loss_sum, t.weight * scales[name]) for name, t in terms.items()]
    parts = [s if isinstance(f, float) and f == 1.0 else s * f for s, f in factors]
    return sum(parts[1:], parts[0])


def _reciprocal(count: Any) -> Any:
    """``1 / count``, or 0 where the count is 0: a term with no items in this window adds
    nothing, as in the full batch (its sum must be 0 too: Note [window checks])."""
    if isinstance(count, torch.Tensor):
        count = count.to(torch.float64)
        return torch.where(count > 0, 1.0 / count.clamp_min(1e-300), torch.zeros_like(count))
    return 1.0 / count if count > 0 else 0.0


def stack_values(values: Sequence[Any], device: torch.device | None = None) -> torch.Tensor:
    """Numbers and 0-dim tensors as one float64 vector (on ``device``, else the tensors' own)."""
    device = device or next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    return torch.stack(
        [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values]
    )


def clamp_count(count: torch.Tensor | float) -> torch.Tensor | float:
    """``max(count, 1)`` in float64, on the device for a tensor (no host sync)."""
    if isinstance(count, torch.Tensor):
        return count.to(torch.float64).clamp_min(1.0)
    return max(float(count), 1.0)

"""The plain full-batch step that every exactness test compares with.

Written the way a textbook would: one forward over the whole batch, the mean loss, one backward,
optional clipping, one optimizer step, one scheduler step. Nothing from bigbatch is used.
"""

from __future__ import annotations

import torch


def full_batch_step(model, optimizer, loss_fn, batch, scheduler=None, max_grad_norm=None):
    """One optimizer step on the whole batch; ``loss_fn`` returns a mean or (loss_sum, count)."""
    optimizer.zero_grad(set_to_none=True)
    out = loss_fn(model, batch)
    loss = out[0] / out[1] if isinstance(out, tuple) else out
    if isinstance(out, tuple) and not out[1]:  # nothing counted (every label ignored): a zero
        loss = out[0] * 0  # gradient and a loss of 0, as transformers' Trainer and Keras take it
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def max_relative_error(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest ``‖a - b‖ / ‖a‖`` over the parameter tensors (2-norms, per tensor)."""
    worst = 0.0
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        diff = torch.linalg.vector_norm(pa.detach() - pb.detach())
        worst = max(worst, float(diff / torch.linalg.vector_norm(pa.detach()).clamp_min(1e-30)))
    return worst

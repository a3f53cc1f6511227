"""The packing audit: a packed run's first window replayed unpacked, and the two compared.

Note [packing audit]
    Packing is exact only where nothing crosses a sample's boundary, and Note [packing traps]
    lists the crossings known today; a model can hold others (a layer that pools over its row, a
    loss that counts rows, a loss that does not shift its labels and so loses each sample's
    first one). So the first window of a packed ``Accumulator`` is computed twice before it is
    trained: micro-batch by micro-batch as packed (the rows of the cut, one row per micro-batch
    under ``"auto"``), and with the same micro-batches' samples unpacked (the batch's own
    padded rows, positions counted from each sample's first token), both in eval mode (dropout
    off: its masks differ with the layout) from the same weights, without stepping. The loss
    sums, the counts and the gradients of the two must agree at the rounding of the dtype they
    are computed in (the coarser of the parameters' and the loss's: transformers' causal LM loss
    computes in float32 whatever the model's dtype); else the run stops before its first step,
    naming what differed and by how much. It costs two forwards and backwards of one window,
    once. Each rank replays its own window on its own (a DDP model's module: nothing is
    communicated); a sharded model (FSDP, DeepSpeed) is not replayed: a rank alone cannot gather
    its parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from bigbatch.core._tree import take
from bigbatch.core._window import Piece
from bigbatch.core.loss import as_terms
from bigbatch.core.split import batch_size


def replay(model: torch.nn.Module, loss_fn: Callable, batch: Any, pieces: list[Piece]) -> None:
    """Compare the packed ``pieces`` of ``batch`` with their samples unpacked (Note [packing
    audit]); the model, its gradients and its mode are left as they were.

    Raises:
        ValueError: the two differ beyond rounding, naming what and by how much.
    """
    params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    mode, n = model.training, batch_size(batch)
    model.eval()
    try:
        packed = _sums(model, loss_fn, [p.batch for p in pieces], params)
        plain = [_positioned(take(batch, p.rows.tolist(), n)) for p in pieces]  # type: ignore[union-attr]
        unpacked = _sums(model, loss_fn, plain, params)
    finally:
        model.train(mode)
    finest = min((p.dtype for p in params), key=lambda d: torch.finfo(d).eps)
    # a loss computed coarser than the parameters rounds there (transformers' in float32)
    dtype = max((finest, packed[3], unpacked[3]), key=lambda d: torch.finfo(d).eps)
    tokens = sum(p.tokens or 0 for p in pieces)
    tolerance = max(1e-10, 8 * torch.finfo(dtype).eps * math.sqrt(max(tokens, 1)))
    named = ("count", "loss sum", "gradient")  # the likeliest cause first
    for what, a, b in zip(named, packed[:3], unpacked[:3], strict=True):
        gap = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))
        if not gap <= tolerance:
            raise ValueError(
                f"packing changed the first window: its {what} is {gap:.2g} (relative) off the "
                f"same samples unpacked (allowed: {tolerance:.1g}, the rounding of {dtype}). "
                + HINTS[what]
            )


CROSSING = (
    "Something crosses the samples' boundaries in a packed row (a layer that pools over the row "
    "or carries state along it, an attention that ignores position_ids: the packing traps of "
    "bigbatch.core._pack): do not pack this model, or keep its samples apart."
)
HINTS = {
    "loss sum": CROSSING,
    "count": "The loss counts another number of items packed: a loss that does not shift its "
    "labels loses each sample's first label, and one that counts rows counts packed rows; "
    "transformers' Trainer counts every label of a model whose loss_type it does not know, "
    "each sample's first too, which no token predicts (GPT-2's: set model.loss_type = "
    "'ForCausalLM'). Pack only a causal LM's shifted loss, counted from its labels.",
    "gradient": CROSSING,
}


def _sums(
    model: torch.nn.Module, loss_fn: Callable, batches: list[Any], params: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    """The count, the loss sum and the flat gradient of the loss sum over ``batches``, each
    term's sum weighted (named terms: their weights), and the dtype the loss was summed in."""
    total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    grads = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for mb in batches:
        terms = as_terms(loss_fn(model, mb), batch_size(mb))
        loss: torch.Tensor = sum(t.loss_sum * t.weight for t in terms.values())  # type: ignore[assignment]
        found = torch.autograd.grad(loss, params, allow_unused=True)  # type: ignore[arg-type]
        grads = [
            g if d is None else g + d.to(torch.float64) for g, d in zip(grads, found, strict=True)
        ]
        total += float(loss.detach())
        count += sum(float(t.count) for t in terms.values())
    flat = torch.cat([g.reshape(-1) for g in grads])
    return count, total, flat, loss.dtype


def _positioned(batch: Any) -> Any:
    """``batch`` with each sample's positions counted from its first attended token (as packing
    counts them), where it has an attention mask and no positions of its own."""
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if mask is None or "position_ids" in batch:
        return batch
    return {**batch, "position_ids": (mask.long().cumsum(-1) - 1).clamp_min(0)}

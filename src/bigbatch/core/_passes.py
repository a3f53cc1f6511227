"""Passes over a window's pieces before its main pass: counts, batch statistics, representations.

Note [passes before the window]
    Some windows need a value of the whole window before the first backward: the counts of a
    loss of several terms (each term is divided by its own total: Note [named terms]), batch
    statistics (``stats_fn``), every sample's representation (``cached_loss``). ``prepass`` runs
    ``fn`` on every piece under ``torch.no_grad()`` (no activations kept), recording the random
    state before each piece and putting the buffers back afterwards, so the main pass starts
    from the same state, moves BatchNorm statistics once, and restoring ``states[i]`` before piece
    ``i`` gives it the dropout masks it drew in the pre-pass (a later pass, or the main pass, does
    that). On several ranks a pre-pass is followed by a
    collective (the totals, the gathered representations), so its outcome is agreed first
    (``agree``): if one rank failed, every rank raises, an out-of-memory error when it was one, and
    the runner redoes the window everywhere instead of leaving ranks waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from bigbatch.core import _rng
from bigbatch.core._sync import GradSync
from bigbatch.core._tree import map_tensors, tensor_leaves
from bigbatch.core.oom import is_out_of_memory

T = TypeVar("T")


def prepass(
    state: torch.nn.Module | Sequence[torch.Tensor],
    pieces: Sequence[Any],
    fn: Callable[[Any], T],
    device: torch.device,
    states: Sequence[_rng.RngState] | None = None,
) -> tuple[list[T], list[_rng.RngState]]:
    """``fn`` on every piece without gradients; the random state before each (with ``states``:
    the one an earlier pass recorded, replayed); the mutable ``state`` (a module's buffers, or
    the tensors an ``Accumulator`` tracks) put back.

    Note [passes before the window]. The random state afterwards is the one after the pass.
    """
    tensors = list(state.buffers()) if isinstance(state, torch.nn.Module) else list(state)
    saved = [b.detach().clone() for b in tensors]
    recorded, outputs = [], []
    try:
        with torch.no_grad():
            for i, piece in enumerate(pieces):
                if states is not None:
                    _rng.restore(states[i], device)
                recorded.append(_rng.capture(device))
                outputs.append(fn(piece))
    finally:  # also after a failure: a redone window starts from the same buffers
        with torch.no_grad():
            for b, value in zip(tensors, saved, strict=True):
                b.copy_(value)
    return outputs, recorded


def agree(
    failure: BaseException | None, group: Any = None, world_size: int = 1, device: Any = "cpu"
) -> None:
    """Every rank of ``group`` learns whether a pre-pass failed anywhere; raise on all if one did.

    Note [passes before the window]. One small all-reduce on several ranks; nothing on one.
    """
    failed, oom = failure is not None, failure is not None and is_out_of_memory(failure)
    if world_size > 1:
        flags = torch.tensor([float(failed), float(oom)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        failed, oom = map(bool, flags.tolist())
    if failure is not None:
        raise failure
    if failed:
        what = "another rank failed before the window's collective; this rank stops it too"
        raise torch.OutOfMemoryError(what) if oom else RuntimeError(what)


def total_stats(outputs: Sequence[Any], sync: GradSync, name: str = "stats_fn") -> Any:
    """The pieces' statistics summed, then summed over ranks (one all-reduce): the structure of
    the first piece's (a tensor or a mapping / tuple of tensors), each leaf in its own dtype.

    Raises:
        TypeError: a piece's statistics hold no tensor, or not the same structure as the first's.
    """
    leaves = [[t for _, t in tensor_leaves(out)] for out in outputs]
    paths = [p for p, _ in tensor_leaves(outputs[0])]
    if not paths or any(len(found) != len(paths) for found in leaves):
        raise TypeError(
            f"{name} must return additive statistics: a tensor, or a dict / tuple of tensors, the "
            f"same structure for every micro-batch (got {type(outputs[0]).__name__})."
        )
    sums = [sum(parts[1:], parts[0].detach()) for parts in zip(*leaves, strict=True)]
    if sync.world_size > 1:
        flat = sync.all_reduce_sum(torch.cat([s.reshape(-1).to(torch.float64) for s in sums]))
        sums = [
            v.view_as(s).to(s.dtype)
            for v, s in zip(flat.split([s.numel() for s in sums]), sums, strict=True)
        ]
    found = iter(sums)
    return map_tensors(lambda _: next(found), outputs[0])


def with_stats(loss_fn: Any, stats: Any, model: torch.nn.Module, micro_batch: Any) -> Any:
    """``loss_fn`` with the window's statistics (``train_step(..., stats_fn=...)``)."""
    return loss_fn(model, micro_batch, stats)

"""Gradient-synchronisation control per micro-batch, and the window's global count.

The only ``torch.distributed`` calls the engine makes live here. One small object is chosen
once per model by ``make_sync`` (the single place that looks at the model's wrapper type):

* ``LocalSync``: a plain module; nothing to synchronise.
* ``DDPSync``: ``DistributedDataParallel``; every micro-batch but the window's last runs
  forward *and* backward under ``no_sync()`` so gradients are all-reduced once per step.
* ``FSDPSync``: ``fully_shard`` (FSDP2, ``set_requires_gradient_sync``) or the older
  ``FullyShardedDataParallel`` wrapper (``no_sync()``).

Note [global normalisation]
    DDP and FSDP *average* gradients over ranks: after the sync each rank holds
    ``(1/W) Σ_r ∇loss_sum_r``. The exact gradient of the global mean is
    ``Σ_r ∇loss_sum_r / Σ_r count_r``, so the engine multiplies by ``W / Σ_r count_r``, with the
    counts summed over ranks by one small all-reduce per optimizer step. Ranks may hold
    different numbers of tokens or samples.

Note [micro-batches per rank]
    With DDP, ranks may run different numbers of micro-batches per window (10 samples cut
    4 + 4 + 2 on one rank, 7 cut 4 + 3 on another): forwards under ``no_sync()`` talk to no
    other rank and each rank syncs once, on its last. Two exceptions need the SAME number of
    micro-batches on every rank, or a rank waits forever in a collective: FSDP (every forward
    all-gathers the parameters) and DDP with module buffers and ``broadcast_buffers=True``
    (every forward broadcasts them, e.g. BatchNorm statistics). An equal per-rank batch, which
    ``bigbatch.distributed`` gives, is enough.

Note [FSDP and no_sync memory]
    Skipping FSDP's reduce-scatter keeps each micro-batch's *unsharded* gradients until the
    window's last micro-batch: up to the full model's gradient size per rank, which is what
    sharding was meant to avoid. To keep only sharded gradients, sync every micro-batch through
    the low-level path (``with acc.micro_batch(last=True):`` for each one): still exact (the
    reduce-scatters of the micro-batches sum to the same gradient), k times the traffic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist


class GradSync(Protocol):
    """How gradients are synchronised across ranks for one micro-batch."""

    world_size: int

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-batch's forward and backward; ``last`` syncs gradients."""
        ...

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum ``values`` over ranks (identity on one process)."""
        ...

    def backward_scale(self, first_count: torch.Tensor | float) -> torch.Tensor | float:
        """The window's constant loss multiplier ``c`` (Note [backward scale])."""
        ...


class LocalSync:
    """A model on one process: no synchronisation."""

    world_size = 1

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        yield

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def backward_scale(self, first_count: torch.Tensor | float) -> torch.Tensor | float:
        if isinstance(first_count, torch.Tensor):
            return 1.0 / first_count.clamp_min(1)
        return 1.0 / max(first_count, 1.0)


class _RankSync:
    """Shared by the distributed variants: the rank group and the sum all-reduce."""

    def __init__(self, group: object | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)  # type: ignore[arg-type]

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)  # type: ignore[arg-type]
        return values

    def backward_scale(self, first_count: torch.Tensor | float) -> float:
        return 1.0


class DDPSync(_RankSync):
    """``DistributedDataParallel``: skip the all-reduce on all but the window's last micro-batch."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(getattr(model, "process_group", None))
        self.model = model

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if last else self.model.no_sync()  # type: ignore[operator]


class FSDPSync(_RankSync):
    """FSDP2 (``fully_shard``) or FSDP1: reduce-scatter only on the window's last micro-batch."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(None)
        self.model = model

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(last)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        elif last:
            yield
        else:
            with self.model.no_sync():  # type: ignore[operator]
                yield


def make_sync(model: torch.nn.Module) -> GradSync:
    """Pick the gradient-sync control for ``model`` (the one wrapper-type test in bigbatch)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return DDPSync(model)
    if _is_fsdp(model):
        return FSDPSync(model)
    return LocalSync()


def _is_fsdp(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - builds without distributed
        return False
    if isinstance(model, FullyShardedDataParallel):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
        except ImportError:
            return False
    return isinstance(model, FSDPModule)

"""Gradient-synchronisation control per micro-batch, and the window's global count.

The only ``torch.distributed`` calls the engine makes live here. One small object is chosen
once per model by ``make_sync`` (the single place that looks at the model's wrapper type):

* ``GradSync``: a plain module; nothing to synchronise (and the interface of the others).
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
    ``bigbatch.distributed.launch`` gives, is enough.

Note [auto micro-batch across ranks]
    With ``micro_batch_size="auto"`` an out-of-memory error on ONE rank must not leave another
    waiting in a collective (the deadlock Composer hit: one rank dies in DDP's backward while
    the other sits in the bucket all-reduce). So in distributed auto mode (DDP only):

    1. every micro-batch of ``train_step``, the last included, runs under ``no_sync()``
       (``defers_sync``): no rank communicates while any rank may still run out of memory;
    2. after the window, each rank, finished or failed, joins ONE small all-reduce (MAX) of
       ``-failed_size`` (``agree_on_oom``): if any rank failed, every rank learns the smallest
       failed size, discards its window, adopts the same smaller micro-batch and redoes the
       window; nobody is left behind;
    3. otherwise ``step`` all-reduces the accumulated gradients once, in place (``reduce_grads``:
       no extra memory; a parameter without a gradient on some rank takes part with zeros, so
       every rank makes the same calls), and averages them like DDP does.

    The low-level path (``micro_batch(last=True)`` + ``step``) is not retried and syncs on
    ``last=True`` as usual. The price: DDP's bucketing overlap and any registered communication
    hook are bypassed in auto mode (one all-reduce per parameter tensor, all in flight at once).
    An out-of-memory error inside that all-reduce or in the optimizer step is not retried (the
    engine never retries the step). FSDP cannot be made safe this way (each forward all-gathers,
    so a rank failing mid-forward strands the others), and DDP broadcasting module buffers each
    forward has the same problem: both are refused in distributed auto mode with the fix in the
    message. Only out-of-memory errors are agreed on: any other error on one rank is raised there
    and the other ranks wait in the agreement all-reduce until the launcher (torchrun) stops them.

Note [several forwards]
    A loop may run the forwards of several micro-batches before their backwards (accelerate
    tests this pattern). DDP decides in the *forward* whether the next backward all-reduces, so
    the forward under ``micro_batch(last=True)`` would make the FIRST backward that follows sync,
    with only its own micro-batch's gradient (23% off, measured). The engine notices the pattern
    (a ``micro_batch()`` context left without a backward inside it): from then on the window's
    forwards all run under ``no_sync()`` and ``step`` all-reduces the gradients once
    (``reduce_grads``, ``deferred``), so the sync belongs to no particular backward. FSDP decides
    in the backward itself (``set_requires_gradient_sync`` / ``no_sync`` are read when the
    gradients are reduced), so a backward outside the context syncs: exact, with one
    reduce-scatter per micro-batch.

Note [count groups]
    Under context (sequence) parallelism the ranks of a "cp" group hold shards of the SAME
    sequences; the backend reduces the gradients over data x context ranks (FSDP over torchtitan's
    and accelerate's ``dp_shard_cp``, DDP over a flattened ``("dp", "cp")`` mesh). The window's
    count must then count every token once: each rank returns its shard's ``(loss_sum, count)``
    and the counts are summed over all dp x cp ranks (as for data parallelism: W / C undoes the
    averaging over the W = dp·cp ranks), while the *samples* are the same on the cp ranks of one
    dp index and are summed once (divided by the cp size). A loss returned as a mean has no count
    of its own, only the samples, so it is refused there. The declaration is
    ``count_group=mesh``, a ``DeviceMesh`` naming its ``"cp"`` dimension, covering the ranks the
    backend reduces over. A backend whose device mesh (DDP's ``device_mesh``, FSDP2's parameters'
    mesh) was cut from a mesh with a ``"cp"`` dimension, with no ``count_group``, is refused: the
    engine cannot tell shard counts from counts of the whole sequences (which would be summed
    ``cp`` times: Megatron-LM PR #7513, prime-rl PR #2562).

Note [FSDP and no_sync memory]
    Skipping FSDP's reduce-scatter keeps each micro-batch's *unsharded* gradients until the
    window's last micro-batch: up to the full model's gradient size per rank, which is what
    sharding was meant to avoid. To keep only sharded gradients, sync every micro-batch through
    the low-level path (``with acc.micro_batch(last=True):`` for each one): still exact (the
    reduce-scatters of the micro-batches sum to the same gradient), k times the traffic.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from bigbatch.core._precision import Precision, make_precision
from bigbatch.core._stepping import check_step

_NULL = contextlib.nullcontext()  # reusable: it holds no state
COUNTS_FIRST = (
    "under DeepSpeed each backward carries 1 / the window's count, which must be known before the "
    "first one (ZeRO keeps the gradients out of .grad, Note [DeepSpeed windows]): use "
    "acc.train_step(batch, loss_fn) (count_fn=... to skip its count pass)."
)
SHARDS_NEED_SUMS = (
    "with count_group's 'cp' dimension ranks hold shards of the same samples, and a mean has no "
    "count but the samples: return the shard's (loss_sum, count) (Note [count groups])."
)


class GradSync:
    """How gradients are synchronised across ranks, chosen once per model by ``make_sync``: the
    interface, and the plain module's control (one process, nothing to synchronise)."""

    world_size = 1
    defers_sync = False  # train_step never syncs in a backward: step() calls reduce_grads
    can_defer = False  # reduce_grads is possible (Note [several forwards])
    # True: every rank must run as many forwards (Note [micro-batches per rank])
    equal_micro_batches = False
    owns_step = False  # the backend's engine steps: the backward carries 1 / C (core._deepspeed)
    replicas = 1  # ranks holding the same samples (shards of their sequences: Note [count groups])

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-batch's forward and backward; ``last`` syncs gradients."""
        return _NULL

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The ``op`` (``"sum"`` or ``"max"``) of ``values`` over ranks, in float64 on the model's
        device (identity on one process)."""
        return values

    def agree_on_terms(self, output: Any) -> None:
        """Refuse, on every rank, a window whose ranks' loss returned other named terms (their
        totals' all-reduces would not pair up: gloo aborts both ranks); one small all-reduce
        per window on several ranks, nothing on one."""

    def agree_on_oom(self, failed_size: int | None, measured: bool) -> tuple[int | None, bool]:
        """The smallest micro-batch size that ran out of memory on any rank, or ``None``, and
        whether every such failure was a budget reading (no allocator failed anywhere).

        ``failed_size`` is this rank's (``None`` when its window completed). A collective in
        distributed auto mode (Note [auto micro-batch across ranks]); else the arguments.
        """
        return failed_size, measured

    def reduce_grads(self, params: list[torch.Tensor]) -> None:
        """All-reduce and average the gradients of ``params`` now (a deferred window's sync)."""

    def refuse_grads(self) -> None:
        """Refuse gradients added to ``.grad`` by hand (``Accumulator.accumulate_grads``).

        Raises:
            ValueError: FSDP on several ranks (its gradients are sharded), or DeepSpeed (its own).
        """
        if (self.world_size > 1 or self.owns_step) and not self.can_defer:
            raise ValueError(
                "accumulate_grads() cannot add gradients to an FSDP model or a DeepSpeed engine "
                "(they are sharded, or the engine's): express them as a loss and call backward()."
            )

    def settings(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        max_grad_norm: Any,
        nonfinite: Any,
    ) -> tuple[Any, float | None, str]:
        """The step's settings ``(scheduler, max_grad_norm, nonfinite)``, checked: ``check_step``
        (a backend whose engine steps checks them against its own)."""
        return check_step(model, optimizer, scheduler, max_grad_norm, nonfinite)

    def precision(self, precision: object, device: torch.device) -> Precision:
        """The ``Precision`` for ``precision=`` (a backend that casts the model gives its own)."""
        return make_precision(precision, device)


class RankSync(GradSync):
    """Shared by the distributed variants: the rank group, the all-reduces, the agreement."""

    equal_micro_batches = True  # FSDP all-gathers in every forward

    def __init__(self, model: torch.nn.Module, group: object | None, auto: bool) -> None:
        self.model, self.group = model, group
        self.world_size = dist.get_world_size(group)  # type: ignore[arg-type]  # None: the world
        # Note [auto micro-batch across ranks]: nothing syncs before every rank's window ended
        self.auto = self.defers_sync = auto and self.world_size > 1

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        values = values.to(next(self.model.parameters()).device, torch.float64, copy=True)
        dist.all_reduce(values, op=getattr(dist.ReduceOp, op.upper()), group=self.group)  # type: ignore[arg-type]
        return values

    def agree_on_terms(self, output: Any) -> None:
        if self.auto:  # Note [auto micro-batch across ranks]: no collective inside a window
            return
        names = sorted(map(str, output)) if isinstance(output, Mapping) else ["loss"]
        mine = [float(len(names)), float(zlib.crc32("\0".join(names).encode()))]
        found = self.all_reduce(torch.tensor([*mine, *(-v for v in mine)]), "max").tolist()
        if found[:2] != [-v for v in found[2:]]:  # the largest and the least differ
            raise ValueError(
                f"the ranks' loss_fn returned other named terms (rank {dist.get_rank()}: "
                f"{', '.join(names)}): return the same terms on every rank; a term with nothing "
                "to count on a rank returns (its sum * 0, 0)."
            )

    def agree_on_oom(self, failed_size: int | None, measured: bool) -> tuple[int | None, bool]:
        if not self.auto:
            return failed_size, measured
        allocator_failed = float(failed_size is not None and not measured)
        local = torch.tensor([-(failed_size or torch.inf), allocator_failed], dtype=torch.float64)
        neg_failed, any_allocator = self.all_reduce(local, "max").tolist()
        return (None if neg_failed == -torch.inf else int(-neg_failed)), not any_allocator


class DDPSync(RankSync):
    """``DistributedDataParallel``: skip the all-reduce on all but the window's last micro-batch.

    In distributed auto mode ``train_step`` runs every micro-batch without it, the ranks agree on
    out-of-memory errors and ``step`` all-reduces once (Note [auto micro-batch across ranks]); the
    low-level path keeps syncing on ``last=True`` unless the forwards run before the backwards
    (Note [several forwards]).
    """

    can_defer = True

    def __init__(self, model: torch.nn.Module, auto: bool = False) -> None:
        super().__init__(model, getattr(model, "process_group", None), auto)
        self.equal_micro_batches = bool(model.broadcast_buffers and list(model.buffers()))
        if self.auto and self.equal_micro_batches:
            raise ValueError(
                'micro_batch_size="auto" on several ranks cannot use DDP broadcasting buffers every '
                "forward (a rank out of memory strands the rest): use DistributedDataParallel(model, "
                "broadcast_buffers=False), or use a fixed micro_batch_size."
            )

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if last else self.model.no_sync()  # type: ignore[operator]

    def reduce_grads(self, params: list[torch.Tensor]) -> None:
        for p in params:  # every rank all-reduces every parameter, in the same order
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        works = [dist.all_reduce(g, group=self.group, async_op=True) for g in grads]  # type: ignore[arg-type]
        for work in works:
            work.wait()  # type: ignore[union-attr]  # async_op=True returns a Work
        torch._foreach_div_(grads, self.world_size)  # type: ignore[arg-type]  # averaged, as DDP does


class FSDPSync(RankSync):
    """FSDP2 (``fully_shard``) or FSDP1: reduce-scatter only on the window's last micro-batch."""

    def __init__(self, model: torch.nn.Module, auto: bool = False) -> None:
        super().__init__(model, None, auto)
        if self.auto:
            raise ValueError(
                f'micro_batch_size="auto" is not supported with FSDP on {self.world_size} ranks: '
                "every forward all-gathers the parameters, so a rank out of memory would strand "
                "the others. Use a fixed micro_batch_size (Note [auto micro-batch across ranks])."
            )

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:  # type: ignore[override]
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)  # type: ignore[operator]
        else:
            with contextlib.nullcontext() if last else self.model.no_sync():  # type: ignore[operator]
                yield


def make_sync(model: torch.nn.Module, auto: bool = False, count_group: Any = None) -> GradSync:
    """Pick the gradient-sync control for ``model`` (the one wrapper-type test in bigbatch).

    Args:
        model: a plain module, a ``DistributedDataParallel``, an FSDP model or a DeepSpeed engine.
        auto: the engine sizes micro-batches itself (``micro_batch_size="auto"``).
        count_group: a ``DeviceMesh`` with a ``"cp"`` dimension (Note [count groups]), or ``None``.

    Raises:
        ValueError: ``auto`` on several ranks with FSDP, or with DDP broadcasting buffers; a
            DeepSpeed engine bigbatch cannot step exactly (``bigbatch.core._deepspeed``); a
            ``count_group`` that is missing or does not fit the backend (Note [count groups]).
    """
    from bigbatch.core._deepspeed import DeepSpeedSync  # it builds on RankSync, below

    kind = {"ddp": DDPSync, "fsdp": FSDPSync, "deepspeed": DeepSpeedSync}.get(wrapper_kind(model))
    sync = kind(model, auto) if kind is not None else GradSync()
    sync.replicas = shards(model, count_group, sync.world_size)
    return sync


def shards(model: torch.nn.Module, count_group: Any, world_size: int) -> int:
    """The ranks holding shards of the same samples: ``count_group``'s ``"cp"`` size (Note [count
    groups]); 1 without one, where the backend's mesh has no ``"cp"`` dimension either.

    Raises:
        ValueError: the backend's mesh has one and no ``count_group`` was given, or a
            ``count_group`` without a ``"cp"`` dimension or over other ranks than the backend's.
    """
    mesh = getattr(model, "device_mesh", None) or getattr(
        next(model.parameters(), None), "device_mesh", None
    )
    seen = _cp_size(mesh._get_root_mesh()) if mesh is not None else 1  # DDP reads its root so too
    if count_group is None and seen > 1:
        raise ValueError(
            f"the model's device mesh has a 'cp' dimension of size {seen}: its ranks hold shards of "
            "the same sequences. Pass count_group=mesh (its 'dp' and 'cp' dimensions) and return "
            "each shard's (loss_sum, count), so that every token is counted once."
        )
    if count_group is None:
        return 1
    if _cp_size(count_group) == 0 or count_group.size() != world_size:
        raise ValueError(
            f"count_group={count_group!r} is not allowed: pass the DeviceMesh of the {world_size} "
            "rank(s) the model's gradients are reduced over, naming its 'cp' dimension, e.g. "
            "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'cp'))."
        )
    return _cp_size(count_group)


def _cp_size(mesh: Any) -> int:
    """The size of ``mesh``'s ``"cp"`` dimension; 0 where it has none (or is no mesh)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return mesh.size(names.index("cp")) if "cp" in names else 0


def wrapper_kind(model: torch.nn.Module) -> str:
    """``"ddp"``, ``"fsdp"`` (FSDP2 ``fully_shard`` or FSDP1), ``"deepspeed"`` (an engine of
    ``deepspeed.initialize``) or ``"plain"``: the one place in bigbatch that looks at a model's
    distributed wrapper type."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    if any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__):  # no import either
        return "deepspeed"
    # The FSDP1 wrapper, or FSDP2's FSDPModule (which moved in torch 2.6), found by class name:
    # no import, so builds without torch.distributed and every torch version answer the same.
    fsdp = {"FullyShardedDataParallel", "FSDPModule"}
    return "fsdp" if any(c.__name__ in fsdp for c in type(model).__mro__) else "plain"

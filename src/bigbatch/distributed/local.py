"""Local accumulation across ranks: λ exact local optimizer steps, then one all-reduce.

Layer 2, built on the engine. ``LocalAccumulation`` is for several ranks on a slow network: each
rank takes ``local_steps`` ordinary, exact ``Accumulator`` steps on its own share with no
communication, then the ranks combine what they learned with ONE all-reduce. It is the
synchronous form of Accumulated Gradient Normalization (Hermans, Spanakis and Möckel, ACML 2017,
arXiv:1710.02368). Re-exported as ``bigbatch.distributed.LocalAccumulation``.

Note [accumulated gradient normalisation]
    A round starts with every rank at the same parameters ``θ_start``. Rank ``r`` takes ``λ``
    inner optimizer steps on its own data (each an exact micro-batched ``Accumulator`` step of a
    plain module: no gradient all-reduce) and ends at ``θ_r``. Its accumulated update,
    normalised by the number of steps as in the paper,

        Δ_r = (θ_r − θ_start) / λ

    is for plain SGD ``−η`` times the mean of the ``λ`` gradients it stepped on: the paper's
    normalised accumulated gradient, on the scale of ONE step. The ranks' updates are averaged,
    weighted by the samples or tokens ``c_r`` each consumed in the round,

        Δ = Σ_r c_r Δ_r / Σ_r c_r,

    in one all-reduce of a flat bucket, and the outer rule applies ``Δ`` to ``θ_start``: it is
    ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)`` stepping on the
    pseudo-gradient ``−Δ`` (plain: ``θ_start + outer_lr·Δ``; with momentum, the outer rule that
    later local-SGD work such as DiLoCo uses). Every rank continues from the new ``θ_start``.

    Why count weights: with ``λ = 1``, the plain rule and ``outer_lr = 1`` this IS the exact
    data-parallel step for SGD, unequal shares included. ``Δ_r = −η g_r`` where ``g_r`` is the
    mean gradient of rank r's share, and ``Σ c_r g_r / Σ c_r`` is the gradient of the global
    mean, which is what the ``Accumulator`` on a DDP model steps on (Note [global
    normalisation] in ``bigbatch.core._sync``). It stays exact for updates that are linear in the
    gradient (SGD with momentum, Nesterov, weight decay) when each rank's share has the same
    size every step (constant weights); Adam's update is not linear in the gradient, so with
    Adam ``λ = 1`` is a different algorithm (use DDP for the exact step).

    The other scales, for comparison: ``outer_lr = λ`` makes ``θ_start`` the count-weighted
    average of the ranks' parameters (local SGD; PyTorch's post-local SGD averages the same,
    unweighted). The paper's parameter server ADDS each worker's normalised update as it
    arrives, so W workers move it by W updates per round: with equal shares that sum is
    ``outer_lr = W`` here. DiLoCo's outer Nesterov step (learning rate 0.7 on the unnormalised
    ``θ_start − mean θ_r``) is ``outer_lr = 0.7 λ, outer_momentum = 0.9, nesterov = True``.

Note [buffers at the outer step]
    Buffers (BatchNorm running statistics) are folded into the same all-reduce, so after every
    outer step all ranks hold the same model and rank 0's file is every rank's state: floating
    buffers become the count-weighted mean of the ranks' values (a running mean becomes the
    pooled mean; a running variance the mean of the ranks' variances, leaving out the spread
    between their means), integer buffers (``num_batches_tracked``) the mean over ranks,
    rounded. Inner optimizer state (momentum, Adam moments) is NOT averaged: it stays local, as
    in the paper and in DiLoCo.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from bigbatch.core._sync import wrapper_kind
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.engine import Accumulator, CountFn, StepResult
from bigbatch.core.loss import LossFn
from bigbatch.core.split import Batch

STATE_FORMAT = 1
NOTHING_COUNTED = (
    "a round of {k} local step(s) counted nothing on any rank (every label ignored, every "
    "sample masked): its zero-gradient steps are averaged with equal weights across ranks."
)


@dataclass(frozen=True)
class OuterStepResult:
    """What one outer step (the round's all-reduce) did.

    Attributes:
        loss: mean loss over every inner step of the round on every rank,
            ``Σ loss_sum / Σ count``.
        count: samples (or tokens) the round consumed, summed over the ranks.
        local_steps: inner steps the round took (``local_steps``, or fewer when ended early).
        update_norm: 2-norm of the averaged normalised update ``Δ`` (before the outer rule).
    """

    loss: float
    count: float
    local_steps: int
    update_norm: float


@dataclass(frozen=True)
class LocalStepResult:
    """One inner step, and the outer step when it ended the round.

    Attributes:
        step: this rank's inner ``StepResult`` (its loss and count are this rank's share only).
        outer: the round's ``OuterStepResult`` after every ``local_steps``-th step, else ``None``.
    """

    step: StepResult
    outer: OuterStepResult | None = None


# Where this rank is in the round: inner steps taken, and their count and loss sums.
_Round = namedtuple("_Round", "steps count loss_sum", defaults=(0, 0.0, 0.0))


class LocalAccumulation:
    """λ exact local optimizer steps per rank, then one count-weighted all-reduce of the updates.

    Each rank trains its own replica of a PLAIN module (not DDP) with an ``Accumulator``: exact
    micro-batched steps, no communication. After every ``local_steps`` steps the ranks' updates
    ``(θ_r − θ_start) / λ`` are averaged, weighted by each rank's samples or tokens in the round
    (so unequal shares are exact at ``λ = 1``), in one all-reduce over a flat bucket, and applied
    to ``θ_start`` by the outer rule (Note [accumulated gradient normalisation]). Buffers are
    averaged in the same bucket (Note [buffers at the outer step]); the inner optimizer's state
    stays local. The ranks start from rank 0's parameters and buffers (one broadcast here, as
    DDP does). Every rank must take the same number of steps: the outer step is a collective.

    Args:
        model: the plain module (not ``DistributedDataParallel``/FSDP), built alike on every rank.
        inner_optimizer: the optimizer of the local steps, over ``model``'s parameters.
        local_steps: λ, inner optimizer steps per all-reduce (1 = one exchange per step).
        micro_batch_size: samples per micro-batch of the inner ``Accumulator`` (or ``"auto"``;
            each rank then sizes its own, with no collective). For a scheduler, clipping or
            precision build the ``Accumulator`` yourself: ``LocalAccumulation.from_accumulator``.
        outer_lr: scale of the averaged normalised update (1 with ``λ = 1``: the exact step).
        outer_momentum: momentum of the outer rule, in [0, 1) (0: the paper's plain form).
        nesterov: Nesterov momentum for the outer rule (needs ``outer_momentum > 0``).
        group: the process group (default: the whole job).

    Raises:
        ValueError: ``local_steps`` is not a whole number >= 1, a bad outer setting, or the
            optimizer holds parameters that are not ``model``'s.
        TypeError: ``model`` is wrapped in DDP or FSDP.
        RuntimeError: one process (no process group, or a group of one rank).

    Example:
        >>> local = LocalAccumulation(model, torch.optim.AdamW(model.parameters()),  # doctest: +SKIP
        ...                           local_steps=8, micro_batch_size=16)
        >>> for batch in my_share_of_each_global_batch:  # doctest: +SKIP
        ...     result = local.train_step(batch, loss_fn)
        ...     if result.outer is not None and distributed.is_main_process():
        ...         print(result.outer.loss)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        local_steps: int,
        *,
        micro_batch_size: int | str = 32,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        nesterov: bool = False,
        group: Any = None,
    ) -> None:
        accumulator = Accumulator(model, inner_optimizer, micro_batch_size=micro_batch_size)
        self._setup(accumulator, local_steps, outer_lr, outer_momentum, nesterov, group)

    @classmethod
    def from_accumulator(
        cls,
        accumulator: Accumulator,
        local_steps: int,
        *,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        nesterov: bool = False,
        group: Any = None,
    ) -> LocalAccumulation:
        """Wrap an ``Accumulator`` you built (scheduler, clipping, precision, memory budget).

        Its model must be the plain module; the scheduler steps once per INNER step.

        Example:
            >>> acc = Accumulator(model, opt, micro_batch_size=8, max_grad_norm=1.0)  # doctest: +SKIP
            >>> local = LocalAccumulation.from_accumulator(acc, local_steps=4)  # doctest: +SKIP
        """
        local = cls.__new__(cls)
        local._setup(accumulator, local_steps, outer_lr, outer_momentum, nesterov, group)
        return local

    def _setup(
        self,
        acc: Accumulator,
        local_steps: int,
        lr: float,
        momentum: float,
        nesterov: bool,
        group: Any,
    ) -> None:
        self.world_size = _check(acc, local_steps, lr, momentum, nesterov, group)
        self.accumulator, self.local_steps, self.group = acc, local_steps, group
        params = {n: p for n, p in acc.model.named_parameters() if p.requires_grad}
        self._names, self._params = list(params), list(params.values())
        self._buffers = list(acc.model.buffers())
        floats = [t.dtype for t in self._params + self._buffers if t.is_floating_point()]
        self._dtype = functools.reduce(torch.promote_types, floats, torch.float32)  # counts exact
        self._device = next((p.device for p in self._params), torch.device("cpu"))
        bucket, views = self._pack()  # the ranks start from rank 0's parameters and buffers
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(bucket, src=src, group=group)
        self._unpack(views)
        self._start = [p.detach().clone() for p in self._params]
        self.outer_optimizer = torch.optim.SGD(self._start, lr, momentum, nesterov=nesterov)
        self.outer_steps, self._round = 0, _Round()

    # ------------------------------------------------------------------ training
    @property
    def at_boundary(self) -> bool:
        """``True`` between rounds: every rank holds the same model (snapshots go here)."""
        return self._round.steps == 0

    def train_step(
        self, batch: Batch, loss_fn: LossFn, *, count_fn: CountFn | None = None
    ) -> LocalStepResult:
        """One exact inner step on this rank's ``batch``; the outer step after every λ-th.

        Args:
            batch: this rank's share of the global batch (any size; shares may differ).
            loss_fn: ``loss_fn(model, micro_batch)``, as for ``Accumulator.train_step``.
            count_fn: optional ``count_fn(micro_batch)``, as for ``Accumulator.train_step``
                (what the loss will count, e.g. tokens; this rank's micro-batches only).

        Returns:
            The inner ``StepResult`` and, when this step ended the round, the outer step's.

        Raises:
            As ``Accumulator.train_step``; a failed inner step changes nothing here either.
        """
        return self._after_inner(self.accumulator.train_step(batch, loss_fn, count_fn=count_fn))

    def step(self) -> LocalStepResult:
        """The inner step of your own loop (after ``local.accumulator.backward(...)`` calls).

        Example:
            >>> for i, mb in enumerate(micro_batches):  # doctest: +SKIP
            ...     with local.accumulator.micro_batch(last=i == len(micro_batches) - 1):
            ...         local.accumulator.backward(*my_loss(model, mb))
            >>> local.step()  # doctest: +SKIP
        """
        return self._after_inner(self.accumulator.step())

    def _after_inner(self, result: StepResult) -> LocalStepResult:
        r, c = self._round, result.count
        self._round = r = _Round(r.steps + 1, r.count + c, r.loss_sum + result.loss * c)
        return LocalStepResult(result, self.outer_step() if r.steps == self.local_steps else None)

    @torch.no_grad()
    def outer_step(self) -> OuterStepResult:
        """End the round now: average the normalised updates (ONE all-reduce) and apply them.

        ``train_step`` calls it after every ``local_steps``-th step; call it yourself to end a
        shorter round (at the end of training, so every rank holds the same model). A round of
        ``k`` steps is normalised by ``k``. A collective: every rank must call it together.

        Raises:
            RuntimeError: no inner step was taken in this round.
        """
        k = self._round.steps
        if k == 0:
            raise RuntimeError(
                "outer_step() called at the start of a round: take at least one inner step "
                "(train_step or step) first; the ranks already hold the same model."
            )
        bucket, views = self._pack(self._round.count, self._round.loss_sum)
        dist.all_reduce(bucket, group=self.group)  # the one collective of the round
        c, loss_sum = bucket[-2:].tolist()  # summed over the ranks
        weight = c
        if c == 0:  # no rank counted anything: the ranks' updates weigh alike (one more reduce)
            warnings.warn(NOTHING_COUNTED.format(k=k), BigBatchWarning, stacklevel=2)
            bucket, views = self._pack(1.0, 0.0)
            dist.all_reduce(bucket, group=self.group)
            weight = bucket[-2].item()  # the ranks
        update = bucket[: sum(p.numel() for p in self._params)].mul_(-1.0 / (weight * k))  # −Δ
        update_norm = float(torch.linalg.vector_norm(update))
        for s, g in zip(self._start, views, strict=False):
            s.grad = g.view_as(s).to(s.dtype)
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        buffers = zip(self._buffers, views[len(self._params) : -1], strict=True)
        W = self.world_size  # Note [buffers at the outer step]: count-weighted means
        means = [v / weight if b.is_floating_point() else (v / W).round() for b, v in buffers]
        self._unpack([*self._start, *means])
        self.outer_steps, self._round = self.outer_steps + 1, _Round()
        return OuterStepResult(loss_sum / c if c else 0.0, c, k, update_norm)

    @torch.no_grad()
    def _pack(
        self, count: float | None = None, loss_sum: float = 0.0
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One flat tensor and its views: [θ | buffers], or for a round's end (``count`` c given)
        [c·(θ − θ_start) | c·floating buffers | integer buffers | c, loss_sum]."""
        tensors, end = self._params + self._buffers, [] if count is None else [count, loss_sum]
        sizes = [t.numel() for t in tensors] + [len(end)]
        bucket = torch.empty(sum(sizes), dtype=self._dtype, device=self._device)
        views = list(bucket.split(sizes))
        views[-1].copy_(torch.tensor(end, dtype=self._dtype))
        for j, (view, t) in enumerate(zip(views, tensors, strict=False)):
            view.copy_(t.reshape(-1))
            if count is not None and j < len(self._start):
                view.sub_(self._start[j].reshape(-1))
            if count is not None and t.is_floating_point():
                view.mul_(count)
        return bucket, views

    @torch.no_grad()
    def _unpack(self, values: list[torch.Tensor]) -> None:
        """Copy ``values`` into the parameters, then the buffers."""
        for t, v in zip(self._params + self._buffers, values, strict=False):
            t.copy_(v.view_as(t))

    # ------------------------------------------------------------------ snapshots
    def state_dict(self) -> dict[str, Any]:
        """θ_start, the outer rule's state and the round position, taken between rounds.

        The inner optimizer's state is not in it (it differs per rank: snapshot it per rank).

        Raises:
            RuntimeError: in the middle of a round (the ranks hold different parameters).
        """
        if not self.at_boundary:
            raise RuntimeError(
                f"state_dict() in the middle of a round ({self._round.steps} of "
                f"local_steps={self.local_steps} inner steps taken): the ranks' parameters differ "
                "until the outer step; take it when local.at_boundary, or after local.outer_step()."
            )
        start = {n: s.clone() for n, s in zip(self._names, self._start, strict=True)}
        return {
            "format": STATE_FORMAT,
            "local_steps": self.local_steps,
            "outer_steps": self.outer_steps,
            "round_step": self._round.steps,
            "start": start,
            "outer_optimizer": self.outer_optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: θ_start (copied into the model too) and the outer state.

        Any round in progress is dropped; load the inner optimizer's own state separately.

        Raises:
            ValueError: the snapshot is of another format, another ``local_steps`` or model.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a LocalAccumulation state of format {STATE_FORMAT}: pass "
                "what LocalAccumulation.state_dict() returned."
            )
        saved = {n: tuple(t.shape) for n, t in state["start"].items()}
        mine = {n: tuple(s.shape) for n, s in zip(self._names, self._start, strict=True)}
        for wrong, message in (
            (
                state["local_steps"] != self.local_steps,
                f"the snapshot was taken with local_steps="
                f"{state['local_steps']} and this LocalAccumulation has local_steps="
                f"{self.local_steps}: resume with the same value.",
            ),
            (
                saved != mine,
                "the snapshot's parameters do not match this model's (e.g. "
                f"{sorted(set(saved.items()) ^ set(mine.items()))[:3]}): resume with the model the "
                "snapshot was taken from.",
            ),
        ):
            if wrong:
                raise ValueError(message)
        for name, s in zip(self._names, self._start, strict=True):
            s.copy_(state["start"][name])
        self._unpack(self._start)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.outer_steps, self._round = int(state["outer_steps"]), _Round()


# ---------------------------------------------------------------------- checks
def _check(
    accumulator: Accumulator,
    local_steps: int,
    outer_lr: Any,
    outer_momentum: Any,
    nesterov: Any,
    group: Any,
) -> int:
    """Refuse what ``LocalAccumulation`` cannot run, one error naming the argument (what is
    refused and why: docs/local_accumulation.md); returns the number of ranks."""
    _check_round(local_steps, outer_lr, outer_momentum, nesterov)
    _check_model(accumulator)
    return _world_size(local_steps, group)


def _check_round(local_steps: Any, outer_lr: Any, outer_momentum: Any, nesterov: Any) -> None:
    """The round's length and the outer rule: their types first, then their ranges."""
    for name, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name}={value!r} is not allowed: use a number.")
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov={nesterov!r} is not allowed: use True or False.")
    if type(local_steps) is not int or local_steps < 1:
        raise ValueError(
            f"local_steps={local_steps!r} is not allowed: use a whole number >= 1, the inner "
            "optimizer steps per all-reduce (1: the exact data-parallel step with SGD)."
        )
    if not 0 < outer_lr < math.inf:
        raise ValueError(
            f"outer_lr={outer_lr!r} is not allowed: use a positive finite number (1.0: Δ as is)."
        )
    if not 0 <= outer_momentum < 1:
        raise ValueError(
            f"outer_momentum={outer_momentum!r} is not allowed: use a number in [0, 1) (0: the "
            "plain rule; 0.9, nesterov=True: DiLoCo's)."
        )
    if nesterov and outer_momentum == 0:
        raise ValueError(
            "nesterov=True needs momentum: pass outer_momentum > 0 (e.g. 0.9), or nesterov=False."
        )


def _check_model(accumulator: Accumulator) -> None:
    """A plain module (no DDP, no FSDP), and an optimizer over its parameters only."""
    kind = wrapper_kind(accumulator.model)
    if kind == "ddp":
        raise TypeError(
            "LocalAccumulation needs the plain module, not a DistributedDataParallel, whose every "
            "backward all-reduces (the inner steps would not be local). Pass ddp.module: "
            "LocalAccumulation averages the updates itself."
        )
    if kind == "fsdp":
        raise TypeError(
            "LocalAccumulation does not support FSDP: a sharded model all-gathers in every forward "
            "and cannot step alone. Pass the plain module if it fits on one device, else use "
            "Accumulator on the FSDP model (one reduce-scatter a step)."
        )
    held = {id(p) for g in accumulator.optimizer.param_groups for p in g["params"]}
    foreign = len(held - {id(p) for p in accumulator.model.parameters()})
    if foreign > 0:
        raise ValueError(
            f"the inner optimizer holds {foreign} tensor(s) that are not parameters of the "
            "model: build it over model.parameters() (not a copy's)."
        )


def _world_size(local_steps: int, group: Any) -> int:
    """The ranks of ``group``; one process is refused (nothing to average)."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        raise RuntimeError(
            f"LocalAccumulation(local_steps={local_steps}) needs several ranks and this is one "
            "process (nothing to average): use bigbatch.Accumulator, or launch with "
            "`torchrun --nproc_per_node N`."
        )
    return world

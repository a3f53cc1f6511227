"""The window being accumulated, and what a failed or redone window must give back.

``Window`` is the running state between two optimizer steps, kept on the device (no host sync per
micro-batch). ``Backup`` holds what the forwards of a window change outside the gradients, so a
window that fails, or is redone at a smaller micro-batch, leaves no trace.

Note [window buffers]
    Forwards in training mode mutate module buffers: BatchNorm's running statistics and
    ``num_batches_tracked``, and any buffer a model updates in place (an EMA, a counter). A window
    redone after an out-of-memory error would otherwise move them twice, and one that raised
    half-way would leave them moved. So before each window ``Backup`` copies the buffers that can
    change, and ``restore`` puts them back together with the random generators (so a redone
    window also draws the same dropout masks). Which buffers can change is learned from the
    tensors' version counters (``Tensor._version`` grows on every in-place write): the first
    window copies every buffer, later windows only the buffers seen changing before (BatchNorm
    statistics always). A buffer that changes for the first time in a later window that then
    fails is not restored; no model known to us does that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.core import _rng
from bigbatch.core._batchnorm import batchnorm_layers
from bigbatch.core._sync import GradSync
from bigbatch.core.loss import check_count


@dataclass
class Window:
    """The running state of the window being accumulated.

    Attributes:
        micro_batches: backward calls so far.
        loss_sum: Σ loss_sum (float64, on the device).
        count: Σ count.
        bad_counts: how many tensor counts were negative or not finite (checked at step time).
        scale: the constant every backward multiplies its loss by (Note [backward scale]);
            ``None`` until the window's first backward chooses it.
        pending_forwards: forwards whose backward has not run yet (Note [several forwards]).
        deferred: the gradients are synchronised across ranks at step time, not in a backward.
        samples_hint: ``(window samples, first micro-batch samples)`` when ``train_step`` knows
            them (for the first backward's scale); ``(1, 1)`` otherwise.
    """

    micro_batches: int = 0
    loss_sum: torch.Tensor | float = 0.0
    count: torch.Tensor | float = 0.0
    bad_counts: torch.Tensor | float = 0.0
    scale: torch.Tensor | float | None = None
    pending_forwards: int = 0
    deferred: bool = False
    samples_hint: tuple[int, int] = (1, 1)

    def add(self, loss_sum: torch.Tensor, count: torch.Tensor | float) -> None:
        """Record one micro-batch's loss sum and count."""
        self.loss_sum = self.loss_sum + loss_sum.detach().reshape(()).to(torch.float64)
        self.count = self.count + count
        if isinstance(count, torch.Tensor):
            self.bad_counts = self.bad_counts + (~torch.isfinite(count) | (count < 0)).to(
                torch.float64
            )
        self.micro_batches += 1


def planned_scale(
    counts: Sequence[Any] | None, samples: int, sync: GradSync, device: torch.device
) -> torch.Tensor | float | None:
    """The window's backward scale from what is known before it runs (Note [backward scale] in
    ``bigbatch.core.engine``): ``1 / C`` with the counts of ``count_fn``, else ``1 / N`` on several
    ranks, else ``None`` (one process: chosen at the first backward by ``first_scale``)."""
    count: torch.Tensor | float = 0.0
    for c in counts or ():
        count = count + check_count(c, "count_fn's result")
    if sync.world_size == 1:
        return None if counts is None else 1.0 / clamp_count(count)
    local = torch.tensor([float(samples), 0.0], dtype=torch.float64, device=device)
    local[1] = count if counts is not None else 0.0
    total = sync.all_reduce_sum(local)  # one small all-reduce, before the window
    return 1.0 / total[1 if counts is not None else 0].clamp_min(1.0)


def first_scale(
    count: torch.Tensor | float, samples_hint: tuple[int, int], world_size: int
) -> torch.Tensor | float:
    """The scale chosen at a window's first backward when nothing was known before it: the
    first count times the window's samples per first micro-batch sample on one process, 1 on
    several ranks (Note [backward scale])."""
    if world_size > 1:
        return 1.0
    samples, first = samples_hint
    return 1.0 / clamp_count(count * (samples / first))


def clamp_count(count: torch.Tensor | float) -> torch.Tensor | float:
    """``max(count, 1)`` in float64, on the device for a tensor (no host sync)."""
    if isinstance(count, torch.Tensor):
        return count.to(torch.float64).clamp_min(1.0)
    return max(float(count), 1.0)


class MutableBuffers:
    """The model's buffers that forwards may change (Note [window buffers])."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._seen_changing: set[int] | None = None  # ids; None until the first window ends

    def candidates(self) -> list[torch.Tensor]:
        """The buffers to copy before a window."""
        buffers = list(self.model.buffers())
        if self._seen_changing is None:
            return buffers
        always = {id(b) for _, m in batchnorm_layers(self.model) for b in m.buffers()}
        return [b for b in buffers if id(b) in self._seen_changing or id(b) in always]

    def learn(self, backup: Backup) -> None:
        """After a completed window: remember the buffers whose contents changed."""
        changed = {id(b) for b in self.model.buffers() if backup.versions.get(id(b)) != _version(b)}
        self._seen_changing = changed | (self._seen_changing or set())


class Backup:
    """The random generators and the mutable buffers as they were before a window."""

    def __init__(self, buffers: MutableBuffers, device: torch.device) -> None:
        self.device = device
        self.rng = _rng.capture(device)
        self.buffers = buffers.candidates()
        self.values = [b.detach().clone() for b in self.buffers]
        self._model = buffers.model
        self.versions = self._read_versions()

    def restore(self) -> None:
        """Put the generators and the buffers back."""
        _rng.restore(self.rng, self.device)
        with torch.no_grad():
            for buffer, value in zip(self.buffers, self.values, strict=True):
                buffer.copy_(value)
        self.versions = self._read_versions()  # our own copy_ is not the model changing them

    def _read_versions(self) -> dict[int, int | None]:
        return {id(b): _version(b) for b in self._model.buffers()}


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no version counter (and cannot be written)
        return None

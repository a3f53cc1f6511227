"""The float64 runs ``check`` compares: the full batch, and what ``train_step`` steps with.

Each run works on its own float64 deep copy of the model (``copy_float64``) from the same seed
(``seeded``), so the user's model, its running statistics and the global RNG are left as they were.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bigbatch.core._tree import map_tensors
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.engine import Accumulator
from bigbatch.core.loss import LossFn, as_sum_and_count
from bigbatch.core.split import Batch, batch_size
from bigbatch.memory.checkpointing import disable_checkpointing
from bigbatch.verifier._probes import Precision, observe_precision

Grads = dict[str, torch.Tensor]


def rows(batch: Batch, start: int, stop: int) -> Batch:
    """Samples ``start:stop`` of every tensor of ``batch``."""
    return map_tensors(lambda t: t[start:stop], batch)


def sum_and_count(
    model: nn.Module, batch: Batch, loss_fn: LossFn, seed: int
) -> tuple[float, float]:
    """``loss_fn``'s ``(loss_sum, count)`` on ``batch`` from ``seed``, as floats."""
    with seeded(seed):
        loss_sum, count = as_sum_and_count(loss_fn(model, batch), batch_size(batch))
    return float(loss_sum), float(count)


@dataclass
class FullRun:
    """A full-batch run: the gradient of the mean loss, the loss, and the precision observed."""

    grads: Grads
    loss: float
    precision: Precision

    @property
    def finite(self) -> bool:
        """The loss and every gradient are finite."""
        return math.isfinite(self.loss) and all(
            bool(torch.isfinite(g).all()) for g in self.grads.values()
        )


def full_run(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    seed: int,
    checkpointing: bool = True,
    observe: bool = False,
) -> FullRun:
    """The full batch's gradient of the mean loss on a float64 copy from ``seed``.

    Args:
        checkpointing: keep the model's activation checkpointing (else disabled on the copy).
        observe: record the precision the forward and loss compute in (Note [float32 islands]).

    Raises:
        ValueError: the loss carries no gradient, or none reaches a parameter.
    """
    work = copy_float64(model)
    if not checkpointing:
        disable_checkpointing(work)
    with seeded(seed):
        with (
            observe_precision(work) if observe else contextlib.nullcontext(Precision()) as precision
        ):
            loss_sum, count = as_sum_and_count(loss_fn(work, batch), batch_size(batch))
        loss = loss_sum / count
        if not loss.requires_grad:
            raise ValueError(
                "loss_fn's loss does not depend on the model's parameters (it carries no "
                "gradient): compute it from the model's outputs, without torch.no_grad(), "
                ".detach() or .item() in loss_fn."
            )
        loss.backward()
    grads = grads_of(work)
    if not grads:
        raise ValueError(
            "no gradient reaches any of the model's trainable parameters from loss_fn's loss: "
            "compute the loss from the outputs of the model passed to check (does loss_fn call "
            "another model?)."
        )
    return FullRun(grads, float(loss.detach()), precision)


def call_seeded(loss_fn: LossFn, model: nn.Module, batch: Batch, seed: int) -> Any:
    """``loss_fn(model, batch)`` from ``seed``."""
    with seeded(seed):
        return loss_fn(model, batch)


def accumulated_grads(
    model: nn.Module, batch: Batch, loss_fn: LossFn, size: int, seed: int
) -> tuple[Grads, float]:
    """The gradient ``Accumulator.train_step`` steps with (captured by a recording optimizer),
    and the window's mean loss.

    A window the engine refuses as non-finite (``NonFiniteError``, a ``FloatingPointError``)
    gives NaN: ``check`` then says where the NaN comes from.
    """
    work = copy_float64(model)
    params = [p for p in work.parameters() if p.requires_grad]
    recorder = _Recorder(params)
    with seeded(seed), warnings.catch_warnings():
        warnings.simplefilter("ignore", BigBatchWarning)  # check reports the cause itself
        try:
            result = Accumulator(work, recorder, micro_batch_size=size).train_step(batch, loss_fn)
        except FloatingPointError:
            nan = {
                n: torch.full_like(p, math.nan)
                for n, p in work.named_parameters()
                if p.requires_grad
            }
            return nan, math.nan
    by_id = {id(p): name for name, p in work.named_parameters()}
    return {by_id[k]: g for k, g in recorder.grads.items()}, result.loss


class _Recorder(torch.optim.Optimizer):
    """An optimizer whose step records the normalised gradients and changes nothing."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {})
        self.grads: dict[int, torch.Tensor] = {}

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.grads[id(p)] = p.grad.detach().clone()


def copy_float64(model: nn.Module) -> nn.Module:
    """A float64 deep copy of ``model`` without gradients."""
    work = copy.deepcopy(model).double()
    work.zero_grad(set_to_none=True)
    return work


def grads_of(model: nn.Module) -> Grads:
    """Each parameter's gradient, by name (parameters without one are left out)."""
    return {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }


def differences(got: Grads, want: Grads) -> dict[str, float]:
    """Per parameter ``‖got − want‖ / max(‖want‖, 1e-6 ‖all of want‖)``.

    The floor keeps a gradient that is zero in exact arithmetic (a bias before a normalisation)
    from turning rounding noise into a relative difference of 1.
    """
    total = float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want.values()]))
    )
    floor = max(1e-6 * total, torch.finfo(torch.float64).tiny)
    out = {}
    for name, g in want.items():
        a = got.get(name, torch.zeros_like(g))
        out[name] = float(torch.linalg.vector_norm(a - g)) / max(
            float(torch.linalg.vector_norm(g)), floor
        )
    return out


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Fork the global RNG (CPU and initialised CUDA devices), seed it, restore it afterwards.

    Only the generators forked are seeded: ``torch.manual_seed`` would also queue a lazy seed for
    every uninitialised device type, recording a stack trace each time (a third of check's time
    on a small model).
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed_all(seed)
        yield

"""The float64 runs ``check`` compares: the full batch, and what ``train_step`` steps with.

Each run works on its own float64 deep copy of the model (``copy_float64``) from the same seed
with dropout off (``seeded``), so the user's model, its running statistics and the global RNG are
left as they were.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import warnings
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.engine import Accumulator
from bigbatch.core.loss import LossFn, Term, WindowLoss, as_terms, mean_of
from bigbatch.core.split import Batch, batch_size, split
from bigbatch.memory.checkpointing import disable_checkpointing
from bigbatch.verifier._probes import Observed, Watch, finite, observe

Grads = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Case:
    """What ``check`` was asked about: the model, the float64 batch, the loss, the micro-batch
    size compared and the seed of every run."""

    model: nn.Module
    batch: Batch
    loss_fn: LossFn
    size: int
    seed: int

    def sums(self, model: nn.Module, size: int) -> list[dict[str, tuple[float, float]]]:
        """``loss_fn``'s ``(loss_sum, count)`` per term (one ``"loss"`` term for a plain loss) on
        each piece of the batch cut at ``size`` (the last may be smaller), as floats, without
        gradients, each from the seed."""
        out = []
        for piece in split(self.batch, size):
            with seeded(self.seed), torch.no_grad():
                terms = as_terms(self.loss_fn(model, piece), batch_size(piece))
            out.append({k: (float(t.loss_sum), float(t.count)) for k, t in terms.items()})
        return out


@dataclasses.dataclass
class FullRun:
    """A full-batch run: the gradient of the mean loss, the loss, what was observed, and the
    names of the loss's terms when it returns named terms (else empty)."""

    grads: Grads
    loss: float
    observed: Observed
    terms: tuple[str, ...] = ()

    @property
    def finite(self) -> bool:
        """The loss and every gradient are finite."""
        return math.isfinite(self.loss) and all(finite(g) for g in self.grads.values())


def full_run(case: Case, checkpointing: bool = True) -> FullRun:
    """The full batch's gradient of the mean loss on a float64 copy, observed (``observe``).

    Args:
        checkpointing: keep the model's activation checkpointing (else disabled on the copy).

    Raises:
        ValueError: the loss carries no gradient, or none reaches a parameter.
    """
    work = copy_float64(case.model, checkpointing)
    with seeded(case.seed):
        with observe(work) as observed:
            out = case.loss_fn(work, case.batch)
        loss = mean_of(as_terms(out, batch_size(case.batch)))
        if not loss.requires_grad:
            raise ValueError(
                "loss_fn's loss does not depend on the model's parameters (no gradient): compute "
                "it from the model's outputs, without torch.no_grad(), .detach() or .item()."
            )
        loss.backward()
    grads = {n: p.grad.detach() for n, p in work.named_parameters() if p.grad is not None}
    if not grads:
        raise ValueError(
            "no gradient reaches any of the model's trainable parameters from loss_fn's loss: "
            "compute it from the outputs of the model passed to check, not another model's."
        )
    named = isinstance(out, Mapping) and not isinstance(case.loss_fn, WindowLoss)
    return FullRun(grads, float(loss.detach()), observed, tuple(out) if named else ())


def term_difference(case: Case, name: str) -> float:
    """The largest relative difference (``differences``) between the gradient ``train_step``
    accumulates from the named term ``name`` alone and the full batch's; 0 for a term that no
    gradient reaches (``full_run`` raises ``ValueError``)."""
    one = dataclasses.replace(case, loss_fn=functools.partial(_only, case.loss_fn, name))
    with contextlib.suppress(ValueError):
        full = full_run(one).grads
        return max(differences(accumulated_grads(one)[0], full).values(), default=0.0)
    return 0.0


def _only(loss_fn: LossFn, name: str, model: nn.Module, micro_batch: Batch) -> dict[str, Term]:
    """Term ``name`` of ``loss_fn``'s output alone, at weight 1."""
    term = as_terms(loss_fn(model, micro_batch), batch_size(micro_batch))[name]
    return {name: term._replace(weight=1.0)}


def accumulated_grads(case: Case) -> tuple[Grads, float]:
    """The gradient ``Accumulator.train_step`` steps with (captured by a recording optimizer),
    and the window's mean loss.

    A window the engine refuses as non-finite (``NonFiniteError``, a ``FloatingPointError``)
    gives NaN: ``check`` then says where the NaN comes from.
    """
    work = copy_float64(case.model)
    named = {p: name for name, p in work.named_parameters() if p.requires_grad}
    grads: Grads = {}
    recorder = torch.optim.SGD(list(named), lr=0.0)  # a step with lr 0 changes nothing
    recorder.register_step_pre_hook(
        lambda *_: grads.update({named[p]: p.grad.clone() for p in named if p.grad is not None})
    )
    with seeded(case.seed), warnings.catch_warnings():
        warnings.simplefilter("ignore", BigBatchWarning)  # check reports the cause itself
        try:
            acc = Accumulator(work, recorder, micro_batch_size=case.size)
            return grads, acc.train_step(case.batch, case.loss_fn).loss
        except FloatingPointError:
            return dict.fromkeys(named.values(), torch.full((), math.nan)), math.nan


def copy_float64(model: nn.Module, checkpointing: bool = True) -> nn.Module:
    """A float64 deep copy of ``model`` without gradients (without activation checkpointing
    unless ``checkpointing``)."""
    work = copy.deepcopy(model).double()
    work.zero_grad(set_to_none=True)
    return work if checkpointing else disable_checkpointing(work)


def differences(got: Grads, want: Grads) -> dict[str, float]:
    """Per parameter ``‖got − want‖ / max(‖want‖, 1e-6 ‖all of want‖)``.

    The floor keeps a gradient that is zero in exact arithmetic (a bias before a normalisation)
    from turning rounding noise into a relative difference of 1.
    """
    norm = torch.linalg.vector_norm
    floor = max(1e-6 * float(norm(torch.stack([norm(g) for g in want.values()]))), 1e-300)
    return {
        name: float(norm(got.get(name, torch.zeros_like(g)) - g)) / max(float(norm(g)), floor)
        for name, g in want.items()
    }


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Fork the global RNG (CPU and initialised CUDA devices), seed it, turn dropout off (Note
    [dropout in check]); restore the RNG afterwards.

    Only the generators forked are seeded: ``torch.manual_seed`` would also queue a lazy seed for
    every uninitialised device type, recording a stack trace each time (a third of check's time
    on a small model).
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), Watch():
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed_all(seed)
        yield

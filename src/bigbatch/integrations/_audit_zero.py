"""The audit under DeepSpeed: the gradients read from ZeRO's partitions, inside the engine's step.

``EngineReads`` is where ``bigbatch.integrations._audit.check`` reads the gradients of a trainer
that runs a ``deepspeed.initialize`` engine (Note [audit under DeepSpeed]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from bigbatch.integrations._audit import Reads
from bigbatch.integrations._frameworks import held
from bigbatch.verifier._runs import Grads


class EngineReads(Reads):
    """The gradients of a DeepSpeed engine's module, audited inside ``engine.step()``.

    Note [audit under DeepSpeed]
        The engine steps inside the window's last ``training_step`` (the stock Trainer's
        ``accelerator.backward``, bigbatch's window), and ZeRO keeps the gradients out of
        ``.grad``, in its own buffers: stage 1 sums them locally and reduces them in ``step()``,
        stages 2 and 3 reduce them into partitions in every backward. So the audit runs inside the
        engine's step, where the optimizer is about to step: ``bigbatch.hf.audit`` holds
        ``engine.optimizer.step`` for the audited window's last ``training_step`` and audits first.
        There every stage's gradient is whole and reduced (``deepspeed.utils.safe_get_full_grad``:
        the mean over the data-parallel ranks, before clipping), the accumulated side. The
        one-batch side cannot back-propagate into those buffers (ZeRO's hooks would add it to the
        window's sum), nor through the engine's ``forward``, whose output hooks start ZeRO's
        backward and scale by the accumulation steps: it runs the engine's module (ZeRO 3's hooks
        gather its parameters) and takes ``torch.autograd.grad`` of its loss, which leaves ZeRO's
        buffers untouched, averaged over the ranks as ZeRO averages. With dropout on, the window is
        replayed (Note [audit dropout]) with ``engine.backward`` taking ``torch.autograd.grad``
        the same way (divided by the accumulation steps where the engine would) into a buffer of
        its own, averaged over the ranks, and ``engine.step`` doing nothing: the step taken is the
        trainer's, with its masks. The engine's own ``autocast`` (its ``torch_autocast`` config)
        is not applied to the audit's forwards; fp16 and bf16 models (the config casts them) are.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def accumulated(self, model: torch.nn.Module) -> Grads:
        from deepspeed.utils import safe_get_full_grad

        return {n: _or_zeros(p, safe_get_full_grad(p)) for n, p in _trained(model)}

    def of(self, model: torch.nn.Module, value: torch.Tensor) -> Grads:
        named = _trained(model)
        found = torch.autograd.grad(value, [p for _, p in named], allow_unused=True)
        return {n: _or_zeros(p, g) for (n, p), g in zip(named, found, strict=True)}

    def replayed(self, model: torch.nn.Module, replay: Callable[[], None]) -> Grads:
        e, total = self.engine, cast(Grads, {})

        def backward(
            loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
        ) -> torch.Tensor:
            if scale_wrt_gas and e.managed_gradient_accumulation():
                loss = loss / e.gradient_accumulation_steps()
            for n, g in self.of(model, loss).items():
                total[n] = total[n] + g if n in total else g
            return loss

        quiet = [(e, "backward", backward), (e, "step", lambda *a, **k: None)]
        with held([*quiet, (e, "was_step_applied", lambda: True)]):
            replay()
        for g in total.values() if torch.distributed.is_initialized() else ():
            torch.distributed.all_reduce(g)
            g /= torch.distributed.get_world_size()
        return total

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The engine's ``forward`` is its module's (Note [audit under DeepSpeed])."""
        module = self.engine.module
        with held([(self.engine, "forward", lambda *args, **kwargs: module(*args, **kwargs))]):
            yield


def _trained(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _or_zeros(p: torch.nn.Parameter, grad: torch.Tensor | None) -> torch.Tensor:
    """``grad`` detached, or zeros of the parameter's whole shape (ZeRO 3's ``ds_shape``)."""
    if grad is not None:
        return grad.detach().clone()
    return torch.zeros(getattr(p, "ds_shape", p.shape), dtype=p.dtype, device=p.device)

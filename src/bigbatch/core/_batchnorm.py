"""The part of BatchNorm handling the engine needs: the window's momentum accounting, one warning.

A policy of ``bigbatch.core.batchnorm`` installs a ``BatchNormHook`` on each BatchNorm layer: a record
that holds its own hook handles, so it can be found (``hooks_of``) and removed (``remove``), and
sets nothing else on the user's layer. The engine tells the hooks how many samples the window
holds (``momentum_window``), and warns once about BatchNorm layers that no policy handles.

Note [momentum correction]
    A window of ``n`` samples cut into micro-batches of ``s_1..s_k`` samples runs k BatchNorm
    updates ``r <- (1 - a_j) r + a_j stat_j``. With the momentum correction each update uses
    ``a_j = 1 - (1 - m)^(s_j / n)``, so ``Π (1 - a_j) = 1 - m``: after one optimizer step the old
    running value keeps exactly the weight ``1 - m`` that one big-batch update gives it, and the
    new statistics together get weight ``m`` (not ``1 - (1 - m)^k``, k times as far). When every
    micro-batch has the big batch's statistics the result equals the big-batch update exactly.
    Outside a window (your own loop) the layers use their plain momentum.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from bigbatch.core._warnings import BigBatchWarning


class BatchNormHook:
    """How one BatchNorm layer behaves under accumulation; removable (see the module docstring).

    Args:
        layer: the BatchNorm layer.
        policy: ``"micro"`` (statistics per micro-batch, momentum-corrected windows) or
            ``"freeze"`` (normalise with the running statistics even in training mode).
        momentum_correction: for ``"micro"``, Note [momentum correction].
    """

    def __init__(self, layer: _BatchNorm, policy: str, momentum_correction: bool = True) -> None:
        self.layer, self.policy, self.correct, self.momentum = (
            layer, policy, momentum_correction, layer.momentum
        )  # fmt: skip
        self.window_samples: int | None = None
        self._was_training = False
        self._handles = [
            layer.register_forward_pre_hook(self._before),
            layer.register_forward_hook(self._after),
        ]

    def _before(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        bn = self.layer  # the same module as `layer`, typed
        if self.policy == "freeze":
            # eval-mode BatchNorm for this call only; _after puts the layer's mode back.
            self._was_training, bn.training = bn.training, False
            return
        n = self.window_samples
        base = self.momentum  # None: a cumulative average, which needs no correction
        if n and base is not None and self.correct and bn.training and _first_tensor(args):
            bn.momentum = corrected_momentum(base, args[0].shape[0], n)
        else:
            bn.momentum = self.momentum

    def _after(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.policy == "freeze":
            layer.training = self._was_training

    def remove(self) -> None:
        """Take the hooks off and give the layer its own momentum back."""
        for handle in self._handles:
            handle.remove()
        self.layer.momentum = self.momentum


def _first_tensor(args: tuple[Any, ...]) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor)


def hooks_of(layer: nn.Module) -> list[BatchNormHook]:
    """The ``BatchNormHook``\\ s installed on ``layer``."""
    owners = (getattr(hook, "__self__", None) for hook in layer._forward_pre_hooks.values())
    return [owner for owner in owners if isinstance(owner, BatchNormHook)]


def batchnorm_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The model's BatchNorm layers (every dimension, SyncBatchNorm, lazy) with their names."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def unhandled_batch_coupled(model: nn.Module) -> list[str]:
    """Labels of BatchNorm layers in training mode that no ``batchnorm`` policy handles."""
    return [label(name, m) for name, m in batchnorm_layers(model) if m.training and not hooks_of(m)]


def label(name: str, module: nn.Module) -> str:
    """How messages name a module: ``'features.1' (BatchNorm2d)``."""
    return f"'{name}' ({type(module).__name__})" if name else type(module).__name__


def warn_batch_coupled(model: nn.Module) -> None:
    """Warn (``BigBatchWarning``) when the model holds unhandled BatchNorm layers in training mode."""
    names = unhandled_batch_coupled(model)
    if names:
        warnings.warn(
            f"{', '.join(names)} normalise with batch statistics in training mode, so each "
            "micro-batch sees its own statistics and accumulation is not exact. Choose a policy "
            'with bigbatch.batchnorm(model, policy="micro" | "freeze" | "groupnorm"), or run '
            "`bigbatch check` to see the effect.",
            BigBatchWarning,
            stacklevel=4,
        )


@contextlib.contextmanager
def momentum_window(layers: Sequence[nn.Module], samples: int) -> Iterator[None]:
    """Tell the momentum-corrected hooks of the BatchNorm ``layers`` that the next forwards form a
    window of ``samples`` (Note [momentum correction])."""
    hooks = [h for m in layers for h in hooks_of(m) if h.correct]
    for hook in hooks:
        hook.window_samples = samples
    try:
        yield
    finally:
        for hook in hooks:
            hook.window_samples = None
            hook.layer.momentum = hook.momentum


def corrected_momentum(momentum: float, samples: int, window_samples: int) -> float:
    """Momentum for a micro-batch of ``samples`` in a window of ``window_samples`` (Note above).

    >>> round(corrected_momentum(0.1, 5, 10), 6)  # half the window: 1 - 0.9 ** 0.5
    0.051317
    """
    return 1.0 - (1.0 - momentum) ** (samples / window_samples)

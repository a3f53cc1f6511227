"""BatchNorm under accumulation: ``batchnorm(model, policy)`` and the engine's window hook.

BatchNorm in training mode normalises each sample with statistics of the *micro*-batch it is in,
so an accumulated step is not the big-batch step. Three policies:

* ``"micro"``: keep ghost-batch semantics (statistics per micro-batch, what PyTorch does under
  accumulation anyway) and say so once with a ``BigBatchWarning`` naming the layers.
* ``"freeze"``: normalise with the running statistics (eval-mode BatchNorm, for fine-tuning),
  even after ``model.train()``; the running statistics no longer change. The affine weight and
  bias stay trainable: call ``layer.requires_grad_(False)`` to freeze them too. Exact.
* ``"groupnorm"``: replace every BatchNorm with a ``GroupNorm`` (affine weights copied).
  GroupNorm is per-sample, so accumulation is exact.

Note [momentum correction]: a window of ``n`` samples cut into micro-batches of ``s_1..s_k``
samples runs k BatchNorm updates ``r <- (1 - a_j) r + a_j stat_j``. With the momentum correction
each update uses ``a_j = 1 - (1 - m)^(s_j / n)``, so ``Π (1 - a_j) = 1 - m``: after one optimizer
step the old running value keeps exactly the weight ``1 - m`` that one big-batch update gives it,
and the new statistics together get weight ``m`` (not ``1 - (1 - m)^k``, k times as far). When
every micro-batch has the big batch's statistics the result equals the big-batch update exactly.
The engine tells the layers ``n`` through ``window(model, n)`` around each window; outside a
window (your own loop) the layers use their plain momentum.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from bigbatch._warnings import BigBatchWarning

POLICIES = ("micro", "freeze", "groupnorm")


def batchnorm(model: nn.Module, policy: str = "micro", momentum_correction: bool = True) -> nn.Module:
    """Choose how the model's BatchNorm layers behave under accumulation (in place).

    Args:
        model: the module whose BatchNorm layers (any dimension, SyncBatchNorm, lazy) to handle.
        policy: ``"micro"``, ``"freeze"`` or ``"groupnorm"`` (see the module docstring).
        momentum_correction: for ``"micro"``, move the running statistics once per optimizer
            step as far as one big-batch update would (Note [momentum correction]).

    Returns:
        ``model`` itself (changed in place).

    Raises:
        ValueError: unknown policy, or ``"groupnorm"`` on a lazy layer not yet initialised.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> type(batchnorm(model, "groupnorm")[1]).__name__
        'GroupNorm'
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not allowed: use one of {', '.join(map(repr, POLICIES))}.")
    layers = batchnorm_layers(model)
    if policy == "groupnorm":
        for name, layer in layers:
            _replace(model, name, _to_groupnorm(name, layer))
        return model
    for _, layer in layers:
        if getattr(layer, "_bigbatch_policy", None) is None:
            layer.register_forward_pre_hook(_pre_forward)
        layer._bigbatch_policy = policy  # type: ignore[assignment]
        layer._bigbatch_correct = momentum_correction  # type: ignore[assignment]
        layer._bigbatch_momentum = layer.momentum  # type: ignore[assignment]
    if policy == "micro" and layers:
        names = ", ".join(label(name, layer) for name, layer in layers)
        warnings.warn(
            f"BatchNorm layers {names} use statistics per micro-batch (ghost-batch semantics): "
            'accumulated steps differ from big-batch steps. Use policy="groupnorm" for exactness.',
            BigBatchWarning,
            stacklevel=2,
        )
    return model


def batchnorm_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The model's BatchNorm layers (every dimension, SyncBatchNorm, lazy) with their names."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def unhandled_batch_coupled(model: nn.Module) -> list[str]:
    """Names of BatchNorm layers in training mode that no ``batchnorm`` policy has handled."""
    return [
        label(name, m)
        for name, m in batchnorm_layers(model)
        if m.training and getattr(m, "_bigbatch_policy", None) is None
    ]


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
            stacklevel=3,
        )


@contextlib.contextmanager
def window(model: nn.Module, samples: int) -> Iterator[None]:
    """Tell momentum-corrected BatchNorm layers that the next forwards form a window of ``samples``."""
    layers = [m for _, m in batchnorm_layers(model) if getattr(m, "_bigbatch_correct", False)]
    for layer in layers:
        layer._bigbatch_window = samples  # type: ignore[assignment]
    try:
        yield
    finally:
        for layer in layers:
            layer._bigbatch_window = None  # type: ignore[assignment]
            layer.momentum = layer._bigbatch_momentum  # type: ignore[assignment]


def corrected_momentum(momentum: float, samples: int, window_samples: int) -> float:
    """Momentum for a micro-batch of ``samples`` in a window of ``window_samples`` (Note above)."""
    return 1.0 - (1.0 - momentum) ** (samples / window_samples)


def _pre_forward(layer: _BatchNorm, args: tuple[Any, ...]) -> None:
    if getattr(layer, "_bigbatch_policy", None) == "freeze":
        layer.training = False  # survives model.train(): set again before every forward
        return
    base: float | None = getattr(layer, "_bigbatch_momentum", None)
    n: int | None = getattr(layer, "_bigbatch_window", None)
    if n and base is not None and layer.training and args and isinstance(args[0], torch.Tensor):
        layer.momentum = corrected_momentum(base, args[0].shape[0], n)
    else:
        layer.momentum = base


def _to_groupnorm(name: str, layer: _BatchNorm) -> nn.GroupNorm:
    if isinstance(layer.weight, nn.parameter.UninitializedParameter) or (
        not layer.affine and layer.num_features == 0
    ):
        raise ValueError(
            f"{name} is a lazy BatchNorm not initialised yet: run one forward pass before "
            'batchnorm(model, policy="groupnorm").'
        )
    channels = layer.num_features
    groups = 1 if isinstance(layer, nn.BatchNorm1d) else _groups(channels)
    norm = nn.GroupNorm(groups, channels, eps=layer.eps, affine=layer.affine)
    if layer.affine:
        with torch.no_grad():
            norm.weight.copy_(layer.weight)
            norm.bias.copy_(layer.bias)
    return norm.to(device=layer.weight.device if layer.affine else None, dtype=_dtype(layer))


def _groups(channels: int) -> int:
    """The largest of 32, 16, 8, 4, 2, 1 that divides ``channels`` (32 as in Wu & He 2018)."""
    return next(g for g in (32, 16, 8, 4, 2, 1) if channels % g == 0)


def _dtype(layer: _BatchNorm) -> torch.dtype | None:
    for t in (layer.weight, layer.running_mean):
        if isinstance(t, torch.Tensor):
            return t.dtype
    return None


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)

"""BatchNorm under accumulation: ``batchnorm(model, policy)`` chooses what the layers do.

BatchNorm in training mode normalises each sample with statistics of the *micro*-batch it is in,
so an accumulated step is not the big-batch step. The policies:

* ``"micro"``: keep ghost-batch semantics (statistics per micro-batch, what PyTorch does under
  accumulation anyway) and say so once with a ``BigBatchWarning`` naming the layers; inside the
  engine's windows the running statistics move once per optimizer step as far as one big-batch
  update would (Note [momentum correction] in ``bigbatch.core._batchnorm``).
* ``"freeze"``: normalise with the running statistics (eval-mode BatchNorm, for fine-tuning),
  even after ``model.train()``; the running statistics no longer change. The affine weight and
  bias stay trainable: call ``layer.requires_grad_(False)`` to freeze them too. Exact.
* ``"groupnorm"``: replace every BatchNorm with a ``GroupNorm`` (affine weights copied).
  GroupNorm is per-sample, so accumulation is exact.
* ``"keep"``: undo any of the above; the layers behave as they did before (a swapped GroupNorm
  becomes the original BatchNorm again, with the affine weights it has learned since).

Each policy is a record that holds what it changed (``BatchNormHook``: its hook handles and the
layer's momentum; ``_Swapped``: the original BatchNorm), so undoing restores the model's behaviour
and its ``state_dict`` exactly; nothing else is set on the user's layers.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from bigbatch.core._batchnorm import BatchNormHook, batchnorm_layers, hooks_of, label
from bigbatch.core._warnings import BigBatchWarning

POLICIES = ("micro", "freeze", "groupnorm", "keep")


def batchnorm(
    model: nn.Module, policy: str = "micro", momentum_correction: bool = True
) -> nn.Module:
    """Choose how the model's BatchNorm layers behave under accumulation (in place).

    A new policy replaces the previous one; ``"keep"`` undoes every policy.

    Args:
        model: the module whose BatchNorm layers (any dimension, SyncBatchNorm, lazy) to handle.
        policy: ``"micro"``, ``"freeze"``, ``"groupnorm"`` or ``"keep"`` (module docstring).
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
        >>> type(batchnorm(model, "keep")[1]).__name__
        'BatchNorm2d'
    """
    if policy not in POLICIES:
        raise ValueError(
            f"policy={policy!r} is not allowed: use one of {', '.join(map(repr, POLICIES))}."
        )
    if policy == "groupnorm":
        for name, layer in batchnorm_layers(model):  # checked before anything changes
            _check_initialised(name, layer)
    _undo(model)
    layers = batchnorm_layers(model)
    if policy == "groupnorm":
        for name, layer in layers:
            _replace(model, name, _Swapped.install(layer))
    elif policy in ("micro", "freeze"):
        for _, layer in layers:
            BatchNormHook(layer, policy, momentum_correction)
    if policy == "micro" and layers:
        names = ", ".join(label(name, layer) for name, layer in layers)
        warnings.warn(
            f"BatchNorm layers {names} use statistics per micro-batch (ghost-batch semantics): "
            'accumulated steps differ from big-batch steps. Use policy="groupnorm" for exactness.',
            BigBatchWarning,
            stacklevel=2,
        )
    return model


def _undo(model: nn.Module) -> None:
    """Remove every policy: hooks off, swapped GroupNorms back to their BatchNorm."""
    for name, module in list(model.named_modules()):
        for hook in hooks_of(module):
            hook.remove()
        swapped = _Swapped.of(module)
        if swapped is not None:
            _replace(model, name, swapped.restore(module))


class _Swapped:
    """Kept on a GroupNorm that ``"groupnorm"`` put in place of a BatchNorm: the BatchNorm itself.

    Registered as a no-op forward pre-hook of the GroupNorm, so it lives and dies with the module
    and ``_undo`` can find it; it changes nothing in the GroupNorm's forward.
    """

    def __init__(self, original: _BatchNorm) -> None:
        self.original, self.handle = original, cast(Any, None)

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        return None

    @classmethod
    def install(cls, layer: _BatchNorm) -> nn.GroupNorm:
        norm = _to_groupnorm(layer)
        record = cls(layer)
        record.handle = norm.register_forward_pre_hook(record)
        return norm

    @staticmethod
    def of(module: nn.Module) -> _Swapped | None:
        found = [h for h in module._forward_pre_hooks.values() if isinstance(h, _Swapped)]
        return found[0] if found else None

    def restore(self, norm: nn.Module) -> _BatchNorm:
        """The original BatchNorm, holding the affine weights the GroupNorm learned."""
        self.handle.remove()
        if self.original.affine and isinstance(norm, nn.GroupNorm):
            with torch.no_grad():
                self.original.weight.copy_(norm.weight)
                self.original.bias.copy_(norm.bias)
        self.original.train(norm.training)
        return self.original


def _check_initialised(name: str, layer: _BatchNorm) -> None:
    if isinstance(layer.weight, nn.parameter.UninitializedParameter) or (
        not layer.affine and layer.num_features == 0
    ):
        raise ValueError(
            f"{name} is a lazy BatchNorm not initialised yet: run one forward pass before "
            'batchnorm(model, policy="groupnorm").'
        )


def _to_groupnorm(layer: _BatchNorm) -> nn.GroupNorm:
    channels = layer.num_features
    groups = 1 if isinstance(layer, nn.BatchNorm1d) else _groups(channels)
    norm = nn.GroupNorm(groups, channels, eps=layer.eps, affine=layer.affine)
    if layer.affine:
        with torch.no_grad():
            norm.weight.copy_(layer.weight)
            norm.bias.copy_(layer.bias)
    norm.train(layer.training)
    return norm.to(device=layer.weight.device if layer.affine else None, dtype=_dtype(layer))


def _groups(channels: int) -> int:
    """The largest of 32, 16, 8, 4, 2, 1 that divides ``channels`` (32 as in Wu & He 2018)."""
    return next(g for g in (32, 16, 8, 4, 2, 1) if channels % g == 0)


def _dtype(layer: _BatchNorm) -> torch.dtype | None:
    tensors = (layer.weight, layer.running_mean)
    return next((t.dtype for t in tensors if isinstance(t, torch.Tensor)), None)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)  # "" is the model itself

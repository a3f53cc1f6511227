"""BatchNorm under accumulation: ``batchnorm(model, policy)`` chooses what the layers do.

BatchNorm in training mode normalises each sample with statistics of the *micro*-batch it is in,
so an accumulated step is not the big-batch step. The policies:

* ``"micro"``: keep ghost-batch semantics (statistics per micro-batch, what PyTorch does under
  accumulation anyway) and say so once with a ``BigBatchWarning`` naming the layers; inside the
  engine's windows the running statistics move once per optimizer step as far as one big-batch
  update would (Note [momentum correction]).
* ``"freeze"``: normalise with the running statistics (eval-mode BatchNorm, for fine-tuning),
  even after ``model.train()``; the running statistics no longer change. The affine weight and
  bias stay trainable: call ``layer.requires_grad_(False)`` to freeze them too. Exact.
* ``"groupnorm"``: replace every BatchNorm with a ``GroupNorm`` (affine weights copied).
  GroupNorm is per-sample, so accumulation is exact.
* ``"keep"``: undo any of the above; the layers behave as they did before (a swapped GroupNorm
  becomes the original BatchNorm again, with the affine weights it has learned since).

Each policy is a record that holds what it changed (``BatchNormHook``: its hook handles and the
layer's momentum, found by ``hooks_of``; ``_Swapped``: the original BatchNorm), so undoing restores
the model's behaviour and its ``state_dict`` exactly; nothing else is set on the user's layers.
The engine itself needs only the last section: it tells the hooks how many samples the
window holds (``momentum_window``) and warns once about BatchNorm layers no policy handles.

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
from bigbatch.core.split import check_choice

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
    check_choice("policy", policy, POLICIES)
    for name, layer in batchnorm_layers(model) if policy == "groupnorm" else ():
        if layer.num_features == 0:  # a LazyBatchNorm before its first forward (affine or not)
            raise ValueError(
                f"{name} is a lazy BatchNorm not initialised yet: run one forward pass before "
                'batchnorm(model, policy="groupnorm").'
            )  # checked before anything changes
    _undo(model)
    layers = batchnorm_layers(model)
    if policy == "groupnorm":
        for name, layer in layers:
            _replace(model, name, _Swapped(layer, _to_groupnorm(layer)).norm)
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
        for swapped in hooks_of(module, _Swapped):
            _replace(model, name, swapped.restore(module))


class _Swapped:
    """Kept on a GroupNorm that ``"groupnorm"`` put in place of a BatchNorm: the BatchNorm itself.

    Registered as a no-op forward pre-hook of the GroupNorm, so it lives and dies with the module
    and ``_undo`` can find it (``hooks_of``); it changes nothing in the GroupNorm's forward.
    """

    def __init__(self, original: _BatchNorm, norm: nn.GroupNorm) -> None:
        self.original, self.norm, self.handle = original, norm, norm.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """The hook itself does nothing: the record only rides on the GroupNorm."""

    def restore(self, norm: nn.GroupNorm) -> _BatchNorm:
        """The original BatchNorm, holding the affine weights the GroupNorm learned."""
        self.handle.remove()
        _copy_affine(self.original, norm)
        return self.original


def _to_groupnorm(layer: _BatchNorm) -> nn.GroupNorm:
    # The largest of 32, 16, 8, 4, 2, 1 that divides the channels (32 as in Wu & He 2018).
    sizes = (1,) if isinstance(layer, nn.BatchNorm1d) else (32, 16, 8, 4, 2, 1)
    groups = next(g for g in sizes if layer.num_features % g == 0)
    norm = nn.GroupNorm(groups, layer.num_features, eps=layer.eps, affine=layer.affine)
    _copy_affine(norm, layer)
    found = (t.dtype for t in (layer.weight, layer.running_mean) if isinstance(t, torch.Tensor))
    return norm.to(device=layer.weight.device if layer.affine else None, dtype=next(found, None))


@torch.no_grad()
def _copy_affine(target: _BatchNorm | nn.GroupNorm, source: _BatchNorm | nn.GroupNorm) -> None:
    """``source``'s training mode, and its affine weight and bias when both layers have them."""
    if target.affine and source.affine:
        target.weight.copy_(source.weight)
        target.bias.copy_(source.bias)
    target.train(source.training)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)  # "" is the model itself


# ---------------------------------------------------------------------------- what the engine needs
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
            layer,
            policy,
            momentum_correction,
            layer.momentum,
        )
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
        # base None: a cumulative average, no correction
        n, base, first = self.window_samples, self.momentum, args[0] if args else None
        bn.momentum = base
        if n and base is not None and self.correct and bn.training and torch.is_tensor(first):
            bn.momentum = corrected_momentum(base, first.shape[0], n)

    def _after(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.policy == "freeze":
            layer.training = self._was_training

    def remove(self) -> None:
        """Take the hooks off and give the layer its own momentum back."""
        for handle in self._handles:
            handle.remove()
        self.layer.momentum = self.momentum


def hooks_of(layer: nn.Module, kind: type = BatchNormHook) -> list[Any]:
    """The records of ``kind`` riding on ``layer``'s forward pre-hooks: the ``BatchNormHook``\\ s
    installed on it (their bound methods' owner), or the ``_Swapped`` that is the hook itself."""
    owners = (getattr(hook, "__self__", hook) for hook in layer._forward_pre_hooks.values())
    return [owner for owner in owners if isinstance(owner, kind)]


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
            f"{', '.join(names)} normalise with batch statistics in training mode: accumulation "
            "is not exact (each micro-batch sees its own; `bigbatch check` shows the effect). "
            'Choose a policy: bigbatch.batchnorm(model, policy="micro" | "freeze" | "groupnorm").',
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

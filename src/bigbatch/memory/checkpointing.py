"""Gradient (activation) checkpointing for any model: recompute blocks in backward, save memory.

Note [checkpointing in place]
    A chosen block keeps its class, its parameters and its ``state_dict`` keys: only its
    ``forward`` is replaced, by an instance attribute (``_CheckpointedForward``) that runs the
    original forward under non-reentrant ``torch.utils.checkpoint``. Saving and loading state
    dicts is therefore unaffected, ``disable_checkpointing`` restores the block exactly (it
    deletes the attribute, or puts back a forward that was there before), and enabling twice
    wraps nothing twice. Non-reentrant checkpoint restores the RNG state before recomputing,
    so dropout draws the same mask in the recompute as in the forward.

Note [running statistics under recompute]
    The function handed to ``checkpoint`` runs twice: once in the forward and once more in
    backward to recompute what was not saved. A BatchNorm in training mode updates its running
    statistics on every call, so a naive recompute updates them twice (pytorch/pytorch#96136).
    The wrapper counts the calls of one forward; on the second it puts ``running_mean``,
    ``running_var`` and ``num_batches_tracked`` of the block's modules back to what they were,
    so the statistics equal those of a model that was never checkpointed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


class _CheckpointedForward:
    """A block's forward run under non-reentrant checkpoint; see Note [checkpointing in place]."""

    def __init__(self, module: nn.Module) -> None:
        # The forward that was set on the instance before us (another wrapper's), if any.
        self.previous = module.__dict__.get("forward")
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = (
            self.previous
            if self.previous is not None
            else type(self.module).forward.__get__(self.module)
        )
        calls = 0

        def run(*inputs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return forward(*inputs, **kwargs)
            with _running_stats_kept(self.module):  # Note [running statistics under recompute]
                return forward(*inputs, **kwargs)

        return checkpoint(run, *args, use_reentrant=False)


@contextlib.contextmanager
def _running_stats_kept(module: nn.Module) -> Iterator[None]:
    saved = [
        (buffer, buffer.detach().clone())
        for sub in module.modules()
        for name, buffer in sub.named_buffers(recurse=False)
        if name in _RUNNING_STATS and buffer is not None
    ]
    try:
        yield
    finally:  # also when checkpoint stops the recompute early
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def enable_checkpointing(
    model: nn.Module,
    blocks: Sequence[type | str] | None = None,
    *,
    fraction: float = 1.0,
) -> nn.Module:
    """Recompute the model's repeated blocks in backward instead of keeping their activations.

    Activation memory falls to roughly one block's worth plus the blocks' inputs, for about
    one more forward pass of time. Gradients are unchanged (dropout included: the recompute
    sees the same random mask), and BatchNorm running statistics are updated once per forward
    as without checkpointing. The model is changed in place; its ``state_dict`` keys do not
    change. Calling it again replaces the previous choice of blocks (the latest call decides).

    A transformers model (one with ``activation_checkpointing_enable`` /
    ``gradient_checkpointing_enable``) is switched with its own method, non-reentrant, when
    ``blocks`` is ``None`` and ``fraction`` is 1.

    Args:
        model: the module to change.
        blocks: which modules to checkpoint: ``None`` finds them (the children of the model's
            largest ``ModuleList`` / ``Sequential`` whose children share one type), or a list of
            module classes, or a list of qualified names as in ``model.named_modules()``
            (``"layers.0"``).
        fraction: in (0, 1]: checkpoint only the first ``max(1, round(fraction * N))`` of the
            ``N`` blocks, to buy only the saving a memory budget needs.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: no repeated blocks were found, a name is unknown, a class matches nothing,
            or ``fraction`` is not in (0, 1].

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
        >>> net = enable_checkpointing(net, fraction=2 / 3)
        >>> len(checkpointed_blocks(net))
        2
    """
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(
            f"fraction={fraction!r} is not allowed: use a number in (0, 1], e.g. fraction=0.5 "
            "to checkpoint the first half of the blocks, or fraction=1 for all of them."
        )
    if blocks is None and fraction == 1 and _hf_switch(model, "enable") is not None:
        disable_checkpointing(model)
        _hf_switch(model, "enable")(**{_hf_kwargs_name(model): {"use_reentrant": False}})
        return model
    chosen = find_blocks(model, blocks)  # before changing anything: a bad call changes nothing
    disable_checkpointing(model)
    count = max(1, math.floor(fraction * len(chosen) + 0.5))
    for _, module in chosen[:count]:
        module.forward = _CheckpointedForward(module)  # type: ignore[method-assign]
    return model


def disable_checkpointing(model: nn.Module) -> nn.Module:
    """Undo ``enable_checkpointing``: every block runs its own forward again, keeping activations.

    Returns:
        ``model``, changed in place (a model without checkpointing is returned unchanged).
    """
    for module in model.modules():
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, _CheckpointedForward):
            del module.forward
            if wrapper.previous is not None:
                module.forward = wrapper.previous  # type: ignore[method-assign]
    if _hf_switch(model, "disable") is not None and _hf_enabled(model):
        _hf_switch(model, "disable")()
    return model


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules that ``enable_checkpointing`` wrapped (not the HF switch)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module.__dict__.get("forward"), _CheckpointedForward)
    ]


def find_blocks(
    model: nn.Module, blocks: Sequence[type | str] | None = None
) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs ``enable_checkpointing`` would wrap, in model order.

    Raises:
        ValueError: see ``enable_checkpointing``.
    """
    if blocks is None:
        return _repeated_blocks(model)
    if isinstance(blocks, (str, type)) or not all(isinstance(b, (str, type)) for b in blocks):
        raise ValueError(
            f"blocks={blocks!r} is not allowed: use None, a list of module classes "
            "(blocks=[MyBlock]) or a list of module names (blocks=['layers.0', 'layers.1'])."
        )
    names = dict(model.named_modules())
    unknown = [b for b in blocks if isinstance(b, str) and b not in names]
    if unknown:
        some = ", ".join(repr(n) for n in list(names)[1:8])
        raise ValueError(
            f"blocks={list(blocks)!r}: no module named {unknown[0]!r} in the model; names are "
            f"those of model.named_modules(), e.g. {some}."
        )
    classes = tuple(b for b in blocks if isinstance(b, type))
    missing = [c.__name__ for c in classes if not any(isinstance(m, c) for m in names.values())]
    if missing:
        raise ValueError(f"blocks={list(blocks)!r}: no module of class {missing[0]} in the model.")
    wanted = [
        (name, m)
        for name, m in names.items()
        if name in blocks or (classes and isinstance(m, classes))
    ]
    # A block inside another chosen block is already recomputed with it.
    return [
        (n, m)
        for n, m in wanted
        if not any(n.startswith(o + ".") for o, _ in wanted if o and o != n)
    ]


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    best: list[tuple[str, nn.Module]] = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        if len(children) > len(best):
            best = [(f"{name}.{n}" if name else n, c) for n, c in children]
    if not best:
        raise ValueError(
            f"blocks=None: found no repeated blocks in {type(model).__name__} (no ModuleList or "
            "Sequential whose children share one type). Name them: "
            "enable_checkpointing(model, blocks=[MyBlock]) or blocks=['encoder.0', 'encoder.1']."
        )
    return best


def _hf_switch(model: nn.Module, what: str) -> Any:
    """transformers' own switch (``activation_...`` since v5, ``gradient_...`` before)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    for prefix in ("activation", "gradient"):
        method = getattr(model, f"{prefix}_checkpointing_{what}", None)
        if method is not None:
            return method
    return None


def _hf_kwargs_name(model: nn.Module) -> str:
    if hasattr(model, "activation_checkpointing_enable"):
        return "activation_checkpointing_kwargs"
    return "gradient_checkpointing_kwargs"


def _hf_enabled(model: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())

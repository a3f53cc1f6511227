"""How a logical batch is cut into micro-batches.

Pure functions, no model: ``batch_size(batch)`` checks that every tensor agrees on the first
dimension and returns it; ``split(batch, micro_batch_size)`` cuts along that dimension into
consecutive views, the last one possibly smaller (10 samples at 4 give 4 + 4 + 2).

What is cut: every tensor (along its first dimension) and every per-sample column that is not a
tensor, i.e. a list or tuple of exactly ``n`` non-container values (the ids or strings
``default_collate`` gathers into a list). Anything else (a number, a string, a list of another
length) is a per-batch value and every micro-batch gets it whole.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from bigbatch.core._tree import take, tensor_leaves

Batch = Any
"""A tensor, or a nested tuple / list / dict / mapping of tensors sharing the first dimension."""


def batch_size(batch: Batch) -> int:
    """Return the number of samples in ``batch`` (the shared first dimension of its tensors).

    Raises:
        TypeError: ``batch`` holds no tensor, or a 0-dimensional one.
        ValueError: the tensors disagree on the first dimension, or the batch is empty.
    """
    distinct = {t.shape[0] if t.dim() else 0 for _, t in tensor_leaves(batch, "")}
    if len(distinct) == 1 and (n := next(iter(distinct))) > 0:
        return n  # the usual case, without naming the leaves (the messages below do)
    sizes: dict[str, int] = {}
    for path, tensor in tensor_leaves(batch):
        if tensor.dim() == 0:
            raise TypeError(
                f"batch: {path} is a 0-dimensional tensor; every tensor in a batch needs a first "
                "(sample) dimension. Put per-batch constants outside the batch or give them shape [N]."
            )
        sizes[path] = tensor.shape[0]
    if not sizes:
        raise TypeError(
            f"batch: found no tensor in a {type(batch).__name__}; pass a tensor or a tuple / list / "
            "dict of tensors whose first dimension is the sample dimension."
        )
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{p} has {n}" for p, n in sizes.items())
        raise ValueError(
            f"batch: tensors disagree on the first (sample) dimension ({listing}); every tensor "
            "must hold one row per sample."
        )
    raise ValueError("batch: the batch is empty (first dimension 0); pass at least one sample.")


def split(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Cut ``batch`` into consecutive micro-batches of ``micro_batch_size`` samples (views, no copy).

    Per-sample columns that are not tensors are cut with the rows; other non-tensor values are
    passed to every micro-batch whole (see the module docstring).

    >>> import torch
    >>> [t.shape[0] for t in split(torch.zeros(10, 3), 4)]
    [4, 4, 2]
    """
    n, m = batch_size(batch), check_micro_batch_size(micro_batch_size)
    if isinstance(batch, Tensor):  # the usual batches: one Tensor.split per tensor
        return list(batch.split(m))
    if type(batch) in (tuple, list) and all(isinstance(t, Tensor) for t in batch):
        return [type(batch)(parts) for parts in zip(*(t.split(m) for t in batch), strict=True)]
    if type(batch) is dict and all(isinstance(t, Tensor) for t in batch.values()):
        splits = zip(*(t.split(m) for t in batch.values()), strict=True)
        return [dict(zip(batch, parts, strict=True)) for parts in splits]
    return [take(batch, slice(i, i + m), n) for i in range(0, n, m)]


def check_micro_batch_size(micro_batch_size: object, name: str = "micro_batch_size") -> int:
    """Return ``micro_batch_size`` if it is a positive int, else raise naming what is allowed."""
    example = 4096 if name == "micro_batch_tokens" else 8
    allowed = f'use a positive integer or "auto" (e.g. {name}={example}).'
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise TypeError(f"{name}={micro_batch_size!r} is not allowed: {allowed}")
    if micro_batch_size <= 0:
        raise ValueError(f"{name}={micro_batch_size} is not allowed: {allowed}")
    return micro_batch_size


def check_choice(name: str, value: object, allowed: tuple[object, ...]) -> None:
    """Raise a ``ValueError`` naming ``name``, ``value`` and ``allowed`` unless ``value`` is one."""
    if value not in allowed:
        raise ValueError(
            f"{name}={value!r} is not allowed: use one of {', '.join(map(repr, allowed))}."
        )

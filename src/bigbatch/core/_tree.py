"""Map and flatten over nested batches: tensors inside tuples, lists, dicts and mappings.

A batch is whatever a DataLoader yields: a tensor, a tuple ``(x, y)``, a dict, a tokenizer's
``BatchEncoding`` (a ``Mapping`` that is not a ``dict``), nested any way. Non-tensor leaves
(strings, ints, ``None``) are carried through untouched by ``map_tensors``; ``take`` also cuts
per-sample columns that are not tensors (see ``take``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def tensor_leaves(tree: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in ``tree``, depth first, in a stable order
    (``path=""``: no paths are built, each is ``""``)."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, (tuple, list, Mapping)):
        items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
        for key, value in items:
            yield from tensor_leaves(value, path and f"{path}[{key!r}]")


def map_tensors(fn: Callable[[Any], Any], tree: Any, n: int | None = None) -> Any:
    """Return ``tree`` with ``fn`` applied to every tensor (and, given ``n``, to every column of
    ``n`` values: see ``take``), keeping the container types.

    Named tuples, dict subclasses and mappings such as ``transformers.BatchEncoding`` are
    rebuilt with their own type so that ``loss_fn`` sees the same kind of object it would see
    for the whole batch.
    """
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        return _rebuild_mapping(tree, {k: map_tensors(fn, v, n) for k, v in tree.items()})
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple: a record, not a column
        return type(tree)(*(map_tensors(fn, v, n) for v in tree))
    if isinstance(tree, (tuple, list)) and n is not None and is_column(tree, n):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_tensors(fn, v, n) for v in tree)
    return tree


def _rebuild_mapping(original: Mapping, items: dict) -> Any:
    if type(original) is dict:
        return items
    rebuild: Any = type(original)  # a concrete Mapping subclass, e.g. BatchEncoding
    try:
        return rebuild(items)
    except Exception:  # a mapping type whose constructor takes something else
        return items


def take(tree: Any, index: slice | list[int], n: int) -> Any:
    """``tree`` with every per-sample leaf cut to the rows ``index`` (a slice or positions) of ``n``.

    Per-sample leaves are tensors (cut along their first dimension) and **columns**: a list or
    tuple of exactly ``n`` values that are not containers, such as the list of ``n`` ids or
    strings that ``default_collate`` makes from a dataset of ``(x, y, "id")`` items. Anything
    else that is not a tensor (a per-batch constant, a list of another length) is passed whole.

    >>> take({"x": torch.arange(4), "id": ["a", "b", "c", "d"], "lr": 0.1}, slice(1, 3), 4)
    {'x': tensor([1, 2]), 'id': ['b', 'c'], 'lr': 0.1}
    >>> take({"x": torch.arange(4), "id": ["a", "b", "c", "d"]}, [3, 0], 4)
    {'x': tensor([3, 0]), 'id': ['d', 'a']}
    """
    rows = index if isinstance(index, slice) else torch.as_tensor(index, dtype=torch.long)

    def cut(leaf: Any) -> Any:  # a tensor or a column
        if isinstance(leaf, torch.Tensor):
            return leaf[rows]
        return type(leaf)(leaf[index] if isinstance(index, slice) else [leaf[i] for i in index])

    return map_tensors(cut, tree, n)


def is_column(values: tuple | list, n: int) -> bool:
    """A list / tuple of ``n`` non-container values: one value per sample (see ``take``)."""
    containers = (torch.Tensor, Mapping, tuple, list)
    return len(values) == n and not any(isinstance(v, containers) for v in values)

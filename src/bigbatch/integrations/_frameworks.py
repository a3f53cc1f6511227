"""The frameworks' objects as the adapters handle them from outside: imported, changed for a block.

``need`` imports transformers or Lightning where an adapter is first imported, so that ``import
bigbatch`` needs only torch and a missing extra names the ``pip install`` to run; ``held`` sets
attributes for a block and puts them back (a trainer's accumulation steps, a model's dropout
rates); ``reshard`` shards an FSDP2 model again after the forwards without gradient that the
transformers window and both audits run.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from bigbatch.core._sync import wrapper_kind


def need(module: str, extra: str) -> Any:
    """``import module``, or an ImportError naming the ``pip install`` that brings it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ImportError(f'{module} is missing: pip install "bigbatch[{extra}]"') from exc


@contextlib.contextmanager
def held(changes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Within the block each ``(owner, name, value)`` in ``changes`` sets ``owner.name`` to
    ``value``; after it, whatever the block raised, each attribute is what it was."""
    kept = [(owner, name, getattr(owner, name)) for owner, name, _ in changes]
    for owner, name, value in changes:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, old in kept:
            setattr(owner, name, old)


def reshard(model: torch.nn.Module) -> None:
    """Shard FSDP2's units again after forwards without gradients (the audit's diagnosis, the
    trainer's loss probe), which leave some unsharded: the optimizer steps the shards, and the
    next forward must gather them again."""
    for m in model.modules():
        if wrapper_kind(m) == "fsdp" and callable(again := getattr(m, "reshard", None)):
            again()

"""A window's batches as the adapters read them: joined into one batch, and their items counted.

The transformers window joins its batches to run them through an ``Accumulator``
(``bigbatch.integrations._hf_window``); both audits join theirs to compute the one-batch step
(``bigbatch.integrations._audit``); both count a batch's items to read a mean as a sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bigbatch.core._tree import is_column
from bigbatch.core.split import batch_size


def join(batches: Sequence[Any], pad_id: int = 0, key: str = "") -> Any:
    """The micro-batches as one batch: rows concatenated in order, per-token tensors right-padded
    to the longest (``labels`` with -100, ``*input_ids`` with ``pad_id``, the rest with 0); a
    tuple or list of tensors joined per position, a column of ids or strings concatenated."""
    first = batches[0]
    if isinstance(first, Mapping):
        return {k: join([b[k] for b in batches], pad_id, str(k)) for k in first}
    kind = list if isinstance(first, list) else tuple
    if isinstance(first, (tuple, list)) and is_column(first, len(first)):  # ids, strings
        return kind(x for b in batches for x in b)
    if isinstance(first, (tuple, list)):  # per position: TensorDataset's [x, y]
        return kind(join(list(p), pad_id) for p in zip(*batches, strict=True))
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return first
    shape = [max(t.shape[d] for t in batches) for d in range(first.dim())]
    value = -100 if key == "labels" else pad_id if key.endswith("input_ids") else 0

    def pad(t: torch.Tensor) -> torch.Tensor:  # the last dimension first, as F.pad reads them
        widths = [(0, want - n) for want, n in zip(shape[:0:-1], t.shape[:0:-1], strict=True)]
        return torch.nn.functional.pad(t, [w for pair in widths for w in pair], value=value)

    return torch.cat([pad(t) for t in batches])


def count_items(batch: Any, shifts: bool = False) -> Any:
    """The items a mean over ``batch`` averages: its labels that are not -100 (without the first
    of each row when the loss ``shifts``; ``shift_labels`` as given), else its completion tokens
    (``completion_mask``: TRL's GRPO), else its rows."""
    if not isinstance(batch, Mapping):
        return batch_size(batch)
    labels, given = batch.get("shift_labels"), batch.get("labels")
    if labels is None and given is not None:
        labels = given[..., 1:] if shifts and given.dim() >= 2 else given
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        return (labels != -100).sum()
    if isinstance(batch.get("completion_mask"), torch.Tensor):
        return batch["completion_mask"].sum()
    return next(len(v) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim())

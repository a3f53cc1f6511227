"""A window's batches as the adapters read them: joined into one batch, and their items counted.

The transformers window joins its batches to run them through an ``Accumulator``
(``bigbatch.integrations._hf_window``); both audits join theirs to compute the one-batch step
(``bigbatch.integrations._audit``); both count a batch's items to read a mean as a sum. A
flattened batch (one row of several sequences) is read as rows of its sequences, and each
micro-batch flattened again (Note [flattened batches]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bigbatch.core._pack import segment_ids, varlen_arguments
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


FLATTENED = ("position_ids", "seq_idx")  # and cu_seq_lens_*, max_length_*: not per token


def unflatten(batch: Any, pad_id: int = 0) -> Any:
    """A flattened batch as right-padded rows of its sequences with an ``attention_mask``; any
    other batch as it is.

    Note [flattened batches]
        TRL's ``padding_free=True`` and ``packing=True`` (``bfd``), and transformers'
        ``DataCollatorWithFlattening``, give each batch as one row ``[1, T]`` of several sequences:
        ``position_ids`` restart at each, no ``attention_mask`` (the model keeps the sequences apart
        by the positions, or by ``cu_seq_lens_*`` / ``seq_idx``), each sequence's first label -100
        (the token before it is another sequence's). Its samples are its sequences: a window of such
        batches is read as rows of sequences (``unflatten``; a sequence starts where the positions
        do not go on by one, as transformers' ``find_packed_sequence_indices`` reads them), cut by
        the trainer's settings (``micro_batch_size`` counts sequences, ``micro_batch_tokens`` their
        rows padded: at least the flattened row's tokens; ``pack`` packs them), and each micro-batch
        flattened again (``flatten``: positions, and the varlen arguments where the batches had
        them) before the trainer's loss sees it, so that the loss computes what it computes on the
        trainer's own batches. The tokens after a row's last position above 0 are dropped:
        ``pad_to_multiple_of``'s padding (positions 0, labels -100) or a last sequence of one token,
        which predicts nothing. The labels counted, and each one's loss, are the flattened
        batches'; TRL's logged ``num_tokens`` counts the micro-batches' tokens, so without that
        padding (its loss never counted it: its labels are -100).
    """
    positions = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if not torch.is_tensor(positions) or positions.shape[0] != 1 or "attention_mask" in batch:
        return batch
    real = positions[0].nonzero()
    end = int(real[-1]) + 1 if len(real) else 1  # (one host read)
    lengths = torch.bincount(segment_ids(positions[:, :end])[0]).tolist()
    rows: list[dict[str, Any]] = [{"attention_mask": positions.new_ones(1, n)} for n in lengths]
    for key, value in batch.items():  # per token, but where the sequences start (rebuilt)
        if key not in FLATTENED and torch.is_tensor(value) and value.shape[:2] == positions.shape:
            for row, piece in zip(rows, value[0, :end].split(lengths), strict=True):
                row[key] = piece[None]
    return join(rows, pad_id)


def flatten(batch: Mapping[str, Any], varlen: bool) -> dict[str, Any]:
    """Right-padded rows as one row of their tokens (``unflatten`` undone, Note [flattened
    batches]): ``position_ids`` restarting at each row's first; ``varlen``: ``cu_seq_lens_*``,
    ``max_length_*`` and ``seq_idx`` too, as TRL's collator makes them. A batch without an
    ``attention_mask`` (flattened or packed already) as it is."""
    if "attention_mask" not in batch:
        return dict(batch)
    mask = batch["attention_mask"].bool()
    out = {
        k: v[mask][None] if torch.is_tensor(v) and v.shape[:2] == mask.shape else v
        for k, v in batch.items()
    }
    del out["attention_mask"]
    out["position_ids"] = (mask.cumsum(-1) - 1)[mask][None]
    if varlen:
        owner = torch.arange(len(mask), device=mask.device)[:, None].expand_as(mask)[mask]
        out.update(varlen_arguments(mask.sum(-1), owner, 1))
    return out


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

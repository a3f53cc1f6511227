"""Token windows: a window of variable-length text cut by tokens, not by samples.

Note [token windows]
    Cut into micro-batches of a fixed number of samples, text of very different lengths pads
    every micro-batch to its longest sample (30-50% of the tokens computed are padding on
    log-normal lengths), and a micro-batch of long samples runs out of memory while one of short
    samples wastes it. ``TokenCut`` keeps the window the batch the user gave and changes only how
    it is cut: the samples are sorted by length (longest first), each micro-batch takes samples
    while ``rows × its longest length`` stays within the token budget (and ``rows`` within
    ``max_rows``, when given) and each sample wastes at most a quarter of its row in padding
    (``MAX_ROW_PADDING``: a window holds only a few dozen sequences, so its sorted lengths are
    sparse, and packing by the budget alone pads about 30% of the tokens on log-normal lengths,
    against about 12%), and its per-token tensors are trimmed to that length. The loss
    sums and counts are totalled over the window before the step (Note [window normalisation]),
    so the step equals the full batch's whatever the order: a sum does not depend on it. A sample
    longer than the budget gets a micro-batch of its own (one warning).

    Lengths come from ``attention_mask.sum(-1)`` for a mapping batch in the transformers
    convention (``input_ids``, ``attention_mask``, ``labels``, right padding), else from
    ``lengths(batch)``. Per-token tensors are the batch's tensors whose second dimension is its
    padded length. Left padding is refused: trimming a left-padded micro-batch would move its real
    tokens to other positions (other position embeddings, and a shifted loss would lose the
    prediction of the first token), so the step could not be the full batch's.

Note [compile buckets]
    ``torch.compile`` compiles again for every new input shape. With ``pad_to_multiple_of=M`` a
    micro-batch's length is rounded up to a multiple of M (its bucket) and its rows are padded up
    to ``budget // length`` (at most ``max_rows``), so a compiled model sees one shape per bucket.
    Without it every new length is a new shape: past torch's ``recompile_limit`` the compiled
    model falls back to eager, and ``check_shapes`` says so once. Pad rows and columns take
    ``pad_values`` (``input_ids`` 0, ``attention_mask`` 0, ``labels``
    -100, 0 for any other key unless ``pad_values`` says): a label of -100 counts no token, so
    the step is unchanged for a loss that returns ``(loss_sum, count)`` from the labels. A loss
    that returns a mean would average over the pad rows too, and is refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from bigbatch.core._sizing import Sizing
from bigbatch.core._tree import map_tensors, take, tensor_leaves
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core._window import Piece, SampleCut
from bigbatch.core.split import batch_size

PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "labels": -100}
MAX_ROW_PADDING = 0.25  # a sample joins a micro-batch if it pads at most this of its row
PAD_ROWS_NEED_SUMS = (
    "pad_to_multiple_of pads micro-batches with rows that count nothing, and loss_fn returned a "
    "mean, which would average over them too: return (loss_sum, count), e.g. "
    "bigbatch.token_cross_entropy(logits, labels, shift=True) (Note [compile buckets])."
)


def make_cut(
    micro_batch_size: int | str | None, micro_batch_tokens: int | str | None, *options: Any
) -> tuple[Sizing, SampleCut]:
    """The ``Accumulator``'s sizing policy and cut: by samples, or by tokens with
    ``micro_batch_tokens`` (``micro_batch_size`` is then an optional row cap); ``options``:
    ``TokenCut``'s ``pad_to_multiple_of``, ``lengths`` and ``pad_values``.

    Raises:
        TypeError, ValueError: a bad or contradictory setting, named with what is allowed.
    """
    if micro_batch_tokens is None:
        if any(option is not None for option in options):
            raise ValueError(
                "pad_to_multiple_of, lengths and pad_values shape token windows: give "
                "micro_batch_tokens too (e.g. micro_batch_tokens=4096)."
            )
        return Sizing(32 if micro_batch_size is None else micro_batch_size), SampleCut()
    if micro_batch_size == "auto":
        raise ValueError(
            'micro_batch_size="auto" with micro_batch_tokens: the token budget is what auto '
            'sizes; use micro_batch_tokens="auto" and micro_batch_size=None or a row cap.'
        )
    sizing = Sizing(micro_batch_tokens, "micro_batch_tokens")
    return sizing, TokenCut(micro_batch_size, *options)  # type: ignore[arg-type]  # not "auto"


class TokenCut(SampleCut):
    """Cut windows by tokens (Note [token windows], Note [compile buckets]).

    Args:
        max_rows: at most this many rows per micro-batch (``None``: no cap).
        pad_to_multiple_of: round each micro-batch's length up to a multiple of this and pad its
            rows up to the bucket's row count (``None``: trim to the longest sample only).
        lengths: ``lengths(batch)`` -> each sample's length (tokens); default: from the
            ``attention_mask`` of a mapping batch.
        pad_values: the value of a pad row / column per key of a mapping batch.

    Raises:
        TypeError, ValueError: bad options, named with what is allowed.
    """

    def __init__(
        self,
        max_rows: int | None = None,
        pad_to_multiple_of: int | None = None,
        lengths: Callable[[Any], Sequence[int] | torch.Tensor] | None = None,
        pad_values: Mapping[str, float] | None = None,
    ) -> None:
        counts = {"micro_batch_size": max_rows, "pad_to_multiple_of": pad_to_multiple_of}
        for name, n in counts.items():
            if n is not None and (type(n) is not int or n < 1):
                raise ValueError(f"{name}={n!r} is not allowed: use a positive integer or None.")
        if lengths is not None and not callable(lengths):
            raise TypeError(f"lengths={lengths!r} is not callable: pass lengths(batch) -> ints.")
        if pad_values is not None and not isinstance(pad_values, Mapping):
            raise TypeError(f"pad_values={pad_values!r} is not a mapping of key -> pad value.")
        self.max_rows, self.multiple, self.lengths = max_rows, pad_to_multiple_of, lengths
        self.pad_values = {**PAD_VALUES, **(pad_values or {})}
        self.warned = self.warned_shapes = False  # a sample over the budget, too many shapes: once
        self.shapes: set[tuple[int, int]] = set()  # (rows, length) of every micro-batch cut

    def units(self, batch: Any) -> int:
        """The token budget at which the whole window is one micro-batch."""
        return batch_size(batch) * self.floor(batch)

    def floor(self, batch: Any) -> int:
        """The budget at which each micro-batch holds one sample: the longest one's length."""
        return self._round(max(self._lengths(batch)))

    def measure(self, batch: Any) -> tuple[int, int, Callable[[int], list[Piece]]]:
        """``SampleCut.measure``: the lengths read once for the window."""
        lengths = self._lengths(batch)
        floor = self._round(max(lengths))
        return len(lengths) * floor, floor, lambda size: self._cut(batch, size, lengths)

    def __call__(self, batch: Any, size: int) -> list[Piece]:
        return self._cut(batch, size, self._lengths(batch))

    def _cut(self, batch: Any, size: int, lengths: list[int]) -> list[Piece]:
        n = len(lengths)
        order = sorted(range(n), key=lambda i: -lengths[i])  # longest first, stable
        pieces, start = [], 0
        while start < n:
            longest = lengths[order[start]]
            length = self._round(longest)
            if length > size and not self.warned:
                self.warned = True
                warnings.warn(
                    f"a sample of {longest} tokens is longer than micro_batch_tokens={size}: it gets "
                    "a micro-batch of its own (raise micro_batch_tokens if that runs out of memory).",
                    BigBatchWarning,
                    stacklevel=5,
                )
            full = max(1, min(size // length, self.max_rows or size))  # rows a bucket holds
            rows = min(full, n - start)
            if not self.multiple:  # (buckets pad their rows to one shape anyway)
                close = (1 - MAX_ROW_PADDING) * longest
                rows = next((r for r in range(1, rows) if lengths[order[start + r]] < close), rows)
            pad = full - rows if self.multiple else 0
            pieces.append(self._piece(batch, order[start : start + rows], lengths, length, pad))
            start += rows
        return pieces

    def empty(self, batch: Any) -> Piece:
        """No sample and one pad row of length 1 (or the smallest bucket): it counts nothing."""
        return self._piece(batch, [], [], self._round(1), 1)

    def _piece(
        self, batch: Any, index: list[int], lengths: list[int], length: int, pad: int
    ) -> Piece:
        rows, width = take(batch, index, batch_size(batch)), _padded_length(batch)
        items = rows.items() if isinstance(rows, Mapping) else ()
        keys = {id(v): str(k) for k, v in items if isinstance(v, torch.Tensor)}  # for pad values

        def fit(t: torch.Tensor) -> torch.Tensor:
            value = self.pad_values.get(keys.get(id(t), ""), 0)
            if t.dim() >= 2 and t.shape[1] == width:  # a per-token tensor: trim or pad its columns
                t = t[:, :length]
                if t.shape[1] < length:  # a bucket longer than the batch: pad columns
                    extra = t.new_full((t.shape[0], length - t.shape[1], *t.shape[2:]), value)
                    t = torch.cat([t, extra], dim=1)
            return torch.cat([t, t.new_full((pad, *t.shape[1:]), value)]) if pad else t

        self.shapes.add((len(index) + pad, length))
        tokens, padded = sum(lengths[i] for i in index), (len(index) + pad) * length
        order = torch.tensor(index, dtype=torch.long)  # long when empty too
        return Piece(map_tensors(fit, rows), len(index), order, tokens, padded, pad)

    def _lengths(self, batch: Any) -> list[int]:
        """Each sample's length (tokens)."""
        n = batch_size(batch)
        if self.lengths is not None:
            found = self.lengths(batch)
            values = [int(v) for v in (found.tolist() if torch.is_tensor(found) else found)]
            if len(values) != n or any(v < 1 for v in values):
                raise ValueError(
                    f"lengths(batch) returned {len(values)} lengths for {n} samples (or one below "
                    "1): return one positive length (tokens) per sample."
                )
            return values
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise TypeError(
                "micro_batch_tokens needs each sample's length: pass a mapping batch with a 2-D "
                "attention_mask (as transformers does), or lengths=fn, one length per sample."
            )
        ones = mask != 0
        counts = ones.sum(-1)
        gaps = (ones != (torch.arange(ones.shape[1], device=ones.device) < counts[:, None])).any()
        *found, gapped = torch.cat([counts, gaps.reshape(1)]).tolist()  # one host sync
        if gapped:
            raise ValueError(
                "micro_batch_tokens needs right padding (each attention_mask row: ones, then "
                "zeros): trimming a left-padded or gapped micro-batch would move its tokens. Pad "
                'on the right (tokenizer.padding_side = "right") or pass lengths=fn.'
            )
        return [max(1, int(v)) for v in found]

    def check_shapes(self, model: Any) -> None:
        """Warn once when a compiled ``model`` has seen more shapes than torch recompiles for."""
        if self.warned_shapes or not hasattr(model, "_orig_mod"):  # not torch.compile'd
            return
        import torch._dynamo

        limit = getattr(torch._dynamo.config, "recompile_limit", None) or 8
        if len(self.shapes) > limit:
            self.warned_shapes = True
            warnings.warn(
                f"the compiled model has seen {len(self.shapes)} micro-batch shapes, more than "
                f"torch's recompile_limit ({limit}): past it torch runs the model eagerly. Pass "
                "pad_to_multiple_of (e.g. 64) for one shape per bucket (Note [compile buckets]).",
                BigBatchWarning,
                stacklevel=4,
            )

    def _round(self, length: int) -> int:
        return length if self.multiple is None else -(-length // self.multiple) * self.multiple


def _padded_length(batch: Any) -> int:
    """The batch's padded length: the second dimension of its attention mask or first 2-D tensor."""
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
        return int(batch["attention_mask"].shape[1])
    return next((int(t.shape[1]) for _, t in tensor_leaves(batch) if t.dim() >= 2), 0)

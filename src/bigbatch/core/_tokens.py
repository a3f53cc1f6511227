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
    ``lengths(batch)``; a mapping batch's ``labels`` / ``attention_mask`` must hold the pad value
    past each sample's length (``check_extent``), or a trim would drop those tokens.
    Left padding is refused: trimming a left-padded micro-batch would move its real tokens to
    other positions (other position embeddings, and a shifted loss would lose the prediction of
    the first token), so the step could not be the full batch's.

Note [per-token tensors]
    A micro-batch is trimmed to its longest sample by cutting the columns of its per-token
    tensors. Which tensors those are is not guessed from shapes (a per-sample vector of 128
    features in a batch padded to 128 columns would be cut; labels padded to another length than
    the mask would be left whole and the loss fail in torch): in a mapping batch a tensor of two
    or more dimensions is per-token when its key is one of transformers' (``PAD_VALUES``:
    ``input_ids``, ``attention_mask``, ``labels``, ``token_type_ids``, ``position_ids``, ...) or
    given a pad value in ``pad_values``, and has the padded length; ``pad_values={key: None}``
    says a key is not (kept whole). Any other such tensor is refused by ``TokenCut`` in one line
    naming the key and both ways to say it; the sample cut warns once and trims nothing (the
    batch's width is always exact). Tensors without a key (a tuple batch with ``lengths=``) are
    per-token when they have the padded length; another width is refused. Both cuts trim:
    ``TokenCut`` always, and the sample cut (``TrimmedSampleCut``, a fixed number of samples per
    micro-batch) whenever the batch is right-padded text with an ``attention_mask`` (a left-padded
    batch is cut whole), so a fixed-count micro-batch of short samples computes its own length,
    not the whole batch's, and reports its real and padded tokens. Trimming is exact for a model
    that lets no padding reach the real tokens (a causal model, or one that takes the mask): the
    columns cut are padding in every row of the micro-batch.

Note [compile buckets]
    ``torch.compile`` compiles again for every new input shape. With ``pad_to_multiple_of=M`` a
    micro-batch's length is rounded up to a multiple of M (its bucket) and its rows are padded up
    to ``budget // length`` (at most ``max_rows``), so a compiled model sees one shape per bucket.
    Without it every new length is a new shape: past torch's ``recompile_limit`` the compiled
    model falls back to eager, and ``check_shapes`` says so once. Pad rows and columns take
    ``pad_values`` (``input_ids`` 0, ``attention_mask`` 0, ``labels``
    -100, 0 for any other key unless ``pad_values`` says): a label of -100 counts no token, so
    the step is unchanged for a loss that returns ``(loss_sum, count)`` from the labels. A loss
    that returns a mean would average over the pad rows too, and is refused; so is a count that
    is a Python number (``check_pad_rows``): a count of rows, pairs or sequences would count the
    pad rows, and a per-row term would add their losses.
"""

from __future__ import annotations

import numbers
import reprlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from bigbatch.core._tree import map_tensors, take, tensor_leaves
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core._window import Piece, SampleCut
from bigbatch.core.split import batch_size

PAD_VALUES: dict[str, float | None] = {
    "input_ids": 0,
    "attention_mask": 0,
    "labels": -100,
    "token_type_ids": 0,
    "position_ids": 0,
    "inputs_embeds": 0,
    "completion_mask": 0,
    "assistant_masks": 0,
    "pixel_values": None,
}
"""The per-token keys of transformers (and TRL) and their pad value; ``None``: a known key that is
not per-token (an image's pixels). Note [per-token tensors]."""
MAX_ROW_PADDING = 0.25  # a sample joins a micro-batch if it pads at most this of its row
PAD_ROWS_NEED_SUMS = (
    "pad_to_multiple_of pads micro-batches with rows that count nothing, and loss_fn returned a "
    "mean, which would average over them too: return (loss_sum, count), e.g. "
    "bigbatch.token_cross_entropy(logits, labels, shift=True) (Note [compile buckets])."
)


COPIES_INPUT = (
    "loss_fn counted every labelled token of a batch whose labels are its input_ids, as a loss "
    "that does not shift them does: a causal LM then learns to copy its input, and its loss "
    "falls. Shift in the loss, as transformers' causal LMs do: bigbatch.token_cross_entropy("
    "logits, labels, shift=True) (the docs' recommendation), or shift the labels in the data. "
    "Said once."
)


def warn_if_copying(batch: Any, out: Any) -> None:
    """Warn once where ``out`` (a ``(loss_sum, count)`` pair) counts a causal LM's labels without
    shifting them: ``labels`` equal to ``input_ids`` wherever labelled, a first token labelled,
    and a count of every labelled token (a shifted loss counts all but the rows' first). One read
    of the device, at the first micro-batch."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    pair = isinstance(out, tuple) and len(out) == 2 and torch.is_tensor(out[1])
    if not (pair and torch.is_tensor(ids) and torch.is_tensor(labels) and ids.dim() == 2):
        return
    if labels.shape != ids.shape:
        return
    kept: torch.Tensor = labels.ne(-100)  # PAD_VALUES["labels"]
    same = (labels == ids) | ~kept
    found = torch.stack([same.all(), kept[:, 0].any(), out[1].reshape(()) == kept.sum()])
    if all(found.tolist()):
        warnings.warn(COPIES_INPUT, BigBatchWarning, stacklevel=5)


def check_pad_rows(terms: Mapping[str, Any]) -> None:
    """Refuse counts that are numbers on a micro-batch with pad rows (Note [compile buckets]): a
    count of rows, or of sequences or pairs, would count the pad rows, and their terms add up."""
    if named := [name for name, term in terms.items() if not torch.is_tensor(term.count)]:
        raise ValueError(
            f"pad_to_multiple_of pads micro-batches with rows that count nothing, and term "
            f"{named[0]!r} has a count that is a number (of rows, pairs, sequences?), which "
            "would count the pad rows too: return counts computed from the labels or mask as "
            "tensors (a pad row's labels are -100, its mask 0), or drop pad_to_multiple_of."
        )


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
                bucket = f", in a bucket of {length} (pad_to_multiple_of={self.multiple})," * (
                    length > longest
                )
                warnings.warn(
                    f"a sample of {longest} tokens{bucket} is longer than micro_batch_tokens={size}: "
                    "it gets a micro-batch of its own (raise micro_batch_tokens if that runs out of "
                    "memory).",
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
        rows = take(batch, index, batch_size(batch))
        self.shapes.add((len(index) + pad, length))
        tokens, padded = sum(lengths[i] for i in index), (len(index) + pad) * length
        order = torch.tensor(index, dtype=torch.long)  # long when empty too
        width = padded_length(batch, max(lengths, default=0))
        fitted = fit_columns(rows, width, length, self.pad_values, pad)
        part = [lengths[i] for i in index]
        return Piece(fitted, len(index), order, tokens, padded, pad, part, length)

    def _lengths(self, batch: Any) -> list[int]:
        """Each sample's length (tokens), refused where a trim to it would drop a token."""
        n = batch_size(batch)  # (an empty batch, or rows that disagree, refused here)
        if self.multiple and not isinstance(batch, Mapping):  # pads take their value by key
            raise ValueError(
                f"pad_to_multiple_of={self.multiple} pads rows and columns with each key's pad value "
                f"(labels -100, ...), and a {type(batch).__name__} batch has no keys: pass a "
                "mapping batch (a dict), or drop pad_to_multiple_of."
            )
        if self.lengths is not None:
            given = self._given_lengths(batch, n)
            check_extent(batch, given, self.pad_values, "lengths(batch)")
            return given
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise TypeError(
                "micro_batch_tokens needs each sample's length: pass a mapping batch with a 2-D "
                "attention_mask (as transformers does), or lengths=fn, one length per sample."
            )
        if (counted := right_padded(batch, self.pad_values)) is None:
            raise ValueError(
                "micro_batch_tokens needs right padding (each attention_mask row: ones, then "
                "zeros): trimming a left-padded or gapped micro-batch would move its tokens. Pad "
                'on the right (tokenizer.padding_side = "right") or pass lengths=fn.'
            )
        if counted[1]:  # a label past the mask: say where (one more read, only to refuse)
            check_extent(batch, counted[0], self.pad_values)
        return counted[0]

    def _given_lengths(self, batch: Any, n: int) -> list[int]:
        """``lengths(batch)``, refused unless it is one positive integer for each of ``n``."""
        found = self.lengths(batch)  # type: ignore[misc]  # not None: _lengths checked
        flat = found.tolist() if torch.is_tensor(found) and found.dim() == 1 else found
        listed = isinstance(flat, (Sequence, Iterator)) and not isinstance(flat, (str, bytes))
        values = list(flat) if listed else []
        wrong = [
            v
            for v in values
            if not isinstance(v, numbers.Real)
            or isinstance(v, bool)
            or not (float(v) >= 1 and float(v).is_integer())
        ]
        if not listed or len(values) != n or wrong:
            what = (
                f"a length of {wrong[0]!r}"
                if wrong
                else f"{len(values)} lengths for {n} samples"
                if listed
                else f"a tensor of shape {tuple(found.shape)}"
                if torch.is_tensor(found)
                else reprlib.repr(found)
            )
            raise ValueError(
                f"lengths(batch) returned {what}: return one length per sample, a positive "
                "integer (its tokens), as a list or a 1-D tensor."
            )
        longest = max(int(v) for v in values)
        if (width := padded_length(batch, longest)) and longest > width:
            raise ValueError(
                f"lengths(batch) returned a length of {longest} for a batch of {width} columns: a "
                "sample's length counts its tokens, at most its row's width."
            )
        return [int(v) for v in values]

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


class TrimmedSampleCut(SampleCut):
    """Cut by samples (``SampleCut``), each micro-batch of right-padded text trimmed to its longest
    sample (Note [per-token tensors]): what a fixed-count micro-batch computes, and reports.

    Args:
        pad_values: the value of a pad column per key of a mapping batch (Note [per-token tensors]).
    """

    def __init__(self, pad_values: Mapping[str, float | None] | None = None) -> None:
        self.pad_values, self.warned = {**PAD_VALUES, **(pad_values or {})}, False

    def __call__(self, batch: Any, size: int) -> list[Piece]:
        pieces = super().__call__(batch, size)
        if (counted := right_padded(batch, self.pad_values)) is None:  # not text, left padding
            return pieces
        (lengths, labelled), out, start, width = counted, [], 0, padded_length(batch)
        try:
            per_token(batch, width, self.pad_values)
            if labelled:  # a label past the mask: the trim would drop it (say where)
                check_extent(batch, lengths, self.pad_values)
        except ValueError as exc:  # the batch's width is exact: say so once, trim nothing
            if not self.warned:
                warnings.warn(f"{exc} Until then no micro-batch is trimmed.", BigBatchWarning, 4)
            self.warned = True
            return pieces
        for p in pieces:
            part, start = lengths[start : start + p.samples], start + p.samples
            fitted = fit_columns(p.batch, width, max(part), self.pad_values)
            wide = max(part)
            out.append(Piece(fitted, p.samples, None, sum(part), p.samples * wide, 0, part, wide))
        return out


def check_extent(
    batch: Any, lengths: list[int], pad_values: Mapping[str, Any], source: str | None = None
) -> None:
    """Refuse lengths shorter than a sample's labelled (``labels`` not the pad value) or
    attended (``attention_mask`` 1) tokens: trimming to them would drop those tokens.

    Raises:
        ValueError: naming the sample, the token and ``source`` (the lengths' origin).
    """
    width = padded_length(batch)
    for key in ("labels", "attention_mask") if isinstance(batch, Mapping) else ():
        t, pad = batch.get(key), pad_values.get(key)
        if pad is None or not (torch.is_tensor(t) and t.dim() == 2 and t.shape[1] == width):
            continue
        ends = torch.tensor(lengths, device=t.device)[:, None]
        past = torch.arange(width, device=t.device) >= ends
        for i, j in ((t != pad) & past).nonzero()[:1].tolist():
            raise ValueError(
                f"{source or 'attention_mask'} gives sample {i} {lengths[i]} tokens, but its {key} "
                f"is not {pad} at token {j + 1}: trimming micro-batches to these lengths would drop "
                f"that token, and the step would not be the full batch's. Set it to {pad} past "
                "each sample's length, or count it in the sample's length."
            )


def right_padded(
    batch: Any, pad_values: Mapping[str, Any] = PAD_VALUES
) -> tuple[list[int], bool] | None:
    """Each sample's length (at least 1) if ``batch`` is a mapping whose 2-D ``attention_mask``
    is right-padded (each row: ones, then zeros), and whether a label lies past it (not its pad
    value: a trim would drop it, ``check_extent``), read from the device at once; else ``None``."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    ones = mask != 0
    counts = ones.sum(-1)
    gaps = ones != (torch.arange(ones.shape[1], device=ones.device) < counts[:, None])
    labels, pad = batch.get("labels"), pad_values.get("labels")
    past = torch.zeros_like(ones)
    if torch.is_tensor(labels) and labels.shape == mask.shape and pad is not None:
        past = (labels != pad) & ~ones
    flags = torch.stack([gaps.any(), past.any()]).to(counts.dtype)
    *found, gapped, labelled = torch.cat([counts, flags]).tolist()  # one host read
    return None if gapped else ([max(1, int(v)) for v in found], bool(labelled))


def padded_length(batch: Any, longest: int = 0) -> int:
    """The batch's padded length: the second dimension of its attention mask, else of its first
    2-D tensor wide enough for the ``longest`` sample (the tokens ``lengths`` describes: a tuple's
    features of 5 columns before its token ids of 12 are not its tokens)."""
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
        return int(batch["attention_mask"].shape[1])
    widths = [int(t.shape[1]) for _, t in tensor_leaves(batch) if t.dim() >= 2]
    return next((w for w in widths if w >= longest), max(widths, default=0))


def fit_columns(
    batch: Any, width: int, length: int, pad_values: Mapping[str, Any] = PAD_VALUES, rows: int = 0
) -> Any:
    """``batch`` with its per-token tensors (Note [per-token tensors]) cut or padded from
    ``width`` to ``length`` columns, and every tensor padded with ``rows`` rows; pads take
    ``pad_values`` by key (0 for other keys)."""
    tokens, keys = per_token(batch, width, pad_values), _keys(batch)

    def fit(t: torch.Tensor) -> torch.Tensor:
        value = pad_values.get(keys.get(id(t), ""), 0) or 0
        if id(t) in tokens:  # trim or pad its columns
            t = t[:, :length].contiguous()  # as a collator gives it (transformers .view()s labels)
            if t.shape[1] < length:  # a bucket longer than the batch: pad columns
                extra = t.new_full((t.shape[0], length - t.shape[1], *t.shape[2:]), value)
                t = torch.cat([t, extra], dim=1)
        return torch.cat([t, t.new_full((rows, *t.shape[1:]), value)]) if rows else t

    return map_tensors(fit, batch)


def per_token(batch: Any, width: int, pad_values: Mapping[str, Any]) -> set[int]:
    """The ids of ``batch``'s per-token tensors, of ``width`` columns (Note [per-token tensors]).

    Raises:
        ValueError: a tensor that may or may not be per-token, named with how to say which.
    """
    keys, found = _keys(batch), set()
    for path, t in tensor_leaves(batch):
        key = keys.get(id(t))
        if t.dim() < 2 or pad_values.get(key or "", 0) is None:  # not per-token
            continue
        if t.shape[1] != width or key not in (None, *pad_values):
            name = repr(key or "key")
            where = "" if key else "Pass a mapping batch (a dict) and say which by its key: "
            columns = f"{t.shape[1]} columns where the tokens have {width}"
            if t.shape[1] == width:
                columns = f"{width} columns, as many as the tokens"
            raise ValueError(
                f"{path} has {columns}: bigbatch cannot "
                f"tell whether they are tokens. {where or 'Say which: '}pad_values={{{name}: None}} "
                f"keeps it whole (not per-token), {{{name}: 0}} trims it with the tokens (padded "
                f"to {width} columns, 0 its pad value; Task(pad_values=...) for bigbatch train)."
            )
        found.add(id(t))
    return found


def _keys(batch: Any) -> dict[int, str]:
    """The key of each tensor at the top of a mapping batch, by id."""
    items = batch.items() if isinstance(batch, Mapping) else ()
    return {id(v): str(k) for k, v in items if isinstance(v, torch.Tensor)}

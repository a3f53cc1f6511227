"""Packed windows: a window's samples packed whole into rows of one length, and the traps.

Note [packed windows]
    ``PackCut`` keeps the window the batch the user gave (the same samples, the same global
    count) and changes only its layout: the samples are packed whole, first-fit-decreasing
    (``pack``), into rows of ``pack_length`` tokens, and each micro-batch is a group of rows
    within the token budget (``budget // pack_length`` rows, at most ``max_rows``), so every
    micro-batch has rows of one length (and all but a window's last the same number of rows).
    In a packed row the positions restart at each sample (``position_ids``; the padding at a
    row's end goes on counting from its last sample, so a row's segments are its samples: a
    causal model lets no real token see it), the attention mask is dropped (transformers then
    keeps the samples apart by ``position_ids`` under SDPA and eager attention, exact on CPU;
    flex attention too, but it has no backward on CPU in torch 2.13), and with
    ``varlen=True`` the flash-attention arguments come too: ``cu_seq_lens_q/k`` over the
    micro-batch's flattened rows, ``max_length_q/k`` and ``seq_idx`` (which sample each
    token is, for the convolution and linear-attention layers that take it). A per-token
    tensor follows its tokens; a per-sample one (``pad_values={key: None}``) comes with the
    micro-batch's samples, in packed order, which ``segment_ids`` maps each token to. ``Piece.samples`` counts samples, not rows; a loss
    that counts sequences counts them by ``segment_ids``, never by ``input_ids.shape[0]``. A
    model of your own keeps the samples apart with ``block_causal_mask``.

Note [packed labels]
    The packed window counts exactly the unpacked one's labels, and each from the same tokens.
    With ``shift=True`` (a causal LM's loss: position ``t`` predicts label ``t + 1``) the first
    token of every packed sample gets label -100, as transformers' DataCollatorWithFlattening
    does: the token before it is another sample's. Unpacked, that label is never counted either
    when nothing precedes the sample (right padding: it is the row's first token); a
    left-padded sample's first label is predicted from padding there, so it is refused unless it
    is -100 already. Every other label ``t + 1`` of a sample is predicted from the same tokens
    ``0..t`` of the same sample, packed or not, and a label outside the sample's tokens is
    refused (packing drops those tokens). So the labels counted, their number (the window's
    global count) and, if the attention keeps the samples apart, their losses are the same.
    With ``shift=False`` (a label per token) the labels are kept as they are.

Note [packing traps]
    A packed row is exact only if nothing crosses a boundary, and transformers 5.24 crosses
    them silently in four ways (measured, float64, Llama/GPT-2): a forward with ``use_cache``
    on (a causal LM's default, also in training) builds a cache, and packed detection is
    skipped when a cache exists (``masking_utils._preprocess_mask_arguments``): the gradient is
    8% (GPT-2) to 30% (Llama) off here, 86% in the research check; a 2-D mask does the same; without
    ``position_ids`` the positions do not restart at all. Flash attention keeps rows of several
    samples apart only by ``cu_seq_lens`` (it infers them from ``position_ids`` for one row
    only); other implementations are not known to. Linear-attention and convolution layers
    (Qwen3-Next / Qwen3.5 GatedDeltaNet, Mamba, short convolutions) ignore ``position_ids``:
    their state flows from one sample into the next unless they get ``cu_seq_lens`` /
    ``seq_idx``, which only their kernels (flash-linear-attention, causal-conv1d) take
    (transformers' torch fallbacks raise when given them). ``check_forward`` (a forward
    pre-hook) and ``check_model`` refuse each case, naming the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from bigbatch.core._pack_audit import replay
from bigbatch.core._sync import wrapper_kind
from bigbatch.core._tokens import TokenCut, padded_length, per_token
from bigbatch.core._tree import take
from bigbatch.core._window import Piece
from bigbatch.core.split import batch_size

APART_BY_POSITIONS = ("sdpa", "eager", "flex_attention")  # transformers' packed mask
APART_BY_VARLEN = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
BLIND_LAYERS = ("DeltaNet", "DeltaAttention", "Mamba", "LinearAttention", "LightningAttention")
"""Class-name parts of layers that carry state along the sequence (Note [packing traps]), in
transformers 5.24: Qwen3-Next / Qwen3.5, Kimi-Linear, Bailing, Mamba(2), Jamba, Zamba, RWKV,
MiniMax; with every ``nn.Conv1d`` over more than one position (LFM2's short convolutions)."""
FORWARD_TRAPS = (
    "use_cache is on, so transformers builds a cache and attends across the samples: set "
    "model.config.use_cache = False (or pass use_cache=False)",
    "a 2-D attention_mask was given, so transformers attends across the samples: pass none "
    "(position_ids keep them apart)",
    "no position_ids were given, so positions do not restart at each sample and the samples "
    "attend each other: pass the batch's position_ids",
)
"""What ``check_forward`` refuses, and the fix (Note [packing traps])."""


def pack(lengths: Sequence[int], length: int) -> list[list[int]]:
    """Samples packed whole into rows of ``length`` tokens, first-fit-decreasing.

    Args:
        lengths: each sample's tokens, each at most ``length``.
        length: the row length.

    Returns:
        The rows, each the indices of its samples (longest first); the rows in order of opening.

    Example:
        >>> pack([3, 5, 2, 4], 8)
        [[1, 0], [3, 2]]
    """
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), len(rows))
        if row == len(rows):
            rows.append([])
            free.append(length)
        rows[row].append(i)
        free[row] -= lengths[i]
    return rows


class PackCut(TokenCut):
    """Cut windows of text into micro-batches of packed rows (Note [packed windows]).

    Args:
        pack_length: tokens per row, at least the longest sample's.
        max_rows: at most this many rows per micro-batch (``None``: the budget decides).
        lengths: ``lengths(batch)`` -> each sample's tokens, from its first column (right
            padding); default: the ``attention_mask`` (right or left padding).
        pad_values: the pad value per key of a mapping batch; ``None``: a per-sample tensor.
        shift: the loss predicts label ``t + 1`` at ``t``: each sample's first label becomes
            -100 (Note [packed labels]).
        varlen: add the flash-attention arguments and ``seq_idx``.

    Raises:
        ValueError, TypeError: bad options, named with what is allowed.
    """

    def __init__(
        self,
        pack_length: int,
        max_rows: int | None = None,
        lengths: Callable[[Any], Sequence[int] | torch.Tensor] | None = None,
        pad_values: Mapping[str, float | None] | None = None,
        shift: bool = True,
        varlen: bool = False,
    ) -> None:
        if type(pack_length) is not int or pack_length < 1:
            raise ValueError(
                f"pack={pack_length!r} is not allowed: use a positive integer (tokens per row)."
            )
        # (pad_values may hold None: a per-sample key, Note [packed windows])
        super().__init__(max_rows, None, lengths, pad_values)  # type: ignore[arg-type]
        self.length, self.shift, self.varlen = pack_length, shift, varlen
        self.budget: int | None = None  # the token budget when fixed (Cut sets it)
        self.audited = False  # Note [packing audit]: the first window replayed unpacked

    def bind(self, model: torch.nn.Module) -> None:
        """Refuse a model that cannot keep packed samples apart (``check_model``); a flash
        attention's model gets the varlen arguments."""
        config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
        self.varlen |= getattr(config, "_attn_implementation", None) in APART_BY_VARLEN
        check_model(model, self.varlen)

    def audit(self, model: torch.nn.Module, batch: Any, loss_fn: Any) -> None:
        """The first window, packed, against its samples unpacked (Note [packing audit]): at the
        fixed budget's micro-batches, one row each under auto; on each rank alone (DDP's module),
        not where the model is sharded (FSDP, DeepSpeed: a replay would gather alone)."""
        kind, audited, self.audited = wrapper_kind(model), self.audited, True
        if not audited and kind in ("plain", "ddp"):  # each rank its own, communicating none
            pieces = self.measure(batch)[2](self.budget or self.length)
            whole: Any = model.module if kind == "ddp" else model
            replay(whole, loss_fn, batch, pieces)

    @contextlib.contextmanager
    def during(self, model: torch.nn.Module) -> Iterator[None]:
        """Each forward of the window's transformers model is checked (``check_forward``)."""
        owner: Any = next((m for m in model.modules() if hasattr(m, "config")), model)
        hook = owner.register_forward_pre_hook(check_forward, with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()

    def units(self, batch: Any) -> int:
        """The token budget at which the whole window is one micro-batch."""
        return self.measure(batch)[0]

    def floor(self, batch: Any) -> int:
        """One row per micro-batch."""
        return self.length

    def measure(self, batch: Any) -> tuple[int, int, Callable[[int], list[Piece]]]:
        """``SampleCut.measure``: the lengths read and the window packed once."""
        lengths, starts = self._spans(batch)
        rows, tokens = pack(lengths, self.length), self._per_token(batch)
        n, width = len(lengths), padded_length(batch)
        sources = [i * width + s for i, s in enumerate(starts)]

        def cut(size: int) -> list[Piece]:
            k = max(1, min(size // self.length, self.max_rows or size))
            groups = [rows[r : r + k] for r in range(0, len(rows), k)]
            if self.multiple:  # one shape: the last group's rows padded (Note [compile buckets])
                groups[-1] += [[] for _ in range(k - len(groups[-1]))]
            return [self._packed(batch, g, lengths, sources, tokens, n) for g in groups]

        return len(rows) * self.length, self.length, cut

    def __call__(self, batch: Any, size: int) -> list[Piece]:
        return self.measure(batch)[2](size)

    def empty(self, batch: Any) -> Piece:
        """One row of padding: it counts nothing."""
        return self._packed(batch, [[]], [], [], self._per_token(batch), batch_size(batch))

    def _packed(
        self,
        batch: Mapping[str, Any],
        rows: list[list[int]],
        lengths: list[int],
        sources: list[int],
        tokens: set[str],
        n: int,
    ) -> Piece:
        """Rows of samples as one micro-batch: each per-token tensor gathered into the rows."""
        order = [i for row in rows for i in row]
        device = next(t.device for t in batch.values() if torch.is_tensor(t))
        span, owner, position, kept, source = layout(rows, lengths, sources, self.length, device)
        out: dict[str, Any] = {}
        for key, value in batch.items():
            if key in ("attention_mask", "position_ids"):  # dropped, replaced
                continue
            if key in tokens:
                out[key] = _gather(value, kept, source, self.pad_values.get(key) or 0, len(rows))
            else:
                out[key] = take(value, order, n)  # per sample (or per batch: whole)
        out["position_ids"] = position.view(len(rows), -1)
        if self.shift and "labels" in out:  # Note [packed labels]
            out["labels"] = out["labels"].masked_fill(out["position_ids"] == 0, -100)
        if self.varlen:
            out.update(varlen_arguments(span, owner, len(rows)))
        self.shapes.add((len(rows), self.length))
        kept_tokens = sum(lengths[i] for i in order)
        index = torch.tensor(order, dtype=torch.long)
        part = [lengths[i] for i in order]
        computed = len(rows) * self.length
        empty = sum(not row for row in rows)  # pad rows: no sample, no count (one shape)
        return Piece(out, len(order), index, kept_tokens, computed, empty, part, self.length)

    def _per_token(self, batch: Any) -> set[str]:
        """The keys of the per-token tensors; a per-sample tensor not declared is refused."""
        width = padded_length(batch)
        ids = per_token(batch, width, self.pad_values)
        keys = {k for k, v in batch.items() if id(v) in ids}
        for key, value in batch.items():
            declared = key in self.pad_values and self.pad_values[key] is None
            if torch.is_tensor(value) and key not in keys and not declared:
                raise ValueError(
                    f"batch[{key!r}] holds one value per sample (shape {tuple(value.shape)}), and "
                    "a packed row holds several samples: pass pad_values={"
                    f"{key!r}: None}} to have it per sample (each micro-batch's rows in packed "
                    "order; segment_ids(position_ids) says which sample each token is)."
                )
        return keys

    def _spans(self, batch: Any) -> tuple[list[int], list[int]]:
        """Each sample's length and first column (one host read), refused where packing would
        change the step (``spans_wrong``)."""
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if not isinstance(batch, Mapping) or (self.lengths is None and not _tokens(mask, None)):
            raise TypeError(
                "packing needs each sample's length: pass a mapping batch (a dict, as "
                f"transformers' collators give; got {type(batch).__name__}) with a 2-D "
                "attention_mask, or lengths=fn, one length per sample."
            )
        n, width = batch_size(batch), padded_length(batch)
        if self.lengths is not None:
            device = next(t.device for t in batch.values() if torch.is_tensor(t))
            counts = torch.tensor(self._given_lengths(batch, n), device=device)
            firsts = torch.zeros_like(counts)
        else:  # the first attended column, and how many
            ones = torch.as_tensor(mask).ne(0)
            counts, firsts = ones.sum(-1).clamp_min(1), ones.int().argmax(-1)
        wrong = spans_wrong(batch, counts, firsts, width, self.shift)
        flags = [w.any() for w in wrong.values()]
        found = torch.cat([counts, firsts.to(counts.dtype), torch.stack(flags).to(counts.dtype)])
        read = found.tolist()  # one host read
        for (what, w), flag in zip(wrong.items(), read[2 * n :], strict=True):
            if flag:
                i, j = w.nonzero()[0].tolist()
                raise ValueError(f"sample {i} cannot be packed (column {j}): {what}.")
        if (longest := max(read[:n])) > self.length:
            raise ValueError(
                f"a sample has {longest} tokens, more than pack={self.length}: packing "
                f"never splits a sample; use pack={longest} or more, or truncate it."
            )
        return read[:n], read[n : 2 * n]


def spans_wrong(
    batch: Mapping[str, Any], counts: torch.Tensor, firsts: torch.Tensor, width: int, shift: bool
) -> dict[str, torch.Tensor]:
    """Where packing samples of ``counts`` tokens from column ``firsts`` would change the step
    (Note [packed labels]), by what: ``{what: [samples, width] booleans}``, for the keys given."""
    column = torch.arange(width, device=counts.device)[None, :] - firsts[:, None]
    inside = (column >= 0) & (column < counts[:, None])
    found = {}
    mask, labels, given = (batch.get(k) for k in ("attention_mask", "labels", "position_ids"))
    if _tokens(mask, width):
        what = (
            "its attention_mask is 1 outside its tokens (one run from its first): give it one run"
        )
        found[what] = (mask != 0) & ~inside
    if _tokens(labels, width):
        what = "it has a label outside its tokens, which packing drops: make it -100"
        found[what] = (labels != -100) & ~inside
        what = (
            "it is left-padded and labelled at its first token (predicted from padding "
            "unpacked): make that label -100, as DataCollatorWithFlattening does, or pad right"
        )
        found[what] = (labels != -100) & (column == 0) & (firsts[:, None] > 0) & shift
    if _tokens(given, width):
        what = "its position_ids do not count 0, 1, ... from its first token: drop them"
        found[what] = (given != column) & inside
    return found


def _tokens(t: Any, width: int | None) -> bool:
    """A tensor of one value per token (``width`` columns; ``None``: any)."""
    return torch.is_tensor(t) and t.dim() == 2 and t.shape[1] == (width or t.shape[1])


def layout(
    rows: list[list[int]], lengths: list[int], sources: list[int], length: int, device: Any
) -> tuple[torch.Tensor, ...]:
    """Where the tokens of packed ``rows`` go: each segment's columns (a sample, its row's
    padding with its row's last), each column's segment, its position in it, whether it is a
    real token, and the real ones' places in the flattened source (``sources``: each sample's
    first token there)."""
    spans, real, start = [], [], []
    for row in rows:
        spans += [lengths[i] for i in row] or [0]
        spans[-1] += length - sum(lengths[i] for i in row)
        real += [lengths[i] for i in row] or [0]
        start += [sources[i] for i in row] or [0]
    span = torch.tensor(spans, device=device)
    owner = torch.repeat_interleave(torch.arange(len(spans), device=device), span)
    position = torch.arange(len(owner), device=device) - (span.cumsum(0) - span)[owner]
    kept = position < torch.tensor(real, device=device)[owner]
    source = (torch.tensor(start, device=device)[owner] + position)[kept]
    return span, owner, position, kept, source


def _gather(
    t: torch.Tensor, kept: torch.Tensor, source: torch.Tensor, value: float, rows: int
) -> torch.Tensor:
    """``t``'s tokens at ``source`` (of its flattened rows) in the packed places ``kept``."""
    flat = t.reshape(-1, *t.shape[2:])
    out = flat.new_full((kept.numel(), *t.shape[2:]), value)
    out[kept] = flat[source]
    return out.view(rows, -1, *t.shape[2:])


def varlen_arguments(span: torch.Tensor, owner: torch.Tensor, rows: int) -> dict[str, Any]:
    """The flash-attention varlen arguments of packed rows whose segments have ``span`` columns
    (over the flattened rows), and ``seq_idx`` (``owner``: each token's segment)."""
    bounds = torch.cat([span.new_zeros(1), span.cumsum(0)]).to(torch.int32)
    longest, seq_idx = int(span.max()), owner.view(rows, -1).to(torch.int32)
    keys = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
    return dict(zip(keys, (bounds, bounds, longest, longest, seq_idx), strict=True))


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which sample each token of packed rows is, numbered over the rows in order.

    A sample starts where a row starts or its positions do not go on by one (as transformers'
    ``find_packed_sequence_indices`` reads them); a row's padding is its last sample's.

    Example:
        >>> segment_ids(torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 0, 1]])).tolist()
        [[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]]
    """
    step = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 2) != 1
    return step.flatten().cumsum(0).view_as(position_ids) - 1


def block_causal_mask(position_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """A ``[rows, 1, L, L]`` boolean mask (``True``: may attend) keeping packed samples apart,
    for ``torch.nn.functional.scaled_dot_product_attention(..., attn_mask=mask)``.

    Dense, so it costs ``L²`` per row whatever the samples (Note [packing traps]: varlen
    kernels cost the samples' own squares).
    """
    segments = segment_ids(position_ids)
    mask = segments[:, :, None] == segments[:, None, :]
    if causal:
        length = position_ids.shape[-1]
        mask &= torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return mask[:, None]


def check_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Refuse a forward of packed rows that lets the samples see each other (Note [packing
    traps]): use as ``model.register_forward_pre_hook(check_forward, with_kwargs=True)``.

    Raises:
        ValueError: naming the argument and the fix.
    """
    config, cache = getattr(module, "config", None), kwargs.get("use_cache")
    cached = config is not None and (
        getattr(config, "use_cache", False) if cache is None else cache
    )
    unplaced = config is not None and kwargs.get("position_ids") is None
    found = (cached, _tokens(kwargs.get("attention_mask"), None), unplaced)
    for wrong, what in zip(found, FORWARD_TRAPS, strict=True):
        if wrong:
            raise ValueError(f"a forward of packed rows: {what}.")


def check_model(model: torch.nn.Module, varlen: bool) -> None:
    """Refuse a model that cannot keep packed samples apart (Note [packing traps]).

    Args:
        model: the module (a transformers model is read through its ``config``).
        varlen: whether the packed batches carry ``cu_seq_lens_*`` and ``seq_idx``.

    Raises:
        ValueError: naming the attention implementation or the layer, and the fix.
    """
    config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    impl = getattr(config, "_attn_implementation", None)
    known = APART_BY_POSITIONS + APART_BY_VARLEN
    if impl is not None and (impl not in known or (impl in APART_BY_VARLEN and not varlen)):
        fix = "varlen=True" if impl in APART_BY_VARLEN else f"one of {', '.join(known)}"
        raise ValueError(
            f"attention implementation {impl!r} does not keep packed rows of several samples "
            f"apart: use {fix} (e.g. attn_implementation='sdpa'), or do not pack."
        )
    for name, layer in model.named_modules():
        kind = type(layer).__name__
        conv = isinstance(layer, torch.nn.Conv1d) and layer.kernel_size[0] > 1
        if (conv or any(part in kind for part in BLIND_LAYERS)) and not varlen:
            raise ValueError(
                f"layer {name!r} ({kind}) carries state along the sequence and ignores "
                "position_ids: packed samples would leak into each other. Pack with varlen=True "
                "(cu_seq_lens, seq_idx) and kernels that take them (flash-linear-attention, "
                "causal-conv1d), or do not pack."
            )

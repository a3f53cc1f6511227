"""Packed windows (Note [packed windows], Note [packed labels]): the cut, its counts, its refusals,
and a model of one's own kept exact by ``block_causal_mask`` (float64), through
``Accumulator(..., pack=...)``.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cases import OPTIMIZERS
from reference import full_batch_step, max_relative_error
from refusals import assert_refused

import bigbatch
from bigbatch.core._pack import (
    PackCut,
    block_causal_mask,
    check_forward,
    check_model,
    pack,
    segment_ids,
)
from bigbatch.core.loss import token_cross_entropy

VOCAB, WIDTH = 23, 16
TOLERANCE = {"sgd_momentum": 1e-12, "adamw": 1e-10}
"""Parameters after two steps. AdamW divides each update by its root mean square, so an element
whose gradient is near 0 moves by its rounding (``test_the_packed_gradient_is_the_full_batch's``
compares the gradients themselves at 1e-12)."""


def text(n: int, gen: torch.Generator, left: bool = False, sft: bool = False, width: int = 16):
    """``n`` samples of 1 to ``width`` tokens, right- (or left-) padded, labels -100 off the
    tokens; ``sft``: a prompt of random length masked; left padding: each first label masked."""
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    lengths[0] = width
    column = torch.arange(width)[None, :]
    first = width - lengths[:, None] if left else torch.zeros(n, 1, dtype=torch.long)
    inside = (column >= first) & (column < first + lengths[:, None])
    ids = torch.randint(1, VOCAB, (n, width), generator=gen) * inside
    keep = inside & (column > first) if left else inside.clone()
    if sft:
        prompt = (torch.rand(n, 1, generator=gen) * lengths[:, None]).long()
        keep &= column >= first + prompt
    labels = torch.where(keep, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": inside.long(), "labels": labels}


def pairs(batch: dict, tokens: str = "input_ids") -> list[tuple[tuple[int, ...], int]]:
    """Each counted (shifted) label with the tokens that predict it, sorted: what the loss sees
    if attention keeps samples apart (a packed row's segments by ``segment_ids``)."""
    ids, labels = batch[tokens], batch["labels"]
    if "position_ids" in batch:
        segments = segment_ids(batch["position_ids"])
    else:
        segments = torch.arange(len(ids))[:, None].expand_as(ids) * (batch["attention_mask"] > 0)
    found = []
    for r, c in (labels[:, 1:] != -100).nonzero().tolist():
        same = (segments[r, : c + 1] == segments[r, c]) & (segments[r, c] >= 0)
        context = ids[r, : c + 1][same if "position_ids" in batch else same.bool()]
        found.append((tuple(context.tolist()), int(labels[r, c + 1])))
    return sorted(found)


def test_pack_is_first_fit_decreasing(gen):
    assert pack([3, 5, 2, 4], 8) == [[1, 0], [3, 2]]
    assert pack([6, 6, 6], 6) == [[0], [1], [2]]
    for _ in range(20):
        lengths = torch.randint(1, 33, (int(torch.randint(1, 60, (1,), generator=gen)),))
        rows = pack(lengths.tolist(), 32)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 32 for row in rows)
        loads = [sum(lengths[i] for i in row) for row in rows]  # first fit: no later row fits
        assert all(
            loads[r] + min(lengths[i] for i in row) > 32
            for r in range(len(rows))
            for row in rows[r + 1 :]
        )


@pytest.mark.parametrize("left, sft", [(False, False), (True, False), (False, True), (True, True)])
def test_the_packed_window_counts_the_same_labels(left, sft, gen):
    """Note [packed labels], checked: every counted label, with the tokens that predict it."""
    for _ in range(5):
        batch = text(11, gen, left, sft)
        pieces = PackCut(24)(batch, 48)  # 2 rows a micro-batch
        packed = sorted(p for piece in pieces for p in pairs(piece.batch))
        assert packed == pairs(batch)
        lengths = batch["attention_mask"].sum(-1)
        assert sum(p.tokens for p in pieces) == int(lengths.sum())
        assert [p.padded_tokens for p in pieces] == [24 * len(p.batch["input_ids"]) for p in pieces]
        assert sorted(torch.cat([p.rows for p in pieces]).tolist()) == list(range(11))
        assert {tuple(p.batch["input_ids"].shape) for p in pieces} <= {(2, 24), (1, 24)}


def test_rows_and_micro_batches(gen):
    batch = text(10, gen)
    cut = PackCut(16, max_rows=2, varlen=True)
    units, floor, at = cut.measure(batch)
    rows = pack(batch["attention_mask"].sum(-1).tolist(), 16)
    assert (units, floor) == (16 * len(rows), 16)
    pieces = at(10_000)  # the row cap: 2 rows each, the last 1 or 2
    assert [len(p.batch["input_ids"]) for p in pieces] == [2] * (len(rows) // 2) + [1] * (
        len(rows) % 2
    )
    assert "attention_mask" not in pieces[0].batch
    for piece in pieces:
        b, flat = piece.batch, piece.batch["seq_idx"].flatten()
        bounds = b["cu_seq_lens_q"].tolist()
        assert bounds[-1] == flat.numel() and b["max_length_q"] == max(
            map(int, torch.diff(b["cu_seq_lens_q"]))
        )
        assert all(
            flat[s:e].unique().numel() == 1 for s, e in zip(bounds, bounds[1:], strict=False)
        )
        assert torch.equal(b["seq_idx"].long(), segment_ids(b["position_ids"]))
    empty = cut.empty(batch)
    assert empty.samples == 0 and empty.batch["labels"].eq(-100).all()
    assert empty.batch["position_ids"].tolist() == [list(range(16))]


def test_lengths_given_by_a_function(gen):
    """``lengths=fn``: each sample's tokens from its first column, with or without a mask."""
    batch = text(8, gen)
    given = batch["attention_mask"].sum(-1).tolist()
    unmasked = {k: v for k, v in batch.items() if k != "attention_mask"}
    pieces = PackCut(16, lengths=lambda b: given)(unmasked, 32)
    assert sum(p.tokens for p in pieces) == sum(given)
    assert sorted(q for p in pieces for q in pairs(p.batch)) == pairs(batch)
    with pytest.raises(ValueError, match=r"lengths\(batch\) returned a length of 0"):
        PackCut(16, lengths=lambda b: [0] * 8)(batch, 32)
    shorter = [max(1, n - 1) for n in given]  # the mask attends a token the lengths drop
    with pytest.raises(ValueError, match=r"its attention_mask is 1 outside its tokens"):
        PackCut(16, lengths=lambda b: shorter)(batch, 32)


def test_per_token_tensors_follow_their_tokens_and_per_sample_ones_are_declared(gen):
    batch = text(9, gen)
    batch["token_type_ids"] = batch["input_ids"] * 2
    batch["score"] = torch.randn(9, generator=gen)
    with pytest.raises(
        ValueError, match=re.escape("batch['score'] holds one value per sample (shape (9,))")
    ):
        PackCut(16)(batch, 32)
    for piece in PackCut(16, pad_values={"score": None})(batch, 32):
        b = piece.batch
        assert torch.equal(b["token_type_ids"], b["input_ids"] * 2)
        assert torch.equal(b["score"], batch["score"][piece.rows])
        kept = b["labels"] != -100  # a token's sample, by segment_ids
        token_scores = b["score"][segment_ids(b["position_ids"])][kept]
        expected = [
            float(batch["score"][i])
            for i in piece.rows
            for _ in range(int(batch["labels"][i].ne(-100).sum()) - 1)
        ]
        assert sorted(token_scores.tolist()) == sorted(expected)


def refused(batch: dict, match: str, **kwargs) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        PackCut(**{"pack_length": 16, **kwargs})(batch, 32)


def test_what_cannot_be_packed_is_refused(gen):
    batch = text(6, gen)
    refused(
        batch,
        r"a sample has 16 tokens, more than pack=8: .* use pack=16",
        pack_length=8,
    )
    gap = {**batch, "attention_mask": batch["attention_mask"].clone()}
    gap["attention_mask"][0, 3] = 0
    refused(
        gap,
        r"sample 0 cannot be packed \(column 15\): its attention_mask is 1 outside its tokens",
    )
    stray = {**batch, "labels": batch["labels"].clone()}
    stray["labels"][1, -1] = 5
    refused(
        stray,
        r"sample 1 cannot be packed \(column 15\): it has a label outside its tokens, .* -100",
    )
    left = text(6, gen, left=True)
    left["labels"] = torch.where(left["attention_mask"] > 0, left["input_ids"], -100)
    refused(
        left,
        r"sample \d cannot be packed \(column \d+\): it is left-padded and labelled at its "
        r"first token .* or pad right",
    )
    PackCut(16, shift=False)(left, 32)  # a label per token: nothing is predicted from padding
    positions = {**batch, "position_ids": torch.arange(16).expand(6, 16) + 1}
    refused(
        positions,
        r"sample 0 cannot be packed \(column 0\): its position_ids do not count .* drop them",
    )
    refused(
        (batch["input_ids"], batch["labels"]),
        r"packing needs each sample's length: pass a mapping batch .* got tuple",
    )
    refused({"input_ids": batch["input_ids"]}, r"packing needs each sample's length")
    refused(batch, r"pack=0 is not allowed: use a positive integer", pack_length=0)


class OwnLM(nn.Module):
    """A causal LM of one's own that takes ``position_ids`` and keeps samples apart with
    ``block_causal_mask`` (padding: positions that do not go on by one, so a sample each)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(32, WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor, segments=None) -> torch.Tensor:
        x = self.embed(ids) + self.pos(position_ids)
        rows, length = ids.shape
        q, k, v = self.qkv(x).view(rows, length, 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        mask = block_causal_mask(position_ids if segments is None else segments)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(rows, length, WIDTH))
        return self.head(torch.tanh(x))


def own_loss(model: nn.Module, batch: dict):
    positions = batch.get("position_ids")
    if positions is None:  # unpacked: each sample's own positions, padding a segment a token
        positions = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    return token_cross_entropy(model(batch["input_ids"], positions), batch["labels"], shift=True)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "left, sft, budget", [(False, False, 32), (True, True, 48), (False, True, 10_000)]
)
def test_a_packed_window_equals_the_full_batch(left, sft, budget, optimizer, gen):
    torch.manual_seed(0)
    init = OwnLM().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    ref_opt, opt = (
        OPTIMIZERS[optimizer](ref.parameters()),
        OPTIMIZERS[optimizer](model.parameters()),
    )
    acc = bigbatch.Accumulator(model, opt, micro_batch_tokens=budget, pack=24)
    for _ in range(2):
        batch = text(10, gen, left, sft)
        full_batch_step(ref, ref_opt, own_loss, batch)
        result = acc.train_step(batch, own_loss)
        assert result.tokens == int(batch["attention_mask"].sum())
        assert result.padded_tokens == 24 * len(pack(batch["attention_mask"].sum(-1).tolist(), 24))
        assert result.count == int((batch["labels"][:, 1:] != -100).sum())
    assert max_relative_error(ref, model) < TOLERANCE[optimizer]


def gradient(model: nn.Module, loss_fn, pieces: list) -> torch.Tensor:
    """The window's gradient: each piece's loss sum back-propagated, divided by the total count."""
    model.zero_grad(set_to_none=True)
    count = 0
    for piece in pieces:
        loss_sum, n = loss_fn(model, piece)
        loss_sum.backward()
        count += int(n)
    return torch.cat([p.grad.flatten() for p in model.parameters()]) / count


@pytest.mark.parametrize("left, sft", [(False, False), (True, True)])
def test_the_packed_gradient_is_the_full_batch(left, sft, gen):
    torch.manual_seed(0)
    model, batch = OwnLM().double(), text(10, gen, left, sft)
    full = gradient(model, own_loss, [batch])
    packed = gradient(model, own_loss, [p.batch for p in PackCut(24)(batch, 48)])
    assert float((packed - full).norm() / full.norm()) < 1e-12


def test_block_causal_mask():
    mask = block_causal_mask(torch.tensor([[0, 1, 2, 0, 1]]))
    assert mask.shape == (1, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert block_causal_mask(torch.tensor([[0, 1, 0]]), causal=False)[0, 0].int().tolist() == [
        [1, 1, 0],
        [1, 1, 0],
        [0, 0, 1],
    ]


def test_a_layer_that_ignores_boundaries_and_a_leaking_forward_are_refused():
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Conv1d(WIDTH, WIDTH, 4, groups=WIDTH))
    with pytest.raises(
        ValueError, match=r"layer '1' \(Conv1d\) carries state along the sequence .* varlen=True"
    ):
        check_model(model, varlen=False)
    check_model(model, varlen=True)  # cu_seq_lens / seq_idx given: the kernels' business
    check_model(OwnLM(), varlen=False)
    with pytest.raises(
        ValueError,
        match=r"a 2-D attention_mask was given, .* pass none",
    ):
        check_forward(OwnLM(), (), {"attention_mask": torch.ones(2, 4)})
    check_forward(
        OwnLM(), (), {"attention_mask": torch.ones(2, 1, 4, 4, dtype=torch.bool)}
    )  # a block mask


class LeakyLM(OwnLM):
    """``OwnLM`` whose attention is causal over the whole row: packed samples see each other."""

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        flat = torch.arange(ids.shape[1]).expand_as(ids)  # one segment per row
        return super().forward(ids, position_ids, segments=flat)


def test_the_audit_stops_a_packed_run_whose_model_leaks_across_samples(gen):
    """Note [packing audit]: the first window replayed unpacked; the model unchanged."""
    torch.manual_seed(0)
    model = LeakyLM().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), pack=24)
    with assert_refused(model, ValueError, match=r"^packing changed the first window: its loss"):
        acc.train_step(text(10, gen), own_loss)


def test_the_audit_stops_a_loss_that_does_not_shift(gen):
    """A loss per token (no shift) loses each packed sample's first label: the count differs."""
    torch.manual_seed(0)
    model = OwnLM().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), pack=24)

    def tagger(m, b):  # a label per token, unshifted
        positions = b.get("position_ids")
        if positions is None:
            positions = (b["attention_mask"].cumsum(-1) - 1).clamp_min(0)
        return token_cross_entropy(m(b["input_ids"], positions), b["labels"], shift=False)

    with assert_refused(model, ValueError, match=r"its count is .* Pack only a causal LM's"):
        acc.train_step(text(10, gen), tagger)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_pad_to_multiple_of_gives_a_packed_run_one_shape(optimizer, gen):
    """Issue 38: with pad_to_multiple_of every micro-batch of a packed run has one shape (the
    last one of a window padded with empty rows, which count nothing: Note [compile buckets]);
    still the full batch's step, and a mean loss is refused (it would average over pad rows)."""
    torch.manual_seed(0)
    init = OwnLM().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    ref_opt, opt = (OPTIMIZERS[optimizer](m.parameters()) for m in (ref, model))
    acc = bigbatch.Accumulator(model, opt, micro_batch_tokens=72, pack=24, pad_to_multiple_of=8)
    shapes = set()

    def recorded(m, b):
        if "attention_mask" not in b:  # packed (the audit's replay also runs it unpacked)
            shapes.add(tuple(b["input_ids"].shape))
        return own_loss(m, b)

    for _ in range(3):
        batch = text(10, gen)
        full_batch_step(ref, ref_opt, own_loss, batch)
        acc.train_step(batch, recorded)
    assert shapes == {(3, 24)}, shapes
    assert max_relative_error(ref, model) < TOLERANCE[optimizer]
    mean = lambda m, b: own_loss(m, b)[0] / own_loss(m, b)[1]  # noqa: E731
    with assert_refused(model, ValueError, match="pad_to_multiple_of pads micro-batches with rows"):
        acc.train_step(text(10, gen), mean)

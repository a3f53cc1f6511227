"""Packed windows on 2 real gloo ranks (issue 38), float64: a causal LM of one's own that keeps
packed samples apart (``block_causal_mask``), a loss of two named terms counted by labelled tokens,
rank 1 holding far fewer tokens than rank 0: DDP's packed step equals one full-batch step on the
union, as the unpacked full batch defines it."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import OPTIMIZERS
from ranks import run_ranks
from reference import full_batch_step, max_relative_error
from test_pack import OwnLM, own_loss, text
from torch.nn.parallel import DistributedDataParallel as DDP

import bigbatch

pytestmark = pytest.mark.slow  # real gloo ranks
STEPS = 2


def terms(model: torch.nn.Module, batch: dict) -> dict:
    """Two named terms, each over the labelled (shifted) tokens: the token loss, and 0.1 of a
    z-loss-like square of each labelled token's log-partition."""
    lm = own_loss(model, batch)
    positions = batch.get("position_ids")
    if positions is None:
        positions = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    logits = model(batch["input_ids"], positions)[:, :-1]
    kept = batch["labels"][:, 1:] != -100
    z = (logits.logsumexp(-1) ** 2 * kept).sum()
    return {"lm": lm, "z": (z, kept.sum(), 0.1)}


def mean_of_terms(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The full batch's loss: each term's sum over its count, weighted."""
    return sum(w * s / c for s, c, w in ((*v, 1.0)[:3] for v in terms(model, batch).values()))


def _windows() -> list[list[dict]]:
    gen = torch.Generator().manual_seed(5)
    return [[text(10, gen, sft=True), text(6, gen, width=6)] for _ in range(STEPS)]


def _rank(rank: int, world: int, windows: list) -> dict:
    out = {}
    for optimizer in sorted(OPTIMIZERS):
        torch.manual_seed(0)
        model = DDP(OwnLM().double())
        acc = bigbatch.Accumulator(
            model, OPTIMIZERS[optimizer](model.parameters()), micro_batch_tokens=48, pack=24
        )
        results = [acc.train_step(w[rank], terms) for w in windows]
        out[optimizer] = (model.module.state_dict(), [r.micro_batches for r in results])
        out[optimizer, "ledger"] = [r.ledger for r in results]
    return out


@pytest.fixture(scope="module")
def runs():
    windows = _windows()
    return windows, run_ranks(_rank, windows, timeout_s=300)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_packed_windows_on_two_ranks_equal_the_full_batch(optimizer, runs):
    windows, by_rank = runs
    torch.manual_seed(0)
    ref = OwnLM().double()
    ref_opt = OPTIMIZERS[optimizer](ref.parameters())
    for long, short in windows:
        width = long["input_ids"].shape[1]
        padded = {k: torch.nn.functional.pad(v, (0, width - v.shape[1])) for k, v in short.items()}
        padded["labels"][:, short["labels"].shape[1] :] = -100
        union = {k: torch.cat([long[k], padded[k]]) for k in long}
        full_batch_step(ref, ref_opt, mean_of_terms, union)
    state, micro_batches = by_rank[0][optimizer]
    ours = copy.deepcopy(ref)
    ours.load_state_dict(state)
    assert max_relative_error(ref, ours) < 1e-10
    assert micro_batches != by_rank[1][optimizer][1]  # the ranks packed their own rows


def test_the_ledger_counts_each_replicas_tokens_and_the_global_count(runs):
    """Note [step ledger]: input and computed tokens per data-parallel replica (its own rows),
    the loss tokens the window's global count, whatever the rows each rank packed."""
    windows, by_rank = runs
    for step, window in enumerate(windows):
        labelled = sum(int((w["labels"][:, 1:] != -100).sum()) for w in window)
        for rank, batch in enumerate(window):
            ledger = by_rank[rank]["sgd_momentum", "ledger"][step]
            assert ledger.input_tokens == int(batch["attention_mask"].sum())
            assert (
                ledger.computed_tokens % 24 == 0 and ledger.computed_tokens >= ledger.input_tokens
            )
            assert ledger.loss_tokens == labelled  # the lm term's count, over both ranks

"""The step ledger (Note [step ledger]): exact counts on fixed batches, invariant to the cut, and
FLOPs that agree with ``torch.utils.flop_counter.FlopCounterMode`` on the same step."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bigbatch.core._pack import PackCut
from bigbatch.core._tokens import TokenCut
from bigbatch.core.ledger import (
    FlopModel,
    Ledger,
    flop_model,
    matmul_parameters,
    measure_peak_flops,
    step_ledger,
)

FLOPS = FlopModel(parameters=1000, layers=2, width=8)
LENGTHS = [5, 3, 8, 1, 6]
#  a batch of these lengths, right-padded to 8, SFT: the first 2 tokens of each a prompt
MASK = torch.arange(8)[None, :] < torch.tensor(LENGTHS)[:, None]
BATCH = {
    "input_ids": torch.arange(1, 41).view(5, 8) * MASK,
    "attention_mask": MASK.long(),
    "labels": torch.where(MASK & (torch.arange(8) >= 2), 7, -100),
}
LOSS_TOKENS = 3 + 1 + 6 + 0 + 4  # shifted: labels 2..l-1 of each sample


def shapes(pieces) -> list[tuple[int, int]]:
    return [tuple(p.batch["input_ids"].shape) for p in pieces]


def test_the_counts_of_padded_and_packed_cuts_are_exact():
    counted = int((BATCH["labels"][:, 1:] != -100).sum())
    assert counted == LOSS_TOKENS
    padded = step_ledger(FLOPS, counted, LENGTHS, [(5, 8)])  # one micro-batch, padded to 8
    assert (padded.input_tokens, padded.computed_tokens) == (23, 40)
    assert padded.token_efficiency == 23 / 40
    packed_pieces = PackCut(8)(BATCH, 16)  # rows [8], [6, 1], [5, 3]: 2 + 1 micro-batches
    assert shapes(packed_pieces) == [(2, 8), (1, 8)]
    packed = step_ledger(FLOPS, counted, LENGTHS, shapes(packed_pieces))
    assert (packed.input_tokens, packed.computed_tokens) == (23, 24)
    area = sum(n * (n + 1) / 2 for n in LENGTHS)  # causal scores: 15 + 6 + 36 + 1 + 21
    assert packed.model_flops == padded.model_flops == 6 * 1000 * 23 + 12 * 2 * 8 * area
    assert padded.computed_flops == 6 * 1000 * 40 + 12 * 2 * 8 * 5 * 64
    assert packed.computed_flops == 6 * 1000 * 24 + 12 * 2 * 8 * 3 * 64


@pytest.mark.parametrize("budget", [8, 16, 24, 64])
def test_counts_do_not_depend_on_the_micro_batches(budget):
    tokens = TokenCut()(BATCH, budget)
    packed = PackCut(8)(BATCH, budget)
    for pieces in (tokens, packed):
        ledger = step_ledger(FLOPS, LOSS_TOKENS, LENGTHS, shapes(pieces))
        assert ledger.loss_tokens == LOSS_TOKENS and ledger.input_tokens == 23
        assert ledger.input_tokens == sum(p.tokens for p in pieces)
        assert ledger.computed_tokens == sum(p.padded_tokens for p in pieces)
        assert ledger.model_flops == step_ledger(FLOPS, LOSS_TOKENS, LENGTHS, [(5, 8)]).model_flops
    assert step_ledger(FLOPS, 0, LENGTHS, shapes(packed)).computed_tokens == 24  # FFD: 3 rows


def test_rates_and_memory():
    ledger = Ledger(14, 23, 24, 1e9, 1.2e9, 0.4e9, seconds=0.5, peak_flops=4e9, peak_source="given")
    assert ledger.flops_per_s == 2e9 and ledger.mfu == 0.5 and ledger.bytes_per_token is None
    with_memory = step_ledger(FLOPS, 14, LENGTHS, [(2, 8), (1, 8)], peak_bytes=1600, recompute=0.5)
    assert with_memory.bytes_per_token == 100 and with_memory.mfu is None
    assert with_memory.recompute_flops == 0.5 * with_memory.computed_flops / 3
    rate, source = measure_peak_flops(torch.float64, "cpu", size=64, repeats=1)
    assert rate > 0 and source == "measured: one 64x64 float64 matmul on cpu"


def test_matmul_parameters_count_each_product_once():
    embed, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)
    head.weight = embed.weight  # tied: one matrix
    model = torch.nn.Sequential(embed, torch.nn.Linear(4, 4), torch.nn.Conv1d(4, 4, 3), head)
    assert matmul_parameters(model) == 40 + 16 + 48
    with pytest.raises(ValueError, match=r"Sequential has no transformers config .* FlopModel\("):
        flop_model(model)


def counted_flops(model: torch.nn.Module, batch: dict) -> int:
    with FlopCounterMode(display=False) as counter:
        logits = model(**batch).logits
        logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_flops_agree_with_the_flop_counter(name, gen):
    pytest.importorskip("transformers")
    from integrations.hf_models import gpt2, llama

    model = {"llama": llama, "gpt2": gpt2}[name]()
    model.config._attn_implementation = "eager"  # CPU SDPA is not counted (Note [step ledger])
    model.config.use_cache = False
    flops = flop_model(model)
    assert flops.layers == 2 and flops.width == 16
    ids = torch.randint(1, 60, (5, 20), generator=gen)
    mask = (torch.arange(20)[None, :] < torch.tensor([20, 12, 7, 15, 3])[:, None]).long()
    padded = {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100),
    }
    lengths = mask.sum(-1).tolist()
    ledger = step_ledger(flops, 0, lengths, [(5, 20)])
    assert abs(counted_flops(model, padded) / ledger.computed_flops - 1) < 0.02
    pieces = PackCut(24)(padded, 10_000)  # one micro-batch of packed rows
    packed = {k: pieces[0].batch[k] for k in ("input_ids", "position_ids")}
    ledger = step_ledger(flops, 0, lengths, shapes(pieces))
    assert abs(counted_flops(model, packed) / ledger.computed_flops - 1) < 0.02
    one = {"input_ids": ids[:1]}  # one sample, no padding: what ran is the model's (not causal)
    whole = step_ledger(FlopModel(flops.parameters, 2, 16, causal=False), 0, [20], [(1, 20)])
    assert whole.model_flops == whole.computed_flops
    assert abs(counted_flops(model, one) / whole.model_flops - 1) < 0.02

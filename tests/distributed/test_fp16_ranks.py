"""fp16 on 2 real gloo ranks: the look-ahead count is summed over the ranks before the window.

The global batch of ``test_fp16`` is dealt out (rank 0 gets the sequences with the 5-token first
micro-batch). Every micro-batch on every rank back-propagates at the full batch's per-token scale
(one small all-reduce of the counts before the window), so no step is lost that a plain fp16
full-batch loop on the union keeps. (Before, raw token sums were back-propagated: the scaler fell
from 65,536 to 2,048 in 10 steps, skipping 5 of them.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from cases import LM_MICRO, distance, lm_batches, lm_count, lm_loss, make_lm, plain_full_batch
from ranks import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import bigbatch

pytestmark = pytest.mark.slow


def _rank(rank: int, world_size: int) -> dict:

    init = make_lm()
    model = DDP(copy.deepcopy(init))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = bigbatch.Accumulator(
        model, opt, micro_batch_size=LM_MICRO, max_grad_norm=1.0, precision="fp16"
    )
    skipped = []
    for batch in lm_batches():
        share = {k: v.chunk(world_size)[rank] for k, v in batch.items()}
        skipped.append(acc.train_step(share, lm_loss, count_fn=lm_count).skipped)
    return {"skipped": skipped, "model": model.module.state_dict()}


def test_two_ranks_fp16_skip_no_step_the_full_batch_keeps():
    results = run_ranks(_rank, timeout_s=600)
    init, batches = make_lm(), lm_batches()
    truth, _ = plain_full_batch(init, batches, fp16=False)
    full, full_skipped = plain_full_batch(init, batches, fp16=True)
    ours = make_lm()
    ours.load_state_dict(results[0]["model"])
    assert results[0]["skipped"] == results[1]["skipped"]  # one decision for all ranks
    lost = [
        i
        for i, (f, o) in enumerate(zip(full_skipped, results[0]["skipped"], strict=True))
        if o and not f
    ]
    assert not lost, (full_skipped, results[0]["skipped"])
    assert distance(ours, truth) <= 2 * distance(full, truth)

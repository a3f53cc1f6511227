"""A window waits for the device once, at its step, however many micro-batches it has.

On a GPU each read of a device value on the host (``.item()``, ``.tolist()``, ``bool(t)``,
``float(t)``...) stops the host until the device has caught up: a loop that reads once per
micro-batch leaves the GPU idle between micro-batches (research note: "bad" accumulation costs
2-4x through host syncs). The engine keeps each micro-batch's loss sum and count on the device and
reads them, with the gradient norm, once per step (Note [one host sync] in
``bigbatch.core._stepping``). Here the reads are counted on the CPU (``syncs.HostReads``) for the
usual paths; ``test_cuda.py`` has the twin under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import pytest
import torch
from models import PAD, VOCAB, causal_lm, classification_batch, lm_token_loss, mean_ce, mlp
from syncs import HostReads

import bigbatch


def _counted(acc: bigbatch.Accumulator, run) -> HostReads:
    """The host reads of ``run()`` (two windows: the second, warm, is counted)."""
    run()
    reads = HostReads()
    reads.pause_during(acc.optimizer)
    with reads:
        run()
    return reads


def _text(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    lengths = torch.randint(2, 13, (n,), generator=gen)
    mask = torch.arange(12)[None, :] < lengths[:, None]
    ids = torch.randint(1, VOCAB, (n, 12), generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, PAD)}


@pytest.mark.parametrize("micro_batches", [1, 3, 8])
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_a_window_of_samples_reads_the_device_once(gen, micro_batches, max_grad_norm):
    model = mlp(torch.float32)
    acc = bigbatch.Accumulator(
        model, torch.optim.AdamW(model.parameters()), micro_batch_size=4,
        max_grad_norm=max_grad_norm,
    )  # fmt: skip
    batch = classification_batch(4 * micro_batches - 1, torch.float32, gen)  # the last is short
    reads = _counted(acc, lambda: acc.train_step(batch, mean_ce))
    assert reads.count == 1, reads.where


@pytest.mark.parametrize("trim", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_window_of_token_losses_reads_the_device_once(gen, precision, trim):
    """``(loss_sum, count)`` with the count a tensor (the non-padding tokens): also one read, and
    one more before the window where micro-batches of text are trimmed (their lengths, read once
    with whether a label lies on the padding: Note [per-token tensors] in ``core._tokens``)."""
    model = causal_lm(torch.float32)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), micro_batch_size=3,
        max_grad_norm=1.0, precision=precision, trim_padding=trim,
    )  # fmt: skip
    batch = _text(10, gen)
    reads = _counted(acc, lambda: acc.train_step(batch, lm_token_loss))
    assert reads.count == 1 + trim, reads.where


def test_the_low_level_path_reads_the_device_once(gen):
    model = causal_lm(torch.float32)
    acc = bigbatch.Accumulator(model, torch.optim.AdamW(model.parameters()), max_grad_norm=1.0)
    pieces = [_text(n, gen) for n in (4, 4, 2)]

    def window() -> None:
        for i, piece in enumerate(pieces):
            with acc.micro_batch(last=i == len(pieces) - 1):
                acc.backward(*lm_token_loss(model, piece))
        acc.step()

    reads = _counted(acc, window)
    assert reads.count == 1, reads.where


def test_token_windows_read_the_lengths_once_and_the_totals_once(gen):
    """Cutting by tokens needs each sample's length on the host: one read before the window."""
    model = causal_lm(torch.float32)
    acc = bigbatch.Accumulator(
        model, torch.optim.AdamW(model.parameters()), micro_batch_tokens=24, max_grad_norm=1.0
    )
    batch = _text(10, gen)
    reads = _counted(acc, lambda: acc.train_step(batch, lm_token_loss))
    assert reads.count == 2, reads.where


def test_the_count_sees_a_read_per_micro_batch(gen):
    """The counter is not blind: a loss that reads its value on the host costs one per micro-batch."""
    model = mlp(torch.float32)
    acc = bigbatch.Accumulator(model, torch.optim.AdamW(model.parameters()), micro_batch_size=4)
    batch = classification_batch(12, torch.float32, gen)

    def reading(m, b):
        loss = mean_ce(m, b)
        assert loss.item() > 0  # a read per micro-batch (a logger, a check)
        return loss

    reads = _counted(acc, lambda: acc.train_step(batch, reading))
    assert reads.count == 1 + 3, reads.where

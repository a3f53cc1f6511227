"""A contrastive task for the trainer's tests: a two-tower model trained with a ``cached_loss``
(run by the CLI in child processes too: ``cached_tasks.py:killable``)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared models
from contrastive import pairs, two_tower  # noqa: E402

import bigbatch  # noqa: E402


def _data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    batch = pairs(n, torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(batch["x"], batch["y"])


def clip_loss(reps, batch) -> torch.Tensor:
    """CLIP's symmetric InfoNCE over the whole batch, with the model's learnable logit scale."""
    q, d, scale = reps
    logits = scale * q @ d.T
    targets = torch.arange(len(q), device=q.device)
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


def contrastive(n: int = 50) -> bigbatch.Task:
    """Pairs (x, y) of 50 samples, a two-tower model with dropout, exact in-batch negatives."""
    return bigbatch.Task(
        model=two_tower(dropout=0.2),
        train_data=_data(n, 1),
        loss_fn=bigbatch.cached_loss(lambda m, mb: m(mb[0], mb[1]), clip_loss),
        eval_data=_data(20, 2),
    )


def killable() -> bigbatch.Task:
    """``contrastive`` whose encode appends "<pid> <n>" to $KILL_LOG for the n-th call (pass 1
    and pass 2 alike: 6 calls per step at batch 10 cut 4 + 4 + 2) and, at n = $STOP_AT, stops the
    process (SIGSTOP) so that the test can SIGKILL it there."""
    task = contrastive()
    log, stop_at = os.environ.get("KILL_LOG", ""), int(os.environ.get("STOP_AT", "0"))
    calls = [0]

    def encode(model, mb):
        if torch.is_grad_enabled() or model.training:  # not the evaluation's encodes
            calls[0] += 1
            if log:
                with open(log, "a") as f:
                    f.write(f"{os.getpid()} {calls[0]}\n")
            if calls[0] == stop_at:
                os.kill(os.getpid(), signal.SIGSTOP)
        return model(mb[0], mb[1])

    task.loss_fn = bigbatch.cached_loss(encode, clip_loss)
    return task

"""Tiny tasks for the trainer's tests (run by the CLI in child processes too: `tasks.py:name`)."""

from __future__ import annotations

import os
import signal

import torch
import torch.nn as nn
import torch.nn.functional as F

import bigbatch


def _data(n: int, seed: int, dtype: torch.dtype) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen, dtype=dtype)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return torch.utils.data.TensorDataset(x, y)


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _accuracy(model: nn.Module, batch):
    x, y = batch
    return (model(x).argmax(-1) == y).sum(), y.shape[0]


def _model(dtype: torch.dtype, dropout: float) -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.Tanh(),
        nn.Dropout(dropout),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Linear(16, 3),
    ).to(dtype)


def classify(
    n: int = 50, dropout: float = 0.0, dtype: torch.dtype = torch.float64
) -> bigbatch.Task:
    """An MLP on a 3-class problem: 50 samples, an eval set and an accuracy metric."""
    return bigbatch.Task(
        model=_model(dtype, dropout),
        train_data=_data(n, 1, dtype),
        loss_fn=_loss,
        eval_data=_data(40, 2, dtype),
        metric=_accuracy,
    )


def classify_dropout() -> bigbatch.Task:
    """``classify`` with dropout: a resumed run must replay the same random masks."""
    return classify(dropout=0.3)


def killable() -> bigbatch.Task:
    """``classify_dropout`` whose loss appends "<pid> <n>" to $KILL_LOG for the n-th micro-batch
    it starts and, at n = $STOP_AT, stops the process (SIGSTOP) so the test can SIGKILL it there.
    Under torchrun "{rank}" in $KILL_LOG is the rank, and rank 0 alone stops. With $OOM_ABOVE
    set, a micro-batch larger than that raises ``MemoryError`` after its forward (as a real
    out-of-memory error would), so ``--micro-batch-size auto`` adopts a smaller one."""
    task = classify_dropout()
    rank = os.environ.get("RANK", "0")
    log = os.environ.get("KILL_LOG", "").replace("{rank}", rank)
    stop_at = int(os.environ.get("STOP_AT", "0")) if rank == "0" else 0
    oom_above = int(os.environ.get("OOM_ABOVE", "0"))
    calls = [0]

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        calls[0] += 1
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {calls[0]}\n")
        if calls[0] == stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        loss = _loss(model, batch)
        if oom_above and len(batch[0]) > oom_above:
            raise MemoryError(f"micro-batch {len(batch[0])} > OOM_ABOVE={oom_above}")
        return loss

    task.loss_fn = loss_fn
    return task


def not_a_task():
    return {"model": None}


def bn_cnn(n: int = 24) -> bigbatch.Task:
    """A float64 CNN with a BatchNorm2d on 2 x 8 x 8 images, 3 classes: accumulation is exact
    only under a BatchNorm policy (``--batchnorm freeze`` or ``groupnorm``). No conv bias:
    before a normalisation its gradient is 0 up to rounding, which Adam would amplify."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, 2, 8, 8, generator=gen, dtype=torch.float64)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    model = nn.Sequential(
        nn.Conv2d(2, 8, 3, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 3),
    ).to(torch.float64)
    return bigbatch.Task(
        model=model, train_data=torch.utils.data.TensorDataset(x, y), loss_fn=_loss
    )


def tiny_lm(n: int = 16, vocab: int = 11, length: int = 7) -> bigbatch.Task:
    """A float64 next-token model on padded sequences of 2 to 7 tokens: the loss counts tokens
    (``bigbatch.token_cross_entropy``), so the log reports tokens/s."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (n, length), generator=gen)
    lengths = torch.randint(2, length + 1, (n,), generator=gen)
    labels = ids.masked_fill(torch.arange(length) >= lengths[:, None], -100)
    model = nn.Sequential(nn.Embedding(vocab, 8), nn.Tanh(), nn.Linear(8, vocab)).to(torch.float64)

    def loss_fn(model: nn.Module, batch):
        ids, labels = batch
        return bigbatch.token_cross_entropy(model(ids), labels, shift=True)

    data = torch.utils.data.TensorDataset(ids, labels)
    return bigbatch.Task(model=model, train_data=data, loss_fn=loss_fn)

"""Tiny tasks for the trainer's tests (run by the CLI in child processes too: `tasks.py:name`)."""

from __future__ import annotations

import dataclasses
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
    it starts and, at n = $STOP_AT (or any n of a comma-separated list), stops the process
    (SIGSTOP) so the test can SIGKILL or signal it there.
    Under torchrun "{rank}" in $KILL_LOG is the rank, and rank 0 alone stops. With $OOM_ABOVE
    set, a micro-batch larger than that raises ``MemoryError`` after its forward (as a real
    out-of-memory error would), so ``--micro-batch-size auto`` adopts a smaller one."""
    return _stoppable(classify_dropout())


def _stoppable(task: bigbatch.Task) -> bigbatch.Task:
    """``task`` with the $KILL_LOG / $STOP_AT / $OOM_ABOVE loss of ``killable``."""
    rank = os.environ.get("RANK", "0")
    log = os.environ.get("KILL_LOG", "").replace("{rank}", rank)
    stops = os.environ.get("STOP_AT", "") if rank == "0" else ""
    stop_at = {int(n) for n in stops.split(",") if n}
    oom_above = int(os.environ.get("OOM_ABOVE", "0"))
    calls, inner = [0], task.loss_fn

    def loss_fn(model: nn.Module, batch):
        calls[0] += 1
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {calls[0]}\n")
        if calls[0] in stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        loss = inner(model, batch)
        size = len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch["input_ids"])
        if oom_above and size > oom_above:
            raise MemoryError(f"micro-batch {size} > OOM_ABOVE={oom_above}")
        return loss

    task.loss_fn = loss_fn
    return task


class _TextLM(nn.Module):
    """Each position's logits from its own token (with dropout): exact under any cut."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.embed, self.drop = nn.Embedding(11, 16), nn.Dropout(dropout)
        self.head = nn.Linear(16, 11)

    def get_output_embeddings(self) -> nn.Module:
        return self.head  # what --chunked-head defers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.drop(self.embed(ids))))


def _text_loss(model: nn.Module, batch) -> dict:
    """Named terms: the token loss, and an auxiliary loss on each text's first 3 tokens."""
    logits = model(batch["input_ids"])
    aux_labels = batch["labels"].masked_fill(torch.arange(batch["labels"].shape[1]) > 3, -100)
    lm = bigbatch.token_cross_entropy(logits, batch["labels"], shift=True)
    aux = bigbatch.token_cross_entropy(logits, aux_labels, shift=True)
    return {"lm": lm, "aux": (*aux, 0.1)}


def text(n: int = 50, dropout: float = 0.0) -> bigbatch.Task:
    """Variable-length text (2 to 12 tokens, right-padded, with an attention mask) for token
    windows, with a loss of two named terms."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(2, 13, (n,), generator=gen)
    mask = torch.arange(12)[None] < lengths[:, None]
    ids = torch.randint(1, 11, (n, 12), generator=gen) * mask
    labels = ids.masked_fill(~mask, -100)
    rows = [
        {"input_ids": i, "attention_mask": m.long(), "labels": y}
        for i, m, y in zip(ids, mask, labels, strict=True)
    ]
    torch.manual_seed(0)  # the same initial weights in every run of the task
    return bigbatch.Task(model=_TextLM(dropout).double(), train_data=rows, loss_fn=_text_loss)


def text_lm(n: int = 50) -> bigbatch.Task:
    """``text`` with the token loss alone: a causal LM's, which packing keeps exact."""
    lm = lambda m, b: bigbatch.token_cross_entropy(m(b["input_ids"]), b["labels"], shift=True)  # noqa: E731
    return dataclasses.replace(text(n), loss_fn=lm)


def text_killable() -> bigbatch.Task:
    """``text`` with dropout and the stops of ``killable``."""
    return _stoppable(text(dropout=0.3))


def fsdp_classify() -> bigbatch.Task:
    """``classify`` with its model sharded by FSDP2 (``fully_shard``): under torchrun only. The
    task joins the process group itself, as a task that shards its model must."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    task = classify()
    fully_shard(task.model)
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


def faulty() -> bigbatch.Task:
    """``classify`` (no dropout) whose loss misbehaves where the environment says, counted in
    calls of its loss_fn (micro-batches started; batch 10 at 4 is 3 calls per step):

    * $NAN_AT=n: the loss of the n-th call is NaN (the cause is removed by unsetting it);
      $NAN_FROM=n: of every call from the n-th on;
    * $FILL_DISK_AT=n with $FILL_DISK=path: at the n-th call, fill the filesystem holding that
      path with a file until $FILL_LEAVE bytes (default 0) are free;
    * $LINK_AT=n with $LINK=path and $LINK_TO=target: at the n-th call, plant a symbolic link
      ``path -> target`` (replacing what is there), as another user of the folder could;
    * $OPTIMIZER=sgd: SGD with momentum instead of the default AdamW.
    """
    task = classify()
    nan_at = int(os.environ.get("NAN_AT", "0"))
    nan_from = int(os.environ.get("NAN_FROM", "0"))
    fill_at = int(os.environ.get("FILL_DISK_AT", "0"))
    link_at = int(os.environ.get("LINK_AT", "0"))
    calls = [0]

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == fill_at:
            fill_disk(os.environ["FILL_DISK"], int(os.environ.get("FILL_LEAVE", "0")))
        if calls[0] == link_at:
            if os.path.lexists(os.environ["LINK"]):
                os.remove(os.environ["LINK"])
            os.symlink(os.environ["LINK_TO"], os.environ["LINK"])
        loss = _loss(model, batch)
        bad = calls[0] == nan_at or 0 < nan_from <= calls[0]
        return loss * float("nan") if bad else loss

    task.loss_fn = loss_fn
    if os.environ.get("OPTIMIZER") == "sgd":
        task.optimizer = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)
    return task


def fill_disk(path: str, leave: int = 0) -> None:
    """Write ``path`` until its filesystem has at most ``leave`` bytes free (a real full disk)."""
    with open(path, "wb") as f:
        while True:
            free = os.statvfs(os.path.dirname(path) or ".")
            room = free.f_bavail * free.f_frsize - leave
            if room <= 0:
                break
            try:
                f.write(b"\0" * min(room, 1 << 20))
                f.flush()
            except OSError:
                break


def nan_data() -> bigbatch.Task:
    """``classify`` whose training sample $NAN_SAMPLE (if set) holds a NaN input."""
    task = classify()
    x, y = task.train_data.tensors
    if os.environ.get("NAN_SAMPLE"):
        x = x.clone()
        x[int(os.environ["NAN_SAMPLE"]), 0] = float("nan")
    task.train_data = torch.utils.data.TensorDataset(x, y)
    return task


def hungry(n: int = 32) -> bigbatch.Task:
    """A float64 task whose forward takes about 3 MiB per sample (a 1.5 MiB broadcast and its
    tanh, kept for backward), so the memory a micro-batch needs grows with it: for budgets and
    real out-of-memory errors. It stops itself (SIGSTOP) at the $STOP_AT-th call of its loss, or
    at the first call after the file $STOP_WHEN_EXISTS appeared."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(n, 6, generator=gen, dtype=torch.float64)
    y = (x.sum(1) > 0).long()
    model = nn.Linear(6, 2).to(torch.float64)
    stop_at, calls = int(os.environ.get("STOP_AT", "0")), [0]
    when, stopped = os.environ.get("STOP_WHEN_EXISTS", ""), []

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == stop_at or (when and os.path.exists(when) and not stopped):
            stopped.append(calls[0])
            os.kill(os.getpid(), signal.SIGSTOP)
        x, y = batch
        wide = torch.tanh(x[:, :, None] * torch.linspace(-1, 1, 2**15, dtype=x.dtype))
        return F.cross_entropy(model(wide.mean(-1)), y)

    return bigbatch.Task(
        model=model, train_data=torch.utils.data.TensorDataset(x, y), loss_fn=loss_fn
    )


def typo_in_loss() -> bigbatch.Task:
    """A user's bug inside the loss: a keyword argument torch does not take (TypeError)."""
    task = classify()

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y, reduce_to="mean")  # the user's typo

    task.loss_fn = loss_fn
    return task


def broken_task_function() -> bigbatch.Task:
    """A user's bug in the task function itself (ValueError while building the data)."""
    return bigbatch.Task(model=nn.Linear(2, 1), train_data=int("ten"), loss_fn=_loss)


def model_not_a_module() -> bigbatch.Task:
    task = classify()
    task.model = "resnet18"  # type: ignore[assignment]
    return task


def no_loss() -> bigbatch.Task:
    task = classify()
    task.loss_fn = None  # type: ignore[assignment]
    return task

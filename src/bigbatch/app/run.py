"""The run: what ``fit`` builds from the settings and the task before the first step.

``prepare`` builds it in memory, one function per part, and refuses a bad setting before the run
folder is made: the batch a step really trains on, the run's length, the model (checkpointing,
BatchNorm, DDP), the learning rate and the engine (the optimizer, its schedule and how each
window is cut), and the run's identity (what a resumed run must share). ``Run`` holds them, fixed
for the run's life.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from bigbatch.app.folder import RunFolder
from bigbatch.app.rounds import local_rounds
from bigbatch.app.settings import TrainConfig, resumable_changes
from bigbatch.app.stopping import StopSignals
from bigbatch.app.task import Task, canonical_path
from bigbatch.core import batchnorm as bn
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.cut import Cut
from bigbatch.core.engine import Accumulator
from bigbatch.core.head import with_chunked_head
from bigbatch.distributed import launch as distributed
from bigbatch.distributed.local import LocalAccumulation


@dataclass(frozen=True)
class Run:
    """What stays fixed during a run (a record, built once by ``prepare``)."""

    task: Task
    config: TrainConfig
    ranks: distributed.Ranks
    folder: RunFolder
    acc: Accumulator
    local: LocalAccumulation | None  # local_steps > 1 (Note [local rounds]); else DDP steps
    stop: StopSignals
    identity: dict[str, Any]
    batch_size: int
    steps_per_epoch: int
    total_steps: int


def prepare(task: Task, config: TrainConfig, ranks: distributed.Ranks) -> Run:
    """The run of ``task`` under ``config``, in memory: a bad setting is refused here, before the
    run folder is made."""
    samples = len(task.train_data)
    batch_size = trained_batch(config, samples, ranks.is_main)
    steps_per_epoch, total_steps = run_length(config, samples)
    if total_steps >= steps_per_epoch:  # the run reaches the epoch's last (smaller) batch
        distributed.check_batch_sizes(samples, batch_size, ranks.world_size)
    model = prepare_model(task.model, config, ranks)
    if config.chunked_head:  # Note [deferred head] in bigbatch.core.head
        task = replace(task, loss_fn=with_chunked_head(task.loss_fn, model))
    acc = accumulator(model, task, config, batch_size, total_steps)
    return Run(
        task=task,
        config=config,
        ranks=ranks,
        folder=RunFolder(config.out, ranks),
        acc=acc,
        local=local_rounds(acc, config),  # a collective
        stop=StopSignals(ranks.device),
        identity=identity(task, config, acc.optimizer),
        batch_size=batch_size,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
    )


def trained_batch(config: TrainConfig, samples: int, is_main: bool) -> int:
    """The batch a step trains on: ``batch_size``, or every sample when the data hold fewer
    (said in a warning: the learning rate is then scaled for the batch really trained)."""
    batch_size = config.batching.batch_size
    if batch_size <= samples:
        return batch_size
    if is_main:
        scaled = config.lr_scaling != "none"
        lr = f", and --lr is scaled for {samples} samples, not {batch_size}" if scaled else ""
        warnings.warn(
            f"--batch-size {batch_size} is larger than the task's {samples} training "
            f"samples: every step trains on all {samples} (full-batch gradient descent)"
            f"{lr}. Give --batch-size {samples} or less.",
            BigBatchWarning,
            stacklevel=5,
        )
    return samples


def run_length(config: TrainConfig, dataset_size: int) -> tuple[int, int]:
    """``(steps_per_epoch, total_steps)`` of a run over ``dataset_size`` samples.

    Example:
        >>> run_length(TrainConfig(batch_size=10, epochs=2), 25)
        (3, 6)
    """
    steps_per_epoch = math.ceil(dataset_size / config.batching.batch_size)
    return steps_per_epoch, config.steps or (config.epochs or 1) * steps_per_epoch


def scaled_lr(config: TrainConfig, batch_size: int) -> float:
    """The learning rate used at ``batch_size``.

    Note [learning-rate scaling]
        ``lr`` is the learning rate at ``reference_batch_size``. With ``lr_scaling="linear"``
        the rate used is ``lr * batch_size / reference_batch_size`` (Goyal et al., 2017: SGD);
        ``"sqrt"`` uses ``lr * sqrt(batch_size / reference_batch_size)`` (often better for
        Adam); ``"none"`` (the default) uses ``lr`` as given. Accumulation itself never changes
        the rate: the step at batch 256 cut 8 x 32 is the step at batch 256.

    Example:
        >>> scaled_lr(TrainConfig(lr=0.1, lr_scaling="linear", reference_batch_size=256), 1024)
        0.4
    """
    ratio = batch_size / int(config.reference_batch_size or batch_size)
    scale = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[config.lr_scaling]
    return float(config.lr) * scale


def checked_lr(config: TrainConfig, batch_size: int, model: torch.nn.Module) -> float:
    """The scaled learning rate, refused when an optimizer's step would overflow the model's
    floats inside torch (Adam's first steps move by up to 1,000 x lr).

    Raises:
        ValueError: naming ``--lr``, the rate at ``batch_size``, the dtype and a rate that works.
    """
    lr = scaled_lr(config, batch_size)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtype = min(dtypes, key=lambda d: torch.finfo(d).max, default=torch.float64)
    largest = torch.finfo(dtype).max
    if not lr < largest / 1000:
        raise ValueError(
            f"--lr {config.lr:g} gives a rate of {lr:g} at batch {batch_size}, and "
            f"the model's {dtype} parameters hold at most {largest:.3g}: an optimizer "
            f"step would overflow. Use a rate below {largest / 1000:.3g}, e.g. 1e-3."
        )
    return lr


def prepare_model(
    model: torch.nn.Module, config: TrainConfig, ranks: distributed.Ranks
) -> torch.nn.Module:
    """Checkpointing and the BatchNorm policy on; DDP around it (not under local rounds)."""
    if config.gradient_checkpointing:
        from bigbatch.memory.checkpointing import enable_checkpointing

        enable_checkpointing(model)
    if config.batchnorm != "keep":
        bn.batchnorm(model, config.batchnorm or "keep")  # before DDP wraps the modules
    model.train()
    # under local rounds each rank steps its own replica (Note [local rounds])
    model = model.to(ranks.device) if config.local_steps > 1 else distributed.wrap(model, ranks)
    return torch.compile(model) if config.compile else model  # type: ignore[return-value]


def schedule(
    config: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps``, then constant or cosine to 0 at the last step."""
    warmup = config.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if config.lr_schedule == "cosine" else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def accumulator(
    model: torch.nn.Module, task: Task, config: TrainConfig, batch_size: int, total_steps: int
) -> Accumulator:
    """The engine a run steps: the task's optimizer (default AdamW) at the checked learning rate,
    its schedule over ``total_steps`` and how each window is cut (``cut``)."""
    lr = checked_lr(config, batch_size, model)
    optimizer = (task.optimizer or torch.optim.AdamW)(model.parameters(), lr=lr)
    schedule_of = task.scheduler or functools.partial(schedule, config)
    return Accumulator(
        model,
        optimizer,
        cut(config, task),
        schedule_of(optimizer, total_steps),
        config.max_grad_norm,
        config.precision,
        nonfinite=config.nonfinite,
    )


def cut(config: TrainConfig, task: Task) -> Cut:
    """How each window is cut into micro-batches: the settings' micro-batch (Note [batch
    arithmetic]), token budget, padding and memory budget, and the task's ``lengths`` and
    ``pad_values``."""
    return Cut(
        micro_batch_size=config.batching.micro_batch_size,
        micro_batch_tokens=config.micro_batch_tokens,
        pad_to_multiple_of=config.pad_to_multiple_of,
        lengths=task.lengths,
        pad_values=task.pad_values,
        trim_padding=config.trim_padding,
        memory_budget=config.memory_budget,
        pack=config.pack,
    )


def identity(task: Task, config: TrainConfig, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What makes a run the same run: the task, the settings that change the result, the model,
    the optimizer's class (its state only loads into the same kind)."""
    settings = {k: v for k, v in config.to_dict().items() if k not in resumable_changes()}
    settings["task"] = canonical_path(config.task) if config.task else None
    shapes = {k: list(p.shape) for k, p in distributed.unwrap(task.model).state_dict().items()}
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    return {**settings, "model": shapes, "train_samples": len(task.train_data), "optimizer": kind}

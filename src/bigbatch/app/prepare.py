"""What ``fit`` builds before the first step, one function each: the batch a step trains on,
the learning rate, the model (checkpointing, BatchNorm policy, DDP), the default schedule and
the run's identity (what makes a resumed run the same run)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from bigbatch.app.config import TrainConfig, resolve_batch, resumable_changes, scaled_lr
from bigbatch.app.task import Task, canonical_path
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.batchnorm import batchnorm as apply_batchnorm
from bigbatch.distributed import launch as distributed


def trained_batch(config: TrainConfig, samples: int, is_main: bool) -> int:
    """The batch a step trains on: ``batch_size``, or every sample when the data hold fewer
    (said in a warning: the learning rate is then scaled for the batch really trained)."""
    batch_size = resolve_batch(config)[0]
    if batch_size <= samples:
        return batch_size
    if is_main:
        scaled = config.lr_scaling != "none"
        lr = f", and --lr is scaled for {samples} samples, not {batch_size}" if scaled else ""
        warnings.warn(f"--batch-size {batch_size} is larger than the task's {samples} training "
                      f"samples: every step trains on all {samples} (full-batch gradient descent)"
                      f"{lr}. Give --batch-size {samples} or less.", BigBatchWarning, stacklevel=5)  # fmt: skip
    return samples


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
        raise ValueError(f"--lr {config.lr:g} gives a rate of {lr:g} at batch {batch_size}, and "
                         f"the model's {dtype} parameters hold at most {largest:.3g}: an optimizer "
                         f"step would overflow. Use a rate below {largest / 1000:.3g}, e.g. 1e-3.")  # fmt: skip
    return lr


def prepare_model(model: torch.nn.Module, config: TrainConfig,
                  ranks: distributed.Ranks) -> torch.nn.Module:  # fmt: skip
    """Checkpointing and the BatchNorm policy on; DDP around it (not under local rounds)."""
    if config.gradient_checkpointing:
        from bigbatch.memory.checkpointing import enable_checkpointing

        enable_checkpointing(model)
    if config.batchnorm != "keep":
        apply_batchnorm(model, config.batchnorm or "keep")  # before DDP wraps the modules
    model.train()
    # under local rounds each rank steps its own replica (Note [local rounds])
    model = model.to(ranks.device) if config.local_steps > 1 else distributed.wrap(model, ranks)
    return torch.compile(model) if config.compile else model  # type: ignore[return-value]


def schedule(config: TrainConfig, optimizer: torch.optim.Optimizer,
             total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:  # fmt: skip
    """Linear warm-up over ``warmup_steps``, then constant or cosine to 0 at the last step."""
    warmup = config.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if config.lr_schedule == "cosine" else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def identity(task: Task, config: TrainConfig, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What makes a run the same run: the task, the settings that change the result, the model,
    the optimizer's class (its state only loads into the same kind)."""
    settings = {k: v for k, v in config.to_dict().items() if k not in resumable_changes()}
    settings["task"] = canonical_path(config.task) if config.task else None
    shapes = {k: list(p.shape) for k, p in distributed.unwrap(task.model).state_dict().items()}
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    return {**settings, "model": shapes, "train_samples": len(task.train_data), "optimizer": kind}

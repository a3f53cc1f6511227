"""``fit(task, config)``: the training loop, readable top to bottom.

One iteration is one optimizer step on one effective batch: the engine cuts it into
micro-batches and steps once (``Accumulator.train_step``). Around it, in one place each:
the data (``_batches``: the order is a pure function of ``seed`` and the epoch, so a resumed
run finds its place by the step number alone), the log (``RunLog.step``, once per optimizer
step) and the snapshot (``_save``, at step boundaries only: a run killed mid-window redoes that
window from the same data and random state).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from bigbatch import distributed
from bigbatch._tree import map_tensors
from bigbatch.batchnorm import batchnorm as apply_batchnorm
from bigbatch.engine import Accumulator, StepResult
from bigbatch.loss import as_sum_and_count
from bigbatch.memory.auto import AutoState
from bigbatch.memory.peak import PeakProbe
from bigbatch.split import batch_size as samples_in
from bigbatch.train import resume
from bigbatch.train.config import (
    RESUMABLE_CHANGES,
    TrainConfig,
    make_config,
    resolve_batch,
    scaled_lr,
)
from bigbatch.train.log import NullLog, RunLog
from bigbatch.train.report import Summary, print_summary, summarize
from bigbatch.train.task import Task, TaskError


def fit(task: Task, config: TrainConfig | dict[str, Any] | None = None, **settings: Any) -> Summary:
    """Train ``task`` with exact gradient accumulation; return the run's ``Summary``.

    Writes the run folder ``config.out``: ``metrics.csv`` (one row per optimizer step),
    ``snapshot.pt`` (resume state), ``model.pt`` (the final state dict), ``summary.json``.

    Args:
        task: the model, data and loss (``bigbatch.Task``).
        config: a ``TrainConfig`` or a dict of its fields.
        **settings: fields of ``TrainConfig`` that override ``config``.

    Returns:
        The ``Summary`` of the run (time, samples/s, peak memory, final loss, metric).

    Raises:
        ValueError: a bad or contradictory setting, or a run folder that belongs to another run.
        TaskError: the task's data cannot be used.

    Example:
        >>> summary = bigbatch.fit(task, batch_size=256, micro_batch_size=32, epochs=3)  # doctest: +SKIP
    """
    config = make_config(config, **settings)
    _check_task(task)
    joined = not distributed.in_group()  # fit leaves at the end only a group it joined itself
    ranks = distributed.setup(config.device)
    batch_size, micro_batch_size, _ = resolve_batch(config)
    steps_per_epoch = math.ceil(len(task.train_data) / batch_size)
    total_steps = config.steps or (config.epochs or 1) * steps_per_epoch
    if total_steps >= steps_per_epoch:  # the run reaches the epoch's last (smaller) batch
        distributed.check_batch_sizes(len(task.train_data), batch_size, ranks.world_size)

    model = _prepare_model(task.model, config, ranks)
    optimizer = (task.optimizer or torch.optim.AdamW)(
        model.parameters(), lr=scaled_lr(config, batch_size)
    )
    scheduler = (task.scheduler or _default_schedule(config))(optimizer, total_steps)
    acc = Accumulator(
        model, optimizer, micro_batch_size, scheduler, config.max_grad_norm, config.precision,
        config.memory_budget,
    )  # fmt: skip
    identity = _identity(task, config)
    start_step, elapsed_s = _start(acc, config, identity, ranks)

    log = RunLog(config.out, total_steps, start_step, config.quiet) if ranks.is_main else NullLog()
    probe = PeakProbe(ranks.device)
    batches = _batches(task, config, batch_size, steps_per_epoch, start_step, ranks)
    try:
        for step in range(start_step + 1, total_steps + 1):
            samples, batch = next(batches)
            batch = map_tensors(lambda t: t.to(ranks.device), batch)
            record = probe.reset()
            started = time.perf_counter()
            result = acc.train_step(batch, task.loss_fn)
            seconds = time.perf_counter() - started
            elapsed_s += seconds
            epoch = (step - 1) // steps_per_epoch
            row = _row(step, epoch, result, optimizer, seconds, probe.finish(record), samples)
            log.step({**row, **_evaluate_every(task, acc, config, step, batch_size)})
            if _snapshot_due(config, step, steps_per_epoch, total_steps):
                rng = distributed.all_gather_object(resume.capture_rng())  # each rank's own
                if ranks.is_main:
                    _save(acc, config, identity, step, steps_per_epoch, elapsed_s, rng)
    finally:
        log.close()
    final = evaluate(task, model, _eval_batch_size(acc, batch_size))
    if ranks.is_main:
        resume.atomic_save(distributed.unwrap(model).state_dict(), f"{config.out}/model.pt")
    # every rank waits here for rank 0's files (the summary reads metrics.csv)
    distributed.teardown() if joined else distributed.barrier()
    summary = summarize(config.out, elapsed_s, batch_size, final, write=ranks.is_main)
    if ranks.is_main and not config.quiet:
        print_summary(summary)
    return summary


# ---------------------------------------------------------------------------- setting up
def _check_task(task: Task) -> None:
    if not isinstance(task, Task):
        raise TaskError(f"fit() needs a bigbatch.Task, got {type(task).__name__}.")
    if not hasattr(task.train_data, "__len__") or not hasattr(task.train_data, "__getitem__"):
        raise TaskError(
            f"Task.train_data is a {type(task.train_data).__name__}; the trainer needs a map-style "
            "dataset (len() and [i]), e.g. torch.utils.data.TensorDataset(x, y) or a list."
        )
    if len(task.train_data) == 0:
        raise TaskError("Task.train_data is empty: the trainer needs at least one sample.")


def _prepare_model(
    model: torch.nn.Module, config: TrainConfig, ranks: distributed.Ranks
) -> torch.nn.Module:
    if config.gradient_checkpointing:
        from bigbatch.memory.checkpointing import enable_checkpointing

        enable_checkpointing(model)
    policy = config.batchnorm or "keep"  # TrainConfig stores None as "keep"
    if policy != "keep":
        apply_batchnorm(model, policy)  # before DDP wraps the modules
    model.train()
    return distributed.wrap(model, ranks)


def _default_schedule(config: TrainConfig) -> Any:
    """Linear warm-up over ``warmup_steps``, then constant or cosine to 0 at the last step."""

    def make(
        optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LambdaLR:
        warmup = config.warmup_steps

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if config.lr_schedule == "constant":
                return 1.0
            progress = (step - warmup) / max(1, total_steps - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return make


def _identity(task: Task, config: TrainConfig) -> dict[str, Any]:
    """What makes a run the same run: the task, the settings that change the result, the model."""
    settings = {k: v for k, v in config.to_dict().items() if k not in RESUMABLE_CHANGES}
    model = distributed.unwrap(task.model)
    shapes = {name: list(p.shape) for name, p in model.state_dict().items()}
    return {**settings, "model": shapes, "train_samples": len(task.train_data)}


def _start(
    acc: Accumulator, config: TrainConfig, identity: dict[str, Any], ranks: distributed.Ranks
) -> tuple[int, float]:
    """Restore the snapshot when resuming; seed everything when starting. Returns (step, time)."""
    resume.clean_stale_temps(config.out)
    state = resume.read_snapshot(config.out)
    if state is not None and not config.resume:
        raise resume.RunMismatchError(
            f"run folder {config.out!r} already holds a run (step {state['step']} of "
            f"{state['total_steps']}): add --resume to continue it, or choose another --out."
        )
    if state is None:
        _seed_everything(config.seed)
        return 0, 0.0
    resume.check_same_run(state["identity"], identity, config.out)
    distributed.unwrap(acc.model).load_state_dict(state["model"])
    acc.optimizer.load_state_dict(state["optimizer"])
    if acc.scheduler is not None and state["scheduler"] is not None:
        acc.scheduler.load_state_dict(state["scheduler"])
    if acc.precision.scaler is not None and state["scaler"] is not None:
        acc.precision.scaler.load_state_dict(state["scaler"])
    if state["auto_state"] is not None:
        acc.auto_state = AutoState(**state["auto_state"])
    _restore_rng(state["rng"], ranks)
    return int(state["step"]), float(state["elapsed_s"])


def _restore_rng(saved: list[dict[str, Any]], ranks: distributed.Ranks) -> None:
    """Each rank takes back its own generators; on another number of ranks, rank 0's (warned)."""
    if len(saved) == ranks.world_size:
        resume.restore_rng(saved[ranks.rank])
        return
    if ranks.is_main:
        warnings.warn(
            f"resuming on {ranks.world_size} rank(s) a run saved on {len(saved)}: every rank "
            "takes rank 0's random state, so random draws (dropout) differ from the "
            "uninterrupted run; resume on the same number of ranks for a bitwise-equal result.",
            stacklevel=3,
        )
    resume.restore_rng(saved[0])


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


# ---------------------------------------------------------------------------- data, log, snapshot
def _batches(
    task: Task, config: TrainConfig, batch_size: int, steps_per_epoch: int, start_step: int,
    ranks: distributed.Ranks,
) -> Iterator[tuple[int, Any]]:  # fmt: skip
    """The training batches from ``start_step`` on, as ``(samples in the global batch, this
    rank's share)``. Epoch e visits ``randperm(n)`` seeded by ``seed + e`` (its own generator,
    never the global one), so skipping to a position loads nothing and draws no random number;
    each global batch is dealt out to the ranks (Note [global batch] in bigbatch.distributed)."""
    collate = task.collate_fn or torch.utils.data.default_collate
    n = len(task.train_data)
    epoch, position = divmod(start_step, steps_per_epoch)
    while True:
        seeded = torch.Generator().manual_seed(config.seed + epoch)
        order = torch.randperm(n, generator=seeded).tolist() if config.shuffle else range(n)
        for i in range(position, steps_per_epoch):
            indices = list(order[i * batch_size : (i + 1) * batch_size])
            share = distributed.deal(indices, ranks)
            yield len(indices), collate([task.train_data[j] for j in share])
        epoch, position = epoch + 1, 0


def _row(
    step: int,
    epoch: int,
    result: StepResult,
    optimizer: torch.optim.Optimizer,
    seconds: float,
    peak: Any,
    samples: int,
) -> dict[str, Any]:
    tokens = result.count != samples  # the loss counts tokens (or pixels), not samples
    return {
        "step": step, "epoch": epoch, "loss": result.loss, "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": result.grad_norm, "samples": samples, "count": result.count,
        "micro_batch_size": result.micro_batch_size, "micro_batches": result.micro_batches,
        "oom_retries": result.oom_retries, "skipped": int(result.skipped), "time_s": seconds,
        "samples_per_s": samples / seconds, "tokens_per_s": result.count / seconds if tokens else "",
        "peak_bytes": peak.baseline_bytes + peak.peak_bytes, "step_peak_bytes": peak.peak_bytes,
    }  # fmt: skip


def _snapshot_due(config: TrainConfig, step: int, steps_per_epoch: int, total_steps: int) -> bool:
    every = config.save_every and step % config.save_every == 0
    return bool(every or step % steps_per_epoch == 0 or step == total_steps)


def _save(
    acc: Accumulator, config: TrainConfig, identity: dict[str, Any], step: int, steps_per_epoch: int,
    elapsed_s: float, rng: list[dict[str, Any]],
) -> None:  # fmt: skip
    scaler = acc.precision.scaler
    resume.write_snapshot(config.out, {
        "format": resume.FORMAT, "identity": identity, "step": step,
        "total_steps": config.steps or (config.epochs or 1) * steps_per_epoch,
        "epoch": step // steps_per_epoch, "position": step % steps_per_epoch,
        "model": distributed.unwrap(acc.model).state_dict(), "optimizer": acc.optimizer.state_dict(),
        "scheduler": acc.scheduler.state_dict() if acc.scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "auto_state": dataclasses.asdict(acc.auto_state) if acc.auto_state is not None else None,
        "rng": rng, "elapsed_s": elapsed_s,
        "torch_version": str(torch.__version__), "num_threads": torch.get_num_threads(),
    })  # fmt: skip


# ---------------------------------------------------------------------------- evaluation
def evaluate(
    task: Task, model: torch.nn.Module, batch_size: int
) -> tuple[float | None, float | None]:
    """``(eval_loss, metric)`` over the task's eval data, each ``Σ sum / Σ count``; Nones without."""
    if task.eval_data is None:
        return None, None
    device = next(model.parameters()).device
    loader = torch.utils.data.DataLoader(
        task.eval_data, batch_size=batch_size, collate_fn=task.collate_fn
    )
    totals = [0.0, 0.0, 0.0, 0.0]  # loss sum, loss count, metric sum, metric count
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in loader:
            batch = map_tensors(lambda t: t.to(device), batch)
            loss_sum, count = as_sum_and_count(task.loss_fn(model, batch), samples_in(batch))
            totals[0] += float(loss_sum)
            totals[1] += float(count)
            if task.metric is not None:
                metric_sum, metric_count = as_sum_and_count(
                    task.metric(model, batch), samples_in(batch)
                )
                totals[2] += float(metric_sum)
                totals[3] += float(metric_count)
    model.train(was_training)
    metric = totals[2] / totals[3] if task.metric is not None and totals[3] else None
    return totals[0] / max(totals[1], 1e-30), metric


def _evaluate_every(
    task: Task, acc: Accumulator, config: TrainConfig, step: int, batch_size: int
) -> dict[str, Any]:
    if not config.eval_every or step % config.eval_every or task.eval_data is None:
        return {}
    eval_loss, metric = evaluate(task, acc.model, _eval_batch_size(acc, batch_size))
    return {"eval_loss": eval_loss, "metric": metric if metric is not None else ""}


def _eval_batch_size(acc: Accumulator, batch_size: int) -> int:
    """Evaluate in batches of the training micro-batch; under auto, of the size adopted so far
    (it fits with gradients kept, so it fits without): never the whole batch that did not."""
    if isinstance(acc.micro_batch_size, int):
        return acc.micro_batch_size
    adopted = acc.auto_state.size if acc.auto_state is not None else None
    return adopted or batch_size

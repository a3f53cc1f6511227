"""``fit(task, config)``: the training loop, readable top to bottom.

One iteration is one optimizer step on one effective batch: the engine cuts it into
micro-batches and steps once (``Accumulator.train_step``). Around it, in one place each:
the data (``_batches``: the order is a pure function of ``seed`` and the epoch, so a resumed
run finds its place by the step number alone), the log (``RunLog.step``, once per optimizer
step) and the snapshot (``_save``, at step boundaries only: a run killed mid-window redoes that
window from the same data and random state). The run folder is locked for the run's life
(Note [one writer] in ``train.folder``); SIGINT / SIGTERM stop it cleanly (Note [clean stop] in
``train.signals``); a step with NaN or inf stops it before anything is written
(Note [non-finite runs]). With ``local_steps > 1`` each rank takes local steps and the ranks
exchange once per round; snapshots, evaluation and signals wait for a round's end (Note [local
rounds] in ``train.rounds``).

Note [non-finite runs]
    With ``nonfinite="raise"`` (the default) the engine refuses a window whose loss or gradient
    is NaN / inf before the optimizer steps, so the weights stay those of the last good step:
    the trainer stops with one line naming the step and the last good snapshot, writes no
    ``model.pt``, and ``--resume`` continues from that snapshot. With ``"skip"`` such windows
    are skipped (``skipped`` in ``metrics.csv``) and with ``"apply"`` they are applied, but a run
    whose last ``MAX_SKIPPED_IN_A_ROW`` steps were all skipped for non-finite values stops too
    (fp16 skips steps itself, as its loss scaler does, and is held to the same limit), and a
    snapshot or ``model.pt`` is never written from weights that are not finite.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.app import resume, rounds
from bigbatch.app.config import (
    TrainConfig,
    make_config,
    resolve_batch,
    resumable_changes,
    run_length,
    scaled_lr,
)
from bigbatch.app.folder import RunFolder
from bigbatch.app.log import METRICS_CSV, NullLog, RunLog
from bigbatch.app.report import Summary, print_summary, summarize
from bigbatch.app.signals import Stopped, StopSignals
from bigbatch.app.task import Task, canonical_path, check_task
from bigbatch.core import _rng
from bigbatch.core._stepping import NonFiniteError
from bigbatch.core._tree import map_tensors
from bigbatch.core._units import format_bytes
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.batchnorm import batchnorm as apply_batchnorm
from bigbatch.core.engine import Accumulator, StepResult
from bigbatch.core.loss import as_sum_and_count
from bigbatch.core.oom import MemoryBudgetExceeded, is_out_of_memory
from bigbatch.core.peak import PeakProbe
from bigbatch.core.split import batch_size as samples_in
from bigbatch.distributed import launch as distributed
from bigbatch.distributed.local import LocalAccumulation

MAX_SKIPPED_IN_A_ROW = 20
_NOTHING_TO_RESUME = (
    "--resume: run folder {out!r} holds no run to resume: drop --resume to start a new run "
    "there, or give --resume auto to start when there is nothing to resume."
)


class NonFiniteRun(FloatingPointError):
    """The run stopped on NaN / inf values (Note [non-finite runs]); the message says where."""


class OutOfMemoryRun(MemoryError):
    """A step ran out of memory or over ``memory_budget``; the message names the settings to change."""


@dataclass(frozen=True)
class _Run:
    """What stays fixed during a run (a record, built once by ``fit``)."""

    task: Task
    config: TrainConfig
    ranks: distributed.Ranks
    folder: RunFolder
    acc: Accumulator
    local: LocalAccumulation | None  # local_steps > 1 (Note [local rounds]); else DDP steps
    identity: dict[str, Any]
    batch_size: int
    steps_per_epoch: int
    total_steps: int


@dataclass
class _Progress:
    """What changes: steps done, training time, the last snapshot, non-finite steps in a row."""

    step: int = 0
    elapsed_s: float = 0.0
    snapshot_step: int | None = None
    skipped_in_a_row: int = 0


def fit(task: Task, config: TrainConfig | dict[str, Any] | None = None, **settings: Any) -> Summary:
    """Train ``task`` with exact gradient accumulation; return the run's ``Summary``.

    Writes the run folder ``config.out``: ``metrics.csv`` (one row per optimizer step),
    ``snapshot.pt`` and the snapshots before it (resume state), ``model.pt`` (the final state
    dict), ``summary.json``.

    Args:
        task: the model, data and loss (``bigbatch.Task``).
        config: a ``TrainConfig`` or a dict of its fields.
        **settings: fields of ``TrainConfig`` that override ``config``.

    Returns:
        The ``Summary`` of the run (time, samples/s, peak memory, final loss, metric).

    Raises:
        ValueError, TypeError: a bad or contradictory setting, or a run folder that belongs to
            another run. TaskError: the task cannot be used. RunFolderBusy: another run is
            writing the folder. NonFiniteRun: a step's loss or gradient was NaN / inf (Note
            [non-finite runs]). Stopped: SIGINT / SIGTERM, after a snapshot.

    Example:
        >>> summary = bigbatch.fit(task, batch_size=256, micro_batch_size=32, epochs=3)  # doctest: +SKIP
    """
    config = make_config(config, **settings)
    check_task(task)
    if config.resume is True and not os.path.isdir(config.out):  # touch nothing: not even mkdir
        raise resume.RunMismatchError(_NOTHING_TO_RESUME.format(out=config.out))
    joined = not distributed.in_group()  # fit leaves at the end only a group it joined itself
    ranks = distributed.setup(config.device)
    rounds.check(config, ranks, task.model)
    with RunFolder(config.out, ranks) as folder, StopSignals(ranks.device) as stop:
        run = _prepare(task, config, ranks, folder)
        progress = _start(run)
        log = (
            RunLog(folder.out, run.total_steps, progress.step, config.quiet, config.log_every)
            if ranks.is_main
            else NullLog()
        )
        try:
            _train(run, progress, log, stop)
        finally:
            log.close()
        final = evaluate(task, run.acc.model, _eval_batch_size(run))
        if ranks.is_main:
            _check_finite(run, progress, "model.pt")
            resume.atomic_save(
                distributed.unwrap(run.acc.model).state_dict(), folder.path("model.pt")
            )
    # every rank waits here for rank 0's files (the summary reads metrics.csv)
    distributed.teardown() if joined else distributed.barrier()
    summary = summarize(config.out, progress.elapsed_s, run.batch_size, final, write=ranks.is_main)
    if ranks.is_main and not config.quiet:
        print_summary(summary)
    return summary


def _train(run: _Run, progress: _Progress, log: RunLog | NullLog, stop: StopSignals) -> None:
    """The steps from ``progress.step + 1`` to the last; a snapshot when one is due or asked."""
    batches = _batches(run, progress.step)
    for step in range(progress.step + 1, run.total_steps + 1):
        samples, batch = next(batches)
        row = _step(run, progress, step, samples, batch)
        ended = rounds.round_end(step, run.config.local_steps, run.total_steps)
        log.step({**row, **_evaluate_every(run, step, ended)})
        if not ended:  # mid-round: the ranks hold different models (Note [local rounds])
            continue
        signum = stop.requested()
        if signum or _snapshot_due(run, step, ended):
            _save(run, progress)
        if signum:
            raise Stopped(_stopped_line(run, progress, signum), signum)


def _step(run: _Run, progress: _Progress, step: int, samples: int, batch: Any) -> dict[str, Any]:
    """One optimizer step and its row of ``metrics.csv``."""
    batch = map_tensors(lambda t: t.to(run.ranks.device), batch)
    probe = PeakProbe(run.ranks.device)
    record = probe.reset()
    started = time.perf_counter()
    try:
        result, round_row = _train_step(run, step, batch)
    except NonFiniteError as exc:
        raise NonFiniteRun(f"step {step}: {exc} " + _last_good(run, progress)) from None
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfMemoryRun(_out_of_memory_line(run.config, step, exc)) from exc
    seconds = time.perf_counter() - started
    progress.step, progress.elapsed_s = step, progress.elapsed_s + seconds
    progress.skipped_in_a_row = progress.skipped_in_a_row + 1 if result.nonfinite else 0
    if progress.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise NonFiniteRun(
            f"step {step}: the last {MAX_SKIPPED_IN_A_ROW} steps all had NaN / inf values "
            f"(skipped or applied); stopping. {_last_good(run, progress)}"
        )
    epoch = (step - 1) // run.steps_per_epoch
    counted = samples if run.local is None else samples_in(batch)  # the samples result.count saw
    row = _row(
        step, epoch, result, run.acc.optimizer, seconds, probe.finish(record), samples, counted
    )
    return {**row, **round_row}


def _train_step(run: _Run, step: int, batch: Any) -> tuple[StepResult, dict[str, Any]]:
    """The exact data-parallel step, or this rank's local step (Note [local rounds])."""
    task = run.task
    if run.local is None:
        return run.acc.train_step(batch, task.loss_fn, count_fn=task.count_fn), {}
    return rounds.train_step(run.local, batch, task, last=step == run.total_steps)


# ---------------------------------------------------------------------------- setting up
def _prepare(task: Task, config: TrainConfig, ranks: distributed.Ranks, folder: RunFolder) -> _Run:
    batch_size = resolve_batch(config)[0]
    steps_per_epoch, total_steps = run_length(config, len(task.train_data))
    if total_steps >= steps_per_epoch:  # the run reaches the epoch's last (smaller) batch
        distributed.check_batch_sizes(len(task.train_data), batch_size, ranks.world_size)
    model = _prepare_model(task.model, config, ranks)
    optimizer = (task.optimizer or torch.optim.AdamW)(
        model.parameters(), lr=scaled_lr(config, batch_size)
    )
    scheduler = (task.scheduler or _default_schedule(config))(optimizer, total_steps)
    acc = Accumulator(
        model, optimizer, resolve_batch(config)[1], scheduler, config.max_grad_norm,
        config.precision, config.memory_budget, nonfinite=config.nonfinite,
    )  # fmt: skip
    local = rounds.make_local(acc, config)
    return _Run(task, config, ranks, folder, acc, local, _identity(task, config, optimizer),
                batch_size, steps_per_epoch, total_steps)  # fmt: skip


def _prepare_model(
    model: torch.nn.Module, config: TrainConfig, ranks: distributed.Ranks
) -> torch.nn.Module:
    if config.gradient_checkpointing:
        from bigbatch.memory.checkpointing import enable_checkpointing

        enable_checkpointing(model)
    if config.batchnorm != "keep":
        apply_batchnorm(model, config.batchnorm or "keep")  # before DDP wraps the modules
    model.train()
    if config.local_steps > 1:  # each rank steps its own replica (Note [local rounds])
        return model.to(ranks.device)
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


def _identity(task: Task, config: TrainConfig, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What makes a run the same run: the task, the settings that change the result, the model,
    the optimizer's class (its state only loads into the same kind)."""
    settings = {k: v for k, v in config.to_dict().items() if k not in resumable_changes()}
    settings["task"] = canonical_path(config.task) if config.task else None
    model = distributed.unwrap(task.model)
    shapes = {name: list(p.shape) for name, p in model.state_dict().items()}
    optimizer_class = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    return {
        **settings,
        "model": shapes,
        "train_samples": len(task.train_data),
        "optimizer": optimizer_class,
    }


def _start(run: _Run) -> _Progress:
    """Restore the newest snapshot when resuming; seed everything when starting."""
    config, folder = run.config, run.folder
    if run.ranks.is_main:
        resume.clean_stale_temps(folder.out)  # the lock holder alone (Note [one writer])
    snapshot = resume.read_latest(folder.out)
    if snapshot is not None and not config.resume:
        raise resume.RunMismatchError(
            f"run folder {config.out!r} already holds a run (step {snapshot.step} of "
            f"{snapshot.total_steps}): add --resume to continue it, or choose another --out."
        )
    if snapshot is None:
        _nothing_to_resume(config, folder)
        _rng.seed_all(config.seed)
        return _Progress()
    _restore(run, snapshot)
    return _Progress(step=snapshot.step, elapsed_s=snapshot.elapsed_s, snapshot_step=snapshot.step)


def _nothing_to_resume(config: TrainConfig, folder: RunFolder) -> None:
    """``--resume`` and no snapshot: a run killed before its first snapshot starts again from
    step 0 (said in a warning); a folder that never held a run is an error, unless ``auto``."""
    if config.resume is not True:
        return
    if not os.path.exists(folder.path(METRICS_CSV)):
        raise resume.RunMismatchError(_NOTHING_TO_RESUME.format(out=config.out))
    warnings.warn(
        f"--resume: the run in {config.out!r} was stopped before its first snapshot: it starts "
        "again from step 0.",
        BigBatchWarning,
        stacklevel=4,
    )


def _restore(run: _Run, snapshot: resume.Snapshot) -> None:
    resume.check_same_run(snapshot.identity, run.identity, run.config.out)
    acc = run.acc
    optimizer, engine = snapshot.optimizer, snapshot.engine
    if snapshot.local is not None:  # each rank its own (Note [local rounds])
        optimizer, engine = rounds.this_rank(snapshot.local, run.ranks)
    distributed.unwrap(acc.model).load_state_dict(snapshot.model)
    acc.optimizer.load_state_dict(optimizer)
    if acc.scheduler is not None and snapshot.scheduler is not None:
        acc.scheduler.load_state_dict(snapshot.scheduler)
    acc.load_state_dict(engine)
    if run.local is not None and snapshot.local is not None:
        run.local.load_state_dict(snapshot.local["outer"])
    changes = snapshot.environment_changes()
    if changes and run.ranks.is_main:
        warnings.warn(
            f"resuming with {', '.join(changes)}: the last bits of the results may differ from "
            "an uninterrupted run (other kernels, another summation order).",
            BigBatchWarning,
            stacklevel=3,
        )
    _restore_rng(snapshot.rng, run.ranks)


def _restore_rng(saved: list[dict[str, Any]], ranks: distributed.Ranks) -> None:
    """Each rank takes back its own generators; on another number of ranks, rank 0's (warned)."""
    if len(saved) == ranks.world_size:
        _rng.restore_all(saved[ranks.rank])
        return
    if ranks.is_main:
        warnings.warn(
            f"resuming on {ranks.world_size} rank(s) a run saved on {len(saved)}: every rank "
            "takes rank 0's random state, so random draws (dropout) differ from the "
            "uninterrupted run; resume on the same number of ranks for a bitwise-equal result.",
            BigBatchWarning,
            stacklevel=3,
        )
    _rng.restore_all(saved[0])


# ---------------------------------------------------------------------------- data, log, snapshot
def _batches(run: _Run, start_step: int) -> Iterator[tuple[int, Any]]:
    """The training batches from ``start_step`` on, as ``(samples in the global batch, this
    rank's share)``. Epoch e visits ``randperm(n)`` seeded by ``seed + e`` (its own generator,
    never the global one), so skipping to a position loads nothing and draws no random number;
    each global batch is dealt out to the ranks (Note [global batch] in bigbatch.distributed.launch)."""
    task, config, batch_size = run.task, run.config, run.batch_size
    collate = task.collate_fn or torch.utils.data.default_collate
    n = len(task.train_data)
    epoch, position = divmod(start_step, run.steps_per_epoch)
    while True:
        seeded = torch.Generator().manual_seed(config.seed + epoch)
        order = torch.randperm(n, generator=seeded).tolist() if config.shuffle else range(n)
        for i in range(position, run.steps_per_epoch):
            indices = list(order[i * batch_size : (i + 1) * batch_size])
            share = distributed.deal(indices, run.ranks)
            yield len(indices), collate([task.train_data[j] for j in share])
        epoch, position = epoch + 1, 0


def _row(
    step: int, epoch: int, result: StepResult, optimizer: torch.optim.Optimizer, seconds: float,
    peak: Any, samples: int, counted: int,
) -> dict[str, Any]:  # fmt: skip
    tokens = result.count != counted  # the loss counts tokens (or pixels), not samples
    # A step redone after running out of memory: the adopted attempt's peak, the retries' apart.
    step_peak = (
        result.peak_bytes
        if result.oom_retries and result.peak_bytes is not None
        else peak.peak_bytes
    )
    return {
        "step": step, "epoch": epoch, "loss": result.loss, "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": result.grad_norm, "samples": samples, "count": result.count,
        "micro_batch_size": result.micro_batch_size, "micro_batches": result.micro_batches,
        "oom_retries": result.oom_retries, "skipped": int(result.skipped),
        "nonfinite": int(result.nonfinite), "time_s": seconds, "samples_per_s": samples / seconds,
        "tokens_per_s": result.count / seconds if tokens else "",
        "peak_bytes": peak.baseline_bytes + step_peak, "step_peak_bytes": step_peak,
        "retry_peak_bytes": peak.peak_bytes if result.oom_retries else "",
    }  # fmt: skip


def _snapshot_due(run: _Run, step: int, ended: int) -> bool:
    """Due at a step (or, under local rounds, inside the ``ended`` steps of the round just ended)
    that is a multiple of ``save_every``, an epoch's end or the run's last."""
    saves = rounds.crossed(step, ended, run.config.save_every)
    return saves or rounds.crossed(step, ended, run.steps_per_epoch) or step == run.total_steps


def _save(run: _Run, progress: _Progress) -> None:
    acc, is_main = run.acc, run.ranks.is_main
    rng = distributed.all_gather_object(_rng.capture_all())  # each rank's own
    local = rounds.capture(run.local, acc, is_main) if run.local is not None else None
    if not is_main:
        return
    _check_finite(run, progress, "a snapshot")
    snapshot = resume.Snapshot(
        identity=run.identity, step=progress.step, total_steps=run.total_steps,
        model=distributed.unwrap(acc.model).state_dict(), optimizer=acc.optimizer.state_dict(),
        scheduler=acc.scheduler.state_dict() if acc.scheduler is not None else None,
        engine=acc.state_dict(), rng=rng, elapsed_s=progress.elapsed_s, local=local,
    )  # fmt: skip
    resume.write_snapshot(
        run.folder.out, snapshot, run.config.keep_snapshots, progress.snapshot_step
    )
    progress.snapshot_step = progress.step


def _check_finite(run: _Run, progress: _Progress, what: str) -> None:
    model = distributed.unwrap(run.acc.model)
    if all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.is_floating_point()):
        return
    raise NonFiniteRun(
        f"step {progress.step}: the weights hold NaN / inf (nonfinite={run.config.nonfinite!r}); "
        f"{what} was not written. {_last_good(run, progress)}"
    )


def _last_good(run: _Run, progress: _Progress) -> str:
    path = resume.latest_path(run.folder.out)
    if path is None:
        return "No snapshot was written yet: fix the cause and start again."
    last = f" (step {progress.snapshot_step})" if progress.snapshot_step is not None else ""
    return (
        f"The last good snapshot is {path}{last}: fix the cause (data, learning rate, clipping) "
        "and run again with --resume, or pass --nonfinite skip."
    )


def _out_of_memory_line(config: TrainConfig, step: int, exc: BaseException) -> str:
    """What ran out and which settings help, in the words of the flags (and the TOML keys)."""
    if isinstance(exc, MemoryBudgetExceeded) and exc.used_bytes is not None:
        cause = (
            f"micro-batch {exc.micro_batch_size} used {format_bytes(exc.used_bytes)}, over "
            f"--memory-budget {format_bytes(exc.budget_bytes or 0)}"
        )
    elif config.micro_batch_size == "auto" and isinstance(exc, MemoryError):  # auto's floor
        budget = config.memory_budget is not None
        return (
            f"step {step}: out of memory{' or over --memory-budget' if budget else ''} with "
            "--micro-batch-size auto down to 1: a single sample does not fit. "
            f"{'Use a larger --memory-budget, add' if budget else 'Add'} --gradient-checkpointing, "
            "free memory, or use a smaller model or sequence length."
        )
    else:
        cause = f"out of memory at micro-batch {resolve_batch(config)[1]} ({exc})"
    return (
        f"step {step}: {cause}. Use --micro-batch-size auto (the largest that fits), a smaller "
        "--micro-batch-size, --gradient-checkpointing, or a larger --memory-budget."
    )


def _stopped_line(run: _Run, progress: _Progress, signum: int) -> str:
    import shlex
    import signal

    args = sys.argv[1:]
    if args[:1] == ["train"]:  # the command line: say the command to type, quoted for a shell
        command = shlex.join(["bigbatch", *args, *([] if "--resume" in args else ["--resume"])])
    else:
        command = "the same call with resume=True"
    return (
        f"stopped by {signal.Signals(signum).name} after step {progress.step} of "
        f"{run.total_steps}; snapshot written to {resume.latest_path(run.folder.out)}. "
        f"Resume with: {command}"
    )


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


def _evaluate_every(run: _Run, step: int, ended: int) -> dict[str, Any]:
    """Evaluate at multiples of ``eval_every``; under local rounds, at the end of the round
    (of ``ended`` steps) that holds one."""
    if not rounds.crossed(step, ended, run.config.eval_every) or run.task.eval_data is None:
        return {}
    eval_loss, metric = evaluate(run.task, run.acc.model, _eval_batch_size(run))
    return {"eval_loss": eval_loss, "metric": metric if metric is not None else ""}


def _eval_batch_size(run: _Run) -> int:
    """Evaluate in batches of the training micro-batch; under auto, of the size adopted so far
    (it fits with gradients kept, so it fits without): never the whole batch that did not."""
    return run.acc.current_micro_batch_size or run.batch_size

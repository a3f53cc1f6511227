"""``fit(task, config)``: the training loop, readable top to bottom.

One iteration is one optimizer step on one effective batch: the engine cuts it into
micro-batches and steps once (``Accumulator.train_step``). Around it, in one place each: what
the run is built from (``app.run``), resuming or seeding (``_start``), the data (``_batches``:
the order is a pure function of ``seed`` and the epoch, so a resumed run finds its place by the
step number alone), the log (``RunLog.step``, once per optimizer step), evaluation
(``evaluate``) and the snapshot (``_save``, at step boundaries only: a run killed mid-window
redoes that window from the same data and random state). The run folder is locked for the run's
life (Note [one writer] in ``app.folder``); a signal stops the run after a snapshot, a step with
NaN or inf before anything is written (``app.stopping``); under ``--local-steps`` λ > 1 snapshots,
evaluation and signals wait for a round's end (Note [local rounds] in ``app.rounds``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from bigbatch.app import folder, rounds, snapshot, stopping
from bigbatch.app.log import METRICS_CSV, RunLog
from bigbatch.app.report import Summary, print_summary, summarize
from bigbatch.app.run import Run, prepare
from bigbatch.app.settings import TrainConfig, make_config
from bigbatch.app.task import Task, check_task
from bigbatch.core import _rng, split
from bigbatch.core._stepping import NonFiniteError
from bigbatch.core._tree import map_tensors
from bigbatch.core._units import parse_bytes
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.engine import StepResult
from bigbatch.core.ledger import measure_peak_flops
from bigbatch.core.loss import as_sum_and_count
from bigbatch.core.oom import is_out_of_memory
from bigbatch.core.peak import PeakProbe
from bigbatch.distributed import launch as distributed

MAX_SKIPPED_IN_A_ROW = 20
_MODEL_KEPT = (
    "model.pt was not written; the last snapshot holds the trained model: free space "
    "and run again with --resume"
)
_NOTHING_TO_RESUME = (
    "--resume: run folder {out!r} holds no run to resume: drop --resume to start "
    "a new run there, or give --resume auto (start when there is none)."
)


@dataclass
class _Progress:
    """What changes: steps done, training time, the last snapshot, non-finite steps in a row,
    the round in flight (Note [local rounds])."""

    step: int = 0
    elapsed_s: float = 0.0
    snapshot_step: int | None = None
    skipped_in_a_row: int = 0
    tally: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss sum, count, skipped
    peak: tuple[float, str] | None = None  # the device's FLOP/s for MFU, and where it came from


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
            writing the folder. NonFiniteRun: a step's loss or gradient was NaN / inf
            (Note [non-finite runs]). Stopped: SIGINT / SIGTERM, after a snapshot.

    Example:
        >>> summary = bigbatch.fit(task, batch_size=256, micro_batch_size=32, epochs=3)  # doctest: +SKIP
    """
    config = make_config(config, **settings)
    check_task(task)
    if config.resume is True and not os.path.isdir(config.out):  # touch nothing: not even mkdir
        raise snapshot.RunMismatchError(_NOTHING_TO_RESUME.format(out=config.out))
    joined = not distributed.in_group()  # fit leaves at the end only a group it joined itself
    ranks = distributed.setup(config.device)
    rounds.check_local_steps(config, ranks, task.model)
    run = prepare(task, config, ranks)  # in memory: refused before mkdir
    with run.folder, run.stop:
        progress = _start(run)
        log = (
            RunLog(config.out, run.total_steps, progress.step, config.quiet, config.log_every)
            if ranks.is_main
            else None
        )  # rank 0 alone writes
        with contextlib.closing(log) if log else contextlib.nullcontext():
            _train(run, progress, log)
        summary = _finish(run, progress)
    distributed.teardown() if joined else distributed.barrier()
    if ranks.is_main and not config.quiet:
        print_summary(summary)
    return summary


def _train(run: Run, progress: _Progress, log: RunLog | None) -> None:
    """The steps from ``progress.step + 1`` to the last; a snapshot when one is due or asked."""
    batches = _batches(run, progress.step)
    for step in range(progress.step + 1, run.total_steps + 1):
        samples, batch = next(batches)
        row = _step(run, progress, step, samples, batch)
        ended = rounds.round_end(step, run.config.local_steps, run.total_steps)
        if ended:  # the ranks agree on a stop (and sum the round: Note [local rounds])
            signum, summed = run.stop.requested(progress.tally if run.local else ())
            progress.tally = [0.0, 0.0, 0.0]  # the next round starts from zero
            row.update(rounds.columns(summed) if run.local else {})
        # evaluate at multiples of eval_every (under local rounds: at the end of the round)
        if rounds.crossed(step, ended, run.config.eval_every) and run.task.eval_data is not None:
            eval_loss, metric = evaluate(run)
            row.update(eval_loss=eval_loss, metric="" if metric is None else metric)
        log.step(row) if log else None
        if not ended:  # mid-round: the ranks hold different models (Note [local rounds])
            continue
        # a snapshot is due at a multiple of save_every, an epoch's end or the run's last step
        # (under local rounds: one among the ``ended`` steps of the round just ended)
        saves = (run.config.save_every, run.steps_per_epoch)
        if signum or step == run.total_steps or any(rounds.crossed(step, ended, n) for n in saves):
            _save(run, progress)
        if signum:
            raise stopping.stopped(signum, progress.step, run.total_steps, run.folder.out)


def _finish(run: Run, progress: _Progress) -> Summary:
    """The final evaluation (a signal stops it: Note [clean stop]), ``model.pt`` and the
    summary."""
    final = evaluate(run, run.stop)
    signum = run.stop.requested()[0]  # also: every rank waits here for rank 0's metrics.csv
    if signum:
        raise stopping.stopped(signum, progress.step, run.total_steps, run.folder.out, final=True)
    with run.stop.writing():  # the ranks agreed above: metrics.csv is whole for all
        if run.ranks.is_main:
            _check_finite(run, progress, "model.pt")
            model = distributed.unwrap(run.acc.model).state_dict()
            folder.replace_file(run.folder.path("model.pt"), model, _MODEL_KEPT)
        return summarize(
            run.folder.out, progress.elapsed_s, run.batch_size, final, run.ranks.is_main
        )


def _step(run: Run, progress: _Progress, step: int, samples: int, batch: Any) -> dict[str, Any]:
    """One optimizer step and its row of ``metrics.csv``."""
    batch = map_tensors(lambda t: t.to(run.ranks.device), batch)
    probe = PeakProbe(run.ranks.device)
    record, started = probe.reset(), time.perf_counter()
    try:
        last = step == run.total_steps
        result, round_row = rounds.train_step(run.local, run.acc, batch, run.task, last)
    except NonFiniteError as exc:
        raise stopping.NonFiniteRun(f"step {step}: {exc} {_last_good(run, progress)}") from None
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        lm = any(hasattr(m, "get_output_embeddings") for m in run.task.model.modules())
        line = stopping.out_of_memory_line(run.config, step, exc, lm)
        raise stopping.OutOfMemoryRun(line) from exc
    seconds = time.perf_counter() - started
    progress.step, progress.elapsed_s = step, progress.elapsed_s + seconds
    # the round's sums (Note [local rounds]); a skipped step's loss may be NaN: counted as skipped
    applied = [0.0, 0.0, 1.0] if result.skipped else [result.loss * result.count, result.count, 0.0]
    progress.tally = [total + value for total, value in zip(progress.tally, applied, strict=True)]
    progress.skipped_in_a_row = progress.skipped_in_a_row + 1 if result.nonfinite else 0
    if progress.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise stopping.NonFiniteRun(
            f"step {step}: the last {MAX_SKIPPED_IN_A_ROW} steps all had NaN "
            f"/ inf values (skipped or applied). {_last_good(run, progress)}"
        )
    counted = samples if run.local is None else split.batch_size(batch)  # what result.count saw
    row = _row(run, step, result, seconds, probe.finish(record), samples, counted)
    return {**row, **_ledger_row(run, progress, result, seconds), **round_row}


def _ledger_row(run: Run, progress: _Progress, r: StepResult, seconds: float) -> dict[str, Any]:
    """The step's ledger in ``metrics.csv`` (Note [step ledger] in ``bigbatch.core.ledger``):
    tokens, model FLOP/s, MFU against ``--peak-tflops`` or a peak measured once, memory per
    computed token; recomputation under gradient checkpointing apart (a forward's worth)."""
    if r.ledger is None:
        return {}
    if progress.peak is None:
        given = run.config.peak_tflops
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.config.precision)
        dtype = half or next(run.acc.model.parameters()).dtype
        peak = (given * 1e12, "given") if given else measure_peak_flops(dtype, run.ranks.device)
        progress.peak = peak
    recompute = r.ledger.computed_flops / 3 if run.config.gradient_checkpointing else 0.0
    ledger = replace(
        r.ledger, seconds=seconds, peak_flops=progress.peak[0], recompute_flops=recompute
    )
    per_token = ledger.bytes_per_token
    return {
        "input_tokens": ledger.input_tokens,
        "computed_tokens": ledger.computed_tokens,
        "model_tflops": ledger.model_flops / 1e12,
        "recompute_tflops": ledger.recompute_flops / 1e12 if recompute else "",
        "tflops_per_s": (ledger.flops_per_s or 0) / 1e12,
        "mfu": ledger.mfu,
        "peak": progress.peak[1],
        "bytes_per_token": per_token if per_token is not None else "",
    }


def _start(run: Run) -> _Progress:
    """Restore the newest snapshot when resuming; seed everything when starting."""
    config, out = run.config, run.folder.out
    if run.ranks.is_main:
        folder.clean_stale_temps(out)  # the lock holder alone (Note [one writer])
    path = snapshot.latest_path(out)
    saved = None if path is None else snapshot.read_snapshot(path)
    if saved is not None and not config.resume:
        raise snapshot.RunMismatchError(
            f"run folder {config.out!r} already holds a run (step "
            f"{saved.step} of {saved.total_steps}): add --resume "
            "to continue it, or choose another --out."
        )
    if path is None or saved is None:  # a run killed before its first snapshot starts again
        if config.resume is True and not os.path.exists(run.folder.path(METRICS_CSV)):
            raise snapshot.RunMismatchError(_NOTHING_TO_RESUME.format(out=config.out))
        if config.resume is True:
            warnings.warn(
                f"--resume: the run in {config.out!r} was stopped before its first "
                "snapshot: it starts again from step 0.",
                BigBatchWarning,
                stacklevel=3,
            )
        _rng.seed_all(config.seed)
        return _Progress()
    _restore(run, saved, path)
    if run.ranks.is_main:  # not the bar nor the table: said under --quiet too
        print(f"resuming from step {saved.step} of {run.total_steps} ({path})", flush=True)
    return _Progress(step=saved.step, elapsed_s=saved.elapsed_s, snapshot_step=saved.step)


def _restore(run: Run, saved: snapshot.Snapshot, path: str) -> None:
    """Every part of the run from the snapshot ``saved``; a field that does not fit is named
    (Note [snapshot fields] in ``app.snapshot``)."""
    snapshot.check_same_run(saved.identity, run.identity, run.config.out)
    if saved.total_steps != run.total_steps:
        raise snapshot.crafted(
            path,
            "total_steps",
            f"is {saved.total_steps}, and this run takes {run.total_steps} steps",
        )
    acc, (optimizer, engine) = run.acc, (saved.optimizer, saved.engine)
    if saved.local is not None and run.local is not None:  # Note [local rounds]
        with snapshot.restoring(path, "local"):
            optimizer, engine = rounds.this_rank(saved.local, run.ranks)  # each rank its own
            run.local.load_state_dict(saved.local["outer"])
    loads: list[tuple[str, Callable[[Any], Any], Any]] = [
        ("model", distributed.unwrap(acc.model).load_state_dict, saved.model),
        ("optimizer", acc.optimizer.load_state_dict, optimizer),
        ("scheduler", functools.partial(_load_scheduler, acc.scheduler), saved.scheduler),
        ("engine", acc.load_state_dict, engine),
        ("rng", functools.partial(snapshot.restore_rng, ranks=run.ranks), saved.rng),
    ]
    for name, load, state in loads:
        with snapshot.restoring(path, name):
            load(state)
    changes = saved.environment_changes()
    if changes and run.ranks.is_main:
        warnings.warn(
            f"resuming with {', '.join(changes)}: the last bits of the results may "
            "differ from an uninterrupted run (other kernels, another summation order).",
            BigBatchWarning,
            stacklevel=3,
        )


def _load_scheduler(scheduler: Any, state: dict[str, Any] | None) -> None:
    if (scheduler is None) != (state is None):
        raise ValueError(f"{state!r:.40} for the run's scheduler {scheduler}")
    if scheduler is not None:
        scheduler.load_state_dict(state)


# ---------------------------------------------------------------------------- data, log, snapshot
def _batches(run: Run, start_step: int) -> Iterator[tuple[int, Any]]:
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
    run: Run, step: int, r: StepResult, seconds: float, peak: Any, samples: int, counted: int
) -> dict[str, Any]:
    """The step's row of ``metrics.csv`` (``report.COLUMNS``); ``counted``: the samples ``r.count``
    saw, which differ from it when the loss counts tokens."""
    tokens = r.count != counted or r.tokens is not None
    # A step redone after running out of memory: the adopted attempt's peak, the retries' apart.
    step_peak = r.peak_bytes if r.oom_retries and r.peak_bytes is not None else peak.peak_bytes
    dynamo = sys.modules.get("torch._dynamo.utils")  # graphs torch.compile built: its recompiles
    graphs = dynamo.counters["stats"]["unique_graphs"] if dynamo else 0  # type: ignore[attr-defined]
    terms = " ".join(f"{k}={v:.4g}" for k, v in r.terms.items())  # "lm=2.31 aux=0.052"
    return {
        "step": step,
        "epoch": (step - 1) // run.steps_per_epoch,
        "loss": r.loss,
        "lr": run.acc.optimizer.param_groups[0]["lr"],
        "grad_norm": r.grad_norm,
        "samples": samples,
        "count": r.count,
        "micro_batch_size": r.micro_batch_size if r.micro_batch_size is not None else "",
        "micro_batch_tokens": r.micro_batch_tokens or "",
        "micro_batches": r.micro_batches,
        "oom_retries": r.oom_retries,
        "skipped": int(r.skipped),
        "nonfinite": int(r.nonfinite),
        "time_s": seconds,
        "samples_per_s": samples / seconds,
        "tokens_per_s": (r.tokens or r.count) / seconds if tokens else "",
        "padding": 1 - (r.tokens or 0) / r.padded_tokens if r.padded_tokens else "",
        "terms": terms if len(r.terms) > 1 else "",
        "graphs": graphs or "",
        "peak_bytes": peak.baseline_bytes + step_peak,
        "step_peak_bytes": step_peak,
        "retry_peak_bytes": peak.peak_bytes if r.oom_retries else "",
        "memory_budget": parse_bytes(run.config.memory_budget) or "",
    }


def _save(run: Run, progress: _Progress) -> None:
    acc, is_main = run.acc, run.ranks.is_main
    rng = distributed.all_gather_object(_rng.capture_all())  # each rank's own
    local = rounds.capture(run.local, acc, is_main) if run.local is not None else None
    if not is_main:
        return
    _check_finite(run, progress, "a snapshot")
    saved = snapshot.Snapshot(
        identity=run.identity,
        step=progress.step,
        total_steps=run.total_steps,
        model=distributed.unwrap(acc.model).state_dict(),
        optimizer=acc.optimizer.state_dict(),
        scheduler=acc.scheduler.state_dict() if acc.scheduler is not None else None,
        engine=acc.state_dict(),
        rng=rng,
        elapsed_s=progress.elapsed_s,
        local=local,
    )
    with run.stop.writing():
        keep = run.config.keep_snapshots
        snapshot.write_snapshot(run.folder.out, saved, keep, progress.snapshot_step)
    progress.snapshot_step = progress.step
    if run.stop.again:  # a second signal came during the write (Note [clean stop])
        raise stopping.stopped(run.stop.signum, progress.step, run.total_steps, run.folder.out)


def _check_finite(run: Run, progress: _Progress, what: str) -> None:
    params = distributed.unwrap(run.acc.model).parameters()
    if not all(bool(torch.isfinite(p).all()) for p in params if p.is_floating_point()):
        raise stopping.NonFiniteRun(
            f"step {progress.step}: the weights hold NaN / inf (nonfinite="
            f"{run.config.nonfinite!r}); {what} was not written. "
            f"{_last_good(run, progress)}"
        )


def _last_good(run: Run, progress: _Progress) -> str:
    """Where a run stopped on NaN / inf continues from, and how."""
    path, step = snapshot.latest_path(run.folder.out), progress.snapshot_step
    if path is None:
        return "No snapshot was written yet: fix the cause and start again."
    last = f" (step {step})" if step is not None else ""
    return (
        f"The last good snapshot is {path}{last}: fix the cause (data, learning rate, "
        "clipping) and run again with --resume, or pass --nonfinite skip."
    )


# ---------------------------------------------------------------------------- evaluation
def evaluate(
    run: Run, stop: stopping.StopSignals | None = None
) -> tuple[float | None, float | None]:
    """``(eval_loss, metric)`` of the run's model over its task's eval data, each ``Σ sum / Σ
    count``; Nones without. In eval mode, without gradients, in batches of the training
    micro-batch; under auto, of the size adopted so far (it fits with gradients kept, so it fits
    without): never the whole batch that did not.

    Args:
        run: the run (its model; its task's ``eval_data``, ``loss_fn``, ``metric``, ``collate_fn``).
        stop: the run's signals: a signal ends the evaluation at the next batch, and the
            figures returned are then partial (the caller, who sees ``stop.signum``, drops them).
    """
    task, model = run.task, run.acc.model
    if task.eval_data is None:
        return None, None
    device = next(model.parameters()).device
    batch_size = run.acc.current_micro_batch_size or run.batch_size
    loader = torch.utils.data.DataLoader(task.eval_data, batch_size, collate_fn=task.collate_fn)
    fns = [task.loss_fn, *([task.metric] if task.metric is not None else [])]
    sums = [[0.0, 0.0] for _ in fns]  # each function's Σ sum, Σ count
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in loader:
            if stop is not None and stop.signum:
                break
            batch = map_tensors(lambda t: t.to(device), batch)
            for total, fn in zip(sums, fns, strict=True):
                value, count = as_sum_and_count(fn(model, batch), split.batch_size(batch))
                total[0], total[1] = total[0] + float(value), total[1] + float(count)
    model.train(was_training)
    metric = sums[1][0] / sums[1][1] if len(sums) > 1 and sums[1][1] else None
    return sums[0][0] / max(sums[0][1], 1e-30), metric

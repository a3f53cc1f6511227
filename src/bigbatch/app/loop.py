"""``fit(task, config)``: the training loop, readable top to bottom.

One iteration is one optimizer step on one effective batch: the engine cuts it into
micro-batches and steps once (``Accumulator.train_step``). Around it, in one place each:
the data (``_batches``: the order is a pure function of ``seed`` and the epoch, so a resumed
run finds its place by the step number alone), the log (``RunLog.step``, once per optimizer
step) and the snapshot (``_save``, at step boundaries only: a run killed mid-window redoes that
window from the same data and random state). The run folder is locked for the run's life
(Note [one writer] in ``app.folder``); SIGINT / SIGTERM stop it cleanly
(``StopSignals``, Note [clean stop]); a step with NaN or inf stops it before anything is written
(Note [non-finite runs]). Why a run stopped is one line each (NaN / inf, no memory left, a
signal), naming the step, what is kept on disk and what to do next; ``fit`` raises them, the CLI
prints them (Note [error boundary] in ``app.cli``). With ``local_steps > 1`` each rank takes local
steps and the ranks exchange once per round; snapshots, evaluation and signals wait for a round's
end (Note [local rounds]); with ``local_steps=1`` (the default) none of it runs and the trainer
takes the exact data-parallel step on a DDP model.

Note [non-finite runs]
    With ``nonfinite="raise"`` (the default) the engine refuses a window whose loss or gradient
    is NaN / inf before the optimizer steps, so the weights stay those of the last good step:
    the trainer stops with one line naming the step and the last good snapshot, writes no
    ``model.pt``, and ``--resume`` continues from that snapshot. With ``"skip"`` such windows
    are skipped (``skipped`` in ``metrics.csv``) and with ``"apply"`` they are applied, but a run
    whose last ``MAX_SKIPPED_IN_A_ROW`` steps were all skipped for non-finite values stops too
    (fp16 skips steps itself, as its loss scaler does, and is held to the same limit), and a
    snapshot or ``model.pt`` is never written from weights that are not finite.

Note [clean stop]
    The first SIGINT or SIGTERM does not interrupt the optimizer step in flight: the trainer
    finishes it, writes a snapshot, prints one line saying how to resume and exits with
    128 + the signal's number (130 for SIGINT, 143 for SIGTERM), the code a shell expects. A
    second SIGINT (a person at the keyboard) stops at once (``KeyboardInterrupt``), losing only
    the steps since the last snapshot. A second SIGTERM does not: it is a copy of the same request
    (``pkill``, SLURM, Kubernetes and systemd signal every process of a job, and torchrun forwards
    the signal it gets to each rank, so a rank often receives two), and whoever sends SIGTERM
    escalates with SIGKILL when it stops waiting. Under torchrun no signal stops a rank at once:
    a terminal's Ctrl-C reaches the launcher, which forwards it to the ranks and SIGKILLs those
    still running 30 s later. Nothing stops at once while a file of the run folder is being
    written (``StopSignals.writing``): a write torn by an exception would lose the snapshot the
    first signal asked for, so further signals wait for the write to end and the run then stops
    with that snapshot (a ``kill -9`` is always safe: Note [atomic snapshot] in
    ``app.folder``). A signal during the final evaluation stops it at the next batch; the
    training is complete and snapshotted, and ``--resume`` evaluates and writes ``model.pt``.
    Under torchrun the ranks agree after each step, with one small all-reduce, on whether any
    of them was signalled, so they all stop after the same step. Under ``--local-steps`` λ > 1
    they agree only at a round's end (the ranks hold the same model only there), so the run
    finishes the round in flight, up to λ - 1 more steps, before its snapshot (Note [local
    rounds]); that all-reduce also carries the round's own sums.

Note [local rounds]
    With λ > 1 the trainer keeps the PLAIN module on each rank (no DDP) and wraps its
    ``Accumulator`` in ``bigbatch.distributed.local.LocalAccumulation``: each rank takes λ exact
    optimizer steps on its own share of each global batch with no communication, then ONE
    all-reduce averages the ranks' updates normalised by λ and the outer rule (``outer_lr``,
    ``outer_momentum``, ``outer_nesterov``) applies them to the round's start θ_start
    (Note [accumulated gradient normalisation] in ``bigbatch.distributed.local``). Rounds are
    counted from the run's first step: one ends after every λ-th step and at the run's last step
    (a short last round, normalised by its own length), so at the end every rank holds the same
    model. Only between rounds do the ranks hold the same model, so:

    * the log (rank 0): a step's ``loss``, ``grad_norm``, ``count`` and ``tokens_per_s`` are
      rank 0's own share (a global figure every step would cost an all-reduce per step, the
      traffic λ > 1 exists to save); ``samples`` and ``samples_per_s`` count the whole global
      batch. At a round's last step ``round_loss``, ``round_count`` and ``round_skipped`` give
      the whole round over every rank: Σ loss sum / Σ count over the inner steps the ranks
      applied, the samples (or tokens) the round consumed, and the inner steps skipped (fp16
      overflow, ``--nonfinite skip``) on any rank, which ``summary.json`` adds up. A rank skips
      on its own (its own data, its own loss scaler), so these sums ride on the all-reduce the
      ranks make anyway at a round's end to agree on a stop signal.
    * snapshots, evaluation and the check for SIGINT / SIGTERM happen at round ends only; one
      that falls due inside a round (``--save-every``, ``--eval-every``, an epoch's end, a
      signal) is taken at that round's end, so a signal lets the round finish (up to λ - 1 more
      steps). The signal check is then one small all-reduce per round, not per step.
    * a snapshot holds the model (θ_start), ``LocalAccumulation.state_dict()`` (θ_start, the
      outer momentum) and, gathered from every rank, each rank's inner optimizer and engine
      state (they differ per rank; the file grows by one optimizer state per rank). A run
      killed mid-round resumes from the round's start with every rank's own optimizer, engine
      and random state and ends bitwise equal to an uninterrupted run on the CPU. It resumes
      only on the same number of ranks.
    * refused up front, before the run folder is touched: λ > 1 in one process (nothing to
      average), and a task whose model is already wrapped in DDP or sharded with FSDP (each
      rank must step a whole replica on its own).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shlex
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any

import torch

from bigbatch.app import config as cfg
from bigbatch.app import folder
from bigbatch.app.config import Task, TrainConfig, check_task, make_config
from bigbatch.app.report import METRICS_CSV, RunLog, Summary, print_summary, summarize
from bigbatch.core import _rng, split
from bigbatch.core._stepping import NonFiniteError
from bigbatch.core._sync import wrapper_kind
from bigbatch.core._tree import map_tensors
from bigbatch.core._units import format_bytes
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.cut import Cut
from bigbatch.core.engine import Accumulator, StepResult
from bigbatch.core.head import with_chunked_head
from bigbatch.core.loss import as_sum_and_count
from bigbatch.core.oom import MemoryBudgetExceeded, is_out_of_memory
from bigbatch.core.peak import PeakProbe
from bigbatch.distributed import launch as distributed
from bigbatch.distributed.local import LocalAccumulation

MAX_SKIPPED_IN_A_ROW = 20
_MODEL_KEPT = (
    "model.pt was not written; the last snapshot holds the trained model: free space "
    "and run again with --resume"
)
_NOTHING_TO_RESUME = (
    "--resume: run folder {out!r} holds no run to resume: drop --resume to start "
    "a new run there, or give --resume auto (start when there is none)."
)


@dataclass(frozen=True)
class _Run:
    """What stays fixed during a run (a record, built once by ``fit``)."""

    task: Task
    config: TrainConfig
    ranks: distributed.Ranks
    folder: folder.RunFolder
    acc: Accumulator
    local: LocalAccumulation | None  # local_steps > 1 (Note [local rounds]); else DDP steps
    stop: StopSignals
    identity: dict[str, Any]
    batch_size: int
    steps_per_epoch: int
    total_steps: int


@dataclass
class _Progress:
    """What changes: steps done, training time, the last snapshot, non-finite steps in a row,
    the round in flight (Note [local rounds])."""

    step: int = 0
    elapsed_s: float = 0.0
    snapshot_step: int | None = None
    skipped_in_a_row: int = 0
    tally: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss sum, count, skipped


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
        raise folder.RunMismatchError(_NOTHING_TO_RESUME.format(out=config.out))
    joined = not distributed.in_group()  # fit leaves at the end only a group it joined itself
    ranks = distributed.setup(config.device)
    check_local_steps(config, ranks, task.model)
    run = _prepare(task, config, ranks)  # in memory: refused before mkdir
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


def _train(run: _Run, progress: _Progress, log: RunLog | None) -> None:
    """The steps from ``progress.step + 1`` to the last; a snapshot when one is due or asked."""
    batches = _batches(run, progress.step)
    for step in range(progress.step + 1, run.total_steps + 1):
        samples, batch = next(batches)
        row = _step(run, progress, step, samples, batch)
        ended = round_end(step, run.config.local_steps, run.total_steps)
        if ended:  # the ranks agree on a stop (and sum the round: Note [local rounds])
            signum, summed = run.stop.requested(progress.tally if run.local else ())
            progress.tally = [0.0, 0.0, 0.0]  # the next round starts from zero
            row.update(columns(summed) if run.local else {})
        # evaluate at multiples of eval_every (under local rounds: at the end of the round)
        if crossed(step, ended, run.config.eval_every) and run.task.eval_data is not None:
            eval_loss, metric = evaluate(run)
            row.update(eval_loss=eval_loss, metric="" if metric is None else metric)
        log.step(row) if log else None
        if not ended:  # mid-round: the ranks hold different models (Note [local rounds])
            continue
        # a snapshot is due at a multiple of save_every, an epoch's end or the run's last step
        # (under local rounds: one among the ``ended`` steps of the round just ended)
        saves = (run.config.save_every, run.steps_per_epoch)
        if signum or step == run.total_steps or any(crossed(step, ended, n) for n in saves):
            _save(run, progress)
        if signum:
            raise stopped(signum, progress.step, run.total_steps, run.folder.out)


def _finish(run: _Run, progress: _Progress) -> Summary:
    """The final evaluation (a signal stops it: Note [clean stop]), ``model.pt`` and the
    summary."""
    final = evaluate(run, run.stop)
    signum = run.stop.requested()[0]  # also: every rank waits here for rank 0's metrics.csv
    if signum:
        raise stopped(signum, progress.step, run.total_steps, run.folder.out, final=True)
    with run.stop.writing():  # the ranks agreed above: metrics.csv is whole for all
        if run.ranks.is_main:
            _check_finite(run, progress, "model.pt")
            model = distributed.unwrap(run.acc.model).state_dict()
            folder.replace_file(run.folder.path("model.pt"), model, _MODEL_KEPT)
        return summarize(
            run.folder.out, progress.elapsed_s, run.batch_size, final, run.ranks.is_main
        )


def _step(run: _Run, progress: _Progress, step: int, samples: int, batch: Any) -> dict[str, Any]:
    """One optimizer step and its row of ``metrics.csv``."""
    batch = map_tensors(lambda t: t.to(run.ranks.device), batch)
    probe = PeakProbe(run.ranks.device)
    record, started = probe.reset(), time.perf_counter()
    try:
        last = step == run.total_steps
        result, round_row = train_step(run.local, run.acc, batch, run.task, last)
    except NonFiniteError as exc:
        raise NonFiniteRun(f"step {step}: {exc} {_last_good(run, progress)}") from None
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfMemoryRun(out_of_memory_line(run.config, step, exc)) from exc
    seconds = time.perf_counter() - started
    progress.step, progress.elapsed_s = step, progress.elapsed_s + seconds
    # the round's sums (Note [local rounds]); a skipped step's loss may be NaN: counted as skipped
    applied = [0.0, 0.0, 1.0] if result.skipped else [result.loss * result.count, result.count, 0.0]
    progress.tally = [total + value for total, value in zip(progress.tally, applied, strict=True)]
    progress.skipped_in_a_row = progress.skipped_in_a_row + 1 if result.nonfinite else 0
    if progress.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise NonFiniteRun(
            f"step {step}: the last {MAX_SKIPPED_IN_A_ROW} steps all had NaN "
            f"/ inf values (skipped or applied). {_last_good(run, progress)}"
        )
    counted = samples if run.local is None else split.batch_size(batch)  # what result.count saw
    return {**_row(run, step, result, seconds, probe.finish(record), samples, counted), **round_row}


def _prepare(task: Task, config: TrainConfig, ranks: distributed.Ranks) -> _Run:
    batch_size = cfg.trained_batch(config, len(task.train_data), ranks.is_main)
    steps_per_epoch, total_steps = cfg.run_length(config, len(task.train_data))
    if total_steps >= steps_per_epoch:  # the run reaches the epoch's last (smaller) batch
        distributed.check_batch_sizes(len(task.train_data), batch_size, ranks.world_size)
    model = cfg.prepare_model(task.model, config, ranks)
    if config.chunked_head:  # Note [deferred head] in bigbatch.core.head
        task = replace(task, loss_fn=with_chunked_head(task.loss_fn, model))
    lr = cfg.checked_lr(config, batch_size, model)
    optimizer = (task.optimizer or torch.optim.AdamW)(model.parameters(), lr=lr)
    schedule = task.scheduler or functools.partial(cfg.schedule, config)
    cut = Cut(
        cfg.resolve_batch(config)[1],
        config.micro_batch_tokens,
        config.pad_to_multiple_of,
        task.lengths,
        task.pad_values,
        config.trim_padding,
        config.memory_budget,
    )
    scheduler = schedule(optimizer, total_steps)
    acc = Accumulator(
        model,
        optimizer,
        cut,
        scheduler,
        config.max_grad_norm,
        config.precision,
        nonfinite=config.nonfinite,
    )
    local = (
        None
        if config.local_steps == 1
        else LocalAccumulation.from_accumulator(  # collective
            acc,
            config.local_steps,
            outer_lr=config.outer_lr,
            outer_momentum=config.outer_momentum,
            nesterov=config.outer_nesterov,
        )
    )
    identity = cfg.identity(task, config, optimizer)
    return _Run(
        task,
        config,
        ranks,
        folder.RunFolder(config.out, ranks),
        acc,
        local,
        StopSignals(ranks.device),
        identity,
        batch_size,
        steps_per_epoch,
        total_steps,
    )


def _start(run: _Run) -> _Progress:
    """Restore the newest snapshot when resuming; seed everything when starting."""
    config, out = run.config, run.folder.out
    if run.ranks.is_main:
        folder.clean_stale_temps(out)  # the lock holder alone (Note [one writer])
    path = folder.latest_path(out)
    snapshot = None if path is None else folder.read_snapshot(path)
    if snapshot is not None and not config.resume:
        raise folder.RunMismatchError(
            f"run folder {config.out!r} already holds a run (step "
            f"{snapshot.step} of {snapshot.total_steps}): add --resume "
            "to continue it, or choose another --out."
        )
    if path is None or snapshot is None:  # a run killed before its first snapshot starts again
        if config.resume is True and not os.path.exists(run.folder.path(METRICS_CSV)):
            raise folder.RunMismatchError(_NOTHING_TO_RESUME.format(out=config.out))
        if config.resume is True:
            warnings.warn(
                f"--resume: the run in {config.out!r} was stopped before its first "
                "snapshot: it starts again from step 0.",
                BigBatchWarning,
                stacklevel=3,
            )
        _rng.seed_all(config.seed)
        return _Progress()
    _restore(run, snapshot, path)
    if run.ranks.is_main:  # not the bar nor the table: said under --quiet too
        print(f"resuming from step {snapshot.step} of {run.total_steps} ({path})", flush=True)
    return _Progress(step=snapshot.step, elapsed_s=snapshot.elapsed_s, snapshot_step=snapshot.step)


def _restore(run: _Run, snapshot: folder.Snapshot, path: str) -> None:
    """Every part of the run from ``snapshot``; a field that does not fit is named
    (Note [snapshot fields] in ``app.folder``)."""
    folder.check_same_run(snapshot.identity, run.identity, run.config.out)
    if snapshot.total_steps != run.total_steps:
        raise folder.crafted(
            path,
            "total_steps",
            f"is {snapshot.total_steps}, and this run takes {run.total_steps} steps",
        )
    acc, (optimizer, engine) = run.acc, (snapshot.optimizer, snapshot.engine)
    if snapshot.local is not None and run.local is not None:  # Note [local rounds]
        with folder.restoring(path, "local"):
            optimizer, engine = this_rank(snapshot.local, run.ranks)  # each rank its own
            run.local.load_state_dict(snapshot.local["outer"])
    loads: list[tuple[str, Callable[[Any], Any], Any]] = [
        ("model", distributed.unwrap(acc.model).load_state_dict, snapshot.model),
        ("optimizer", acc.optimizer.load_state_dict, optimizer),
        ("scheduler", functools.partial(_load_scheduler, acc.scheduler), snapshot.scheduler),
        ("engine", acc.load_state_dict, engine),
        ("rng", functools.partial(folder.restore_rng, ranks=run.ranks), snapshot.rng),
    ]
    for name, load, state in loads:
        with folder.restoring(path, name):
            load(state)
    changes = snapshot.environment_changes()
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


# ---------------------------------------------------------------------------- local rounds
_WRAPPED = {"ddp": "wrapped in DistributedDataParallel", "fsdp": "sharded with FSDP"}


def check_local_steps(config: TrainConfig, ranks: distributed.Ranks, model: Any) -> None:
    """Refuse ``local_steps > 1`` where it has no meaning (Note [local rounds]).

    Raises:
        ValueError: one process.
        TypeError: the task's model is already wrapped in DDP or sharded with FSDP.
    """
    steps = config.local_steps
    if steps > 1 and ranks.world_size == 1:
        raise ValueError(
            f"--local-steps {steps} needs several ranks and this is one process: "
            "there is nothing to average. Launch with `torchrun --nproc_per_node N "
            "-m bigbatch train ...`, or drop --local-steps."
        )
    kind = wrapper_kind(model) if steps > 1 else "plain"
    if kind != "plain":
        fsdp = " FSDP cannot take local steps: every forward all-gathers." if kind == "fsdp" else ""
        raise TypeError(
            f"--local-steps {steps} steps a whole plain replica of the model on each "
            f"rank, and the task's model is {_WRAPPED[kind]}: return the plain module "
            f"from the task, or use --local-steps 1.{fsdp}"
        )


def train_step(
    local: LocalAccumulation | None, acc: Accumulator, batch: split.Batch, task: Task, last: bool
) -> tuple[StepResult, dict[str, Any]]:
    """The exact data-parallel step (``local`` is ``None``), or one local step of this rank:
    the outer step after every λ-th, and after the run's ``last`` step. Returns the step's
    result and, at a round's end, ``round_count``."""
    if local is None:
        return acc.train_step(batch, task.loss_fn, count_fn=task.count_fn), {}
    result = local.train_step(batch, task.loss_fn, count_fn=task.count_fn)
    # a short last round: every rank ends with the same model
    outer = result.outer or (local.outer_step() if last else None)
    return result.step, {} if outer is None else {"round_count": outer.count}


def columns(summed: list[float]) -> dict[str, Any]:
    """``round_loss`` and ``round_skipped`` from the ``tally`` sums summed over the ranks."""
    loss_sum, count, skipped = summed
    return {"round_loss": loss_sum / count if count else math.nan, "round_skipped": int(skipped)}


def round_end(step: int, local_steps: int, total_steps: int) -> int:
    """The steps of the round that ``step`` ends, or 0 when it ends none (1 when λ = 1).

    Example:
        >>> [round_end(s, 4, 10) for s in range(1, 11)]
        [0, 0, 0, 4, 0, 0, 0, 4, 0, 2]
    """
    left = step % local_steps
    return local_steps if left == 0 else left if step == total_steps else 0


def crossed(step: int, steps: int, every: int) -> bool:
    """Whether a multiple of ``every`` (0: never) is among the ``steps`` steps ending at ``step``.

    Example:
        >>> crossed(8, 4, 3), crossed(4, 4, 5), crossed(6, 1, 3)
        (True, False, True)
    """
    return bool(every) and step // every > (step - steps) // every


def capture(local: LocalAccumulation, acc: Accumulator, is_main: bool) -> dict[str, Any] | None:
    """The snapshot's part of the local rounds, on rank 0 (``None`` elsewhere). A collective.

    Every rank's inner optimizer and engine state are gathered (they differ per rank).
    """
    inner = distributed.all_gather_object((acc.optimizer.state_dict(), acc.state_dict()))
    if not is_main:
        return None
    # rank 0's own live tensors (not the gathered copy): torch.save stores tensors shared with
    # the snapshot's ``optimizer`` field once
    inner[0] = (acc.optimizer.state_dict(), acc.state_dict())
    optimizers, engines = zip(*inner, strict=True)
    return {"outer": local.state_dict(), "optimizers": list(optimizers), "engines": list(engines)}


def this_rank(saved: dict[str, Any], ranks: distributed.Ranks) -> tuple[dict, dict]:
    """This rank's inner optimizer and engine state from ``capture``'s record.

    Raises:
        RunMismatchError: the snapshot was written by another number of ranks.
    """
    n = len(saved["optimizers"])
    if n != ranks.world_size:
        raise folder.RunMismatchError(
            f"the snapshot was written by {n} ranks under --local-steps, "
            f"each with its own optimizer state: resume on {n} ranks "
            f"(torchrun --nproc_per_node {n}), not {ranks.world_size}."
        )
    return saved["optimizers"][ranks.rank], saved["engines"][ranks.rank]


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
    run: _Run, step: int, r: StepResult, seconds: float, peak: Any, samples: int, counted: int
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
        "micro_batch_size": r.micro_batch_size,
        "micro_batch_tokens": r.micro_batch_size if run.config.micro_batch_tokens else "",
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
    }


def _save(run: _Run, progress: _Progress) -> None:
    acc, is_main = run.acc, run.ranks.is_main
    rng = distributed.all_gather_object(_rng.capture_all())  # each rank's own
    local = capture(run.local, acc, is_main) if run.local is not None else None
    if not is_main:
        return
    _check_finite(run, progress, "a snapshot")
    snapshot = folder.Snapshot(
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
        folder.write_snapshot(run.folder.out, snapshot, keep, progress.snapshot_step)
    progress.snapshot_step = progress.step
    if run.stop.again:  # a second signal came during the write (Note [clean stop])
        raise stopped(run.stop.signum, progress.step, run.total_steps, run.folder.out)


def _check_finite(run: _Run, progress: _Progress, what: str) -> None:
    params = distributed.unwrap(run.acc.model).parameters()
    if not all(bool(torch.isfinite(p).all()) for p in params if p.is_floating_point()):
        raise NonFiniteRun(
            f"step {progress.step}: the weights hold NaN / inf (nonfinite="
            f"{run.config.nonfinite!r}); {what} was not written. "
            f"{_last_good(run, progress)}"
        )


def _last_good(run: _Run, progress: _Progress) -> str:
    """Where a run stopped on NaN / inf continues from, and how."""
    path, step = folder.latest_path(run.folder.out), progress.snapshot_step
    if path is None:
        return "No snapshot was written yet: fix the cause and start again."
    last = f" (step {step})" if step is not None else ""
    return (
        f"The last good snapshot is {path}{last}: fix the cause (data, learning rate, "
        "clipping) and run again with --resume, or pass --nonfinite skip."
    )


# ---------------------------------------------------------------------------- evaluation
def evaluate(run: _Run, stop: StopSignals | None = None) -> tuple[float | None, float | None]:
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


# ---------------------------------------------------------------------------- how a run stops
class Stopped(Exception):
    """The run stopped on a signal after writing a snapshot; ``exit_code`` is 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """While the ``with`` block runs, the first SIGINT / SIGTERM is noted, not raised (Note above).

    Attributes:
        signum: the first signal received (0: none).
        again: a second signal arrived while a file was being written (``writing``).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")  # where the ranks' agreement runs (NCCL: cuda)
        self.signum, self.again, self._writing = 0, False, False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum
        elif signum != signal.SIGINT or distributed.in_group():  # a copy of the first signal
            return  # (Note [clean stop]): pkill, SLURM, torchrun forwarding it
        elif self._writing:
            self.again = True  # the write ends first (Note [clean stop])
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A file write that no signal interrupts: a second signal during it is kept for after."""
        self._writing = True
        try:
            yield
        finally:
            self._writing = False

    def requested(self, sums: Sequence[float] = ()) -> tuple[int, list[float]]:
        """The signal to stop on (0: none), the same on every rank, and ``sums`` summed over the
        ranks, in the same all-reduce (one per agreement)."""
        if not distributed.in_group():
            return self.signum, [float(s) for s in sums]
        flags = [float(self.signum == signal.SIGINT), float(self.signum == signal.SIGTERM)]
        agreed = torch.tensor([*flags, *sums], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(agreed)
        interrupted, terminated, *summed = agreed.tolist()
        return int(signal.SIGTERM if terminated else signal.SIGINT if interrupted else 0), summed


class NonFiniteRun(FloatingPointError):
    """The run stopped on NaN / inf values (Note [non-finite runs] in ``app.loop``)."""


class OutOfMemoryRun(MemoryError):
    """A step ran out of memory or over ``memory_budget``; the message names what to change."""


def out_of_memory_line(config: TrainConfig, step: int, exc: BaseException) -> str:
    """What ran out and which settings help, in the words of the flags (and the TOML keys)."""
    over = config.memory_budget is not None
    if isinstance(exc, MemoryBudgetExceeded) and exc.used_bytes is not None:
        cause = (
            f"micro-batch {exc.micro_batch_size} used {format_bytes(exc.used_bytes)}, over "
            f"--memory-budget {format_bytes(exc.budget_bytes or 0)}"
        )
    elif config.micro_batch_size == "auto" and isinstance(exc, MemoryError):  # auto's floor
        return (
            f"step {step}: out of memory{' or over --memory-budget' if over else ''} with "
            "--micro-batch-size auto down to 1: a single sample does not fit. "
            f"{'Use a larger --memory-budget, add' if over else 'Add'} "
            "--gradient-checkpointing, free memory, or use a smaller model or sequence length."
        )
    else:
        cause = f"out of memory at micro-batch {cfg.resolve_batch(config)[1]} ({exc})"
    return (
        f"step {step}: {cause}. Use --micro-batch-size auto (the largest that fits), a "
        "smaller --micro-batch-size, --gradient-checkpointing, or a larger --memory-budget."
    )


def stopped(signum: int, step: int, total_steps: int, out: str, final: bool = False) -> Stopped:
    """The error for a run stopped by a signal after ``step`` (Note [clean stop]), or
    during the ``final`` evaluation: what is on disk and the command that continues."""
    args = sys.argv[1:]
    command = "the same call with resume=True"
    if args[:1] == ["train"]:  # the command line: say the command to type, quoted for a shell
        command = shlex.join(["bigbatch", *args, *([] if "--resume" in args else ["--resume"])])
    name, path = signal.Signals(signum).name, folder.latest_path(out)
    where = f"after step {step} of {total_steps}"
    if final:
        return Stopped(
            f"stopped by {name} during the final evaluation, {where}: the training is "
            f"complete, in {path}; model.pt and summary.json were not written. "
            f"Evaluate and write them with: {command}",
            signum,
        )
    return Stopped(
        f"stopped by {name} {where}; snapshot written to {path}. Resume with: {command}", signum
    )

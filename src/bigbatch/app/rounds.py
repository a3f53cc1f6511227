"""The local rounds: ``--local-steps`` λ > 1, each rank's own steps between two exchanges.

Refused where it has no meaning (``check_local_steps``), the ``Accumulator`` wrapped for it
(``local_rounds``), one step in the loop (``train_step``: Note [local rounds]), where a round
ends and what falls due in it (``round_end``, ``crossed``), the round's sums in the log
(``columns``) and the snapshot's per-rank part (``capture``, ``this_rank``). With
``local_steps=1`` (the default) none of it runs: the trainer takes the exact data-parallel step
on a DDP model.
"""

from __future__ import annotations

import math
from typing import Any

from bigbatch.app.settings import TrainConfig
from bigbatch.app.snapshot import RunMismatchError
from bigbatch.app.task import Task
from bigbatch.core import split
from bigbatch.core._sync import wrapper_kind
from bigbatch.core.engine import Accumulator, StepResult
from bigbatch.distributed import launch as distributed
from bigbatch.distributed.local import LocalAccumulation

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


def local_rounds(acc: Accumulator, config: TrainConfig) -> LocalAccumulation | None:
    """``acc`` wrapped for local rounds when ``local_steps > 1`` (a collective: every rank
    builds it), else ``None``: the exact data-parallel step."""
    if config.local_steps == 1:
        return None
    return LocalAccumulation.from_accumulator(
        acc,
        config.local_steps,
        outer_lr=config.outer_lr,
        outer_momentum=config.outer_momentum,
        nesterov=config.outer_nesterov,
    )


def train_step(
    local: LocalAccumulation | None, acc: Accumulator, batch: split.Batch, task: Task, last: bool
) -> tuple[StepResult, dict[str, Any]]:
    """The exact data-parallel step (``local`` is ``None``), or one local step of this rank:
    the outer step after every λ-th, and after the run's ``last`` step. Returns the step's
    result and, at a round's end, ``round_count``.

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
        raise RunMismatchError(
            f"the snapshot was written by {n} ranks under --local-steps, "
            f"each with its own optimizer state: resume on {n} ranks "
            f"(torchrun --nproc_per_node {n}), not {ranks.world_size}."
        )
    return saved["optimizers"][ranks.rank], saved["engines"][ranks.rank]

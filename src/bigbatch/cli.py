"""The ``bigbatch`` command line: parse, build the settings, call the library.

Each subcommand is registered by one ``_add_<name>(subparsers)`` function that sets ``run``;
``main`` turns the errors users can fix into one clear line (exit 2) instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from bigbatch.train.task import TaskError

USER_ERRORS: tuple[type[BaseException], ...] = (TaskError, ValueError, TypeError, FileNotFoundError)


def build_parser() -> argparse.ArgumentParser:
    """The full ``bigbatch`` argument parser (also used to render ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="bigbatch",
        description="Train with the batch size you want on the memory you have: exact gradient "
        "accumulation for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bigbatch`` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except USER_ERRORS as exc:
        print(f"bigbatch {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo", help="train a small model with the full batch and accumulated, and compare"
    )
    demo.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from bigbatch.demo import run_demo

    return 0 if run_demo() < 1e-10 else 1


def _add_check(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser(
        "check", help="is accumulation exact for a task's model and loss? (exit 0 exact, 1 not)"
    )
    check.add_argument("task", metavar="TASK", help="module:function returning a bigbatch.Task")
    check.add_argument("--batch-size", type=int, default=16, help="samples in the batch compared")
    check.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="samples per micro-batch (default: a third)",
    )
    check.set_defaults(run=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from bigbatch.check import run_check_command

    return run_check_command(args.task, args.batch_size, args.micro_batch_size)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="measure micro-batch sizes and checkpointing, choose the fastest that fits in memory",
        description="Run real optimizer steps of one effective batch of TASK (a deep copy of its "
        "model and optimizer) at several micro-batch sizes, with 0%%, 50%% and 100%% of the "
        "model's repeated blocks checkpointed. For each: the peak memory of a step (CUDA "
        "allocator, or the CPU's resident-set high-water mark; model, gradients, optimizer state "
        "and activations), the median time per optimizer step and samples/s. Memory is fitted "
        "as peak = a + b x micro-batch to predict sizes not run. Prints the table, then the "
        "fastest configuration whose peak fits the budget and why.",
    )
    plan.add_argument("task", metavar="TASK", help="module:function returning a bigbatch.Task")
    plan.add_argument(
        "--batch-size", type=int, required=True, help="effective batch (samples per step)"
    )
    plan.add_argument(
        "--memory-budget",
        default=None,
        help="memory a step may use, e.g. 6GiB (default: the GPU's memory, or the CPU's available memory)",
    )
    plan.add_argument(
        "--micro-batch-sizes",
        type=_int_list,
        default=None,
        help="comma-separated sizes to try, e.g. 1,2,4 (default: powers of two up to the batch)",
    )
    plan.add_argument(
        "--checkpointing",
        type=_float_list,
        default=None,
        help="comma-separated fractions of the blocks to checkpoint (default: 0,0.5,1)",
    )
    plan.add_argument("--steps", type=int, default=3, help="timed steps per configuration (median)")
    plan.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from bigbatch.memory.oom import MemoryBudgetExceeded
    from bigbatch.memory.planner import plan, print_plan
    from bigbatch.train.task import load_task

    task = load_task(args.task)
    loader = torch.utils.data.DataLoader(
        task.train_data, batch_size=args.batch_size, shuffle=False, collate_fn=task.collate_fn
    )
    batch = next(iter(loader))
    factory = task.optimizer
    optimizer = (lambda params: factory(params, 1e-3)) if factory is not None else None
    try:
        result = plan(
            task.model,
            batch,
            task.loss_fn,
            memory_budget=args.memory_budget,
            micro_batch_sizes=args.micro_batch_sizes,
            checkpointing=args.checkpointing,
            optimizer=optimizer,
            steps=args.steps,
        )
    except MemoryBudgetExceeded as exc:
        print(f"bigbatch plan: error: {exc}", file=sys.stderr)
        return 2
    print_plan(result)
    return 0


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _float_list(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_demo,
    _add_check,
    _add_plan,
]


if __name__ == "__main__":
    sys.exit(main())

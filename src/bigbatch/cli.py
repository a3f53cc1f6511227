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
        "--micro-batch-size", type=int, default=None, help="samples per micro-batch (default: a third)"
    )
    check.set_defaults(run=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from bigbatch.check import run_check_command

    return run_check_command(args.task, args.batch_size, args.micro_batch_size)


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_demo, _add_check]


if __name__ == "__main__":
    sys.exit(main())

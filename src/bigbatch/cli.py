"""The ``bigbatch`` command line: parse, build the settings, call the library."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bigbatch`` command."""
    parser = argparse.ArgumentParser(
        prog="bigbatch",
        description="Train with the batch size you want on the memory you have: exact gradient "
        "accumulation for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="train a small model with the full batch and accumulated, and compare")
    demo.set_defaults(run=lambda args: _demo())
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.run(args) or 0)


def _demo() -> int:
    from bigbatch.demo import run_demo

    return 0 if run_demo() < 1e-10 else 1


if __name__ == "__main__":
    sys.exit(main())

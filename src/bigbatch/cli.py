"""The ``bigbatch`` command line: parse, build the settings, call the library.

Each subcommand is registered by one ``_add_<name>(subparsers)`` function that sets ``run``;
``main`` turns the errors users can fix into one clear line (exit 2) instead of a traceback.
"""

from __future__ import annotations

import argparse
import os
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


def run() -> None:
    """The ``bigbatch`` console script: ``main``, then exit (Note [gloo exit] after torchrun)."""
    from bigbatch import distributed

    distributed.exit_process(main())


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


_DEMO_DESCRIPTION = """\
Train one model three ways on the CPU and show that they give the same result on less
memory.

The data are scikit-learn's 1,797 bundled 8x8 digit images (no download; 1,400 to train, 397
held out). A wide MLP (64 -> 8192 -> 10, float64) is trained from the same initial weights on
the same batches of --batch-size images with AdamW:

  full batch    a plain PyTorch loop: the whole batch in one forward/backward per step
  accumulated   bigbatch.Accumulator(micro_batch_size=--micro-batch-size)
  auto          Accumulator(micro_batch_size="auto", memory_budget=half the full batch's peak)

The table gives each run's micro-batch, peak memory per step (the process's resident-set
high-water mark, measured), time, samples/s, test accuracy and the largest relative weight
difference from the full batch (float64 rounding: ~1e-15). The plot (--out) overlays the
loss curves and draws the peaks. Exit 0 when the weights agree and auto kept to its budget.
"""


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="train one model full-batch, accumulated and auto under a budget: same weights, less memory",
        description=_DEMO_DESCRIPTION,
        epilog="example:\n  bigbatch demo --steps 20 --out runs/demo.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    demo.add_argument(
        "--batch-size", type=int, default=512, help="samples per optimizer step (default 512)"
    )
    demo.add_argument(
        "--micro-batch-size",
        type=int,
        default=64,
        help="the accumulated run's micro-batch (default 64)",
    )
    demo.add_argument(
        "--out",
        metavar="FILE.png",
        default="bigbatch-demo.png",
        help="where to write the plot (default bigbatch-demo.png)",
    )
    demo.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from bigbatch.demo import run_demo

    try:
        import sklearn.datasets  # noqa: F401  (the demo's data; imported here to say what to install)
    except ImportError as exc:
        print(
            f"bigbatch demo: error: the demo's data come with scikit-learn ({exc}): run "
            'pip install scikit-learn (or pip install -e ".[demo]" in a clone).',
            file=sys.stderr,
        )
        return 2
    result = run_demo(args.steps, args.batch_size, args.micro_batch_size, args.out)
    return 0 if result.exact() else 1


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


_TRAIN_EPILOG = """\
examples:
  bigbatch train my_project/tasks.py:mnist --batch-size 1024 --micro-batch-size 64 --epochs 3
  bigbatch train my_project.tasks:lm --batch-size 256 --micro-batch-size auto --memory-budget 6GiB
  bigbatch train my_project.tasks:lm --config run.toml --lr 3e-4        # flags override the file
  bigbatch train my_project.tasks:lm --config run.toml --resume         # continue after a crash

TASK is module:function (or file.py:function) returning bigbatch.Task(model=..., train_data=...,
loss_fn=...). Batch sizes: any two of --batch-size, --micro-batch-size and
--gradient-accumulation-steps determine the third (batch = micro-batch x steps); the optimizer
step is the exact big-batch step however the batch is cut. --lr is the rate at
--reference-batch-size; --lr-scaling linear uses lr x batch/reference, sqrt uses
lr x sqrt(batch/reference). A TOML --config holds the same names with _ for - (batch_size = 256).
The run folder (--out) gets metrics.csv (one row per optimizer step), snapshot.pt (resume state,
written atomically), model.pt (final state dict) and summary.json; `bigbatch report DIR` plots it.
"""


def _add_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train",
        help="train a task with exact gradient accumulation (progress bar, CSV, resume, report)",
        description="Train TASK's model on its data: one exact optimizer step per effective batch, "
        "cut into micro-batches that fit in memory.",
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    opt = argparse.SUPPRESS  # only the flags given override the --config file
    train.add_argument(
        "task",
        metavar="TASK",
        nargs="?",
        default=opt,
        help="module:function returning a bigbatch.Task (or `task` in --config)",
    )
    train.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="TOML file of settings (keys = these flags' names with _ for -)",
    )
    train.add_argument(
        "--batch-size",
        type=int,
        default=opt,
        help="effective batch: samples per optimizer step (default 32)",
    )
    train.add_argument(
        "--micro-batch-size",
        type=_int_or_auto,
        default=opt,
        help="samples per forward/backward, or auto: the largest that fits",
    )
    train.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=opt,
        help="micro-batches per optimizer step",
    )
    _add_step_flags(train, opt)
    train.add_argument(
        "--lr",
        type=float,
        default=opt,
        help="learning rate at --reference-batch-size (default 1e-3)",
    )
    train.add_argument(
        "--lr-scaling",
        choices=("none", "linear", "sqrt"),
        default=opt,
        help="scale --lr with batch/reference (default none)",
    )
    train.add_argument(
        "--reference-batch-size", type=int, default=opt, help="the batch size --lr was tuned for"
    )
    train.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine"),
        default=opt,
        help="after warm-up: constant (default) or cosine to 0",
    )
    train.add_argument(
        "--warmup-steps", type=int, default=opt, help="steps of linear warm-up (default 0)"
    )
    train.add_argument("--steps", type=int, default=opt, help="optimizer steps to run")
    train.add_argument(
        "--epochs",
        type=int,
        default=opt,
        help="passes over the data (default 1 when --steps is not given)",
    )
    train.add_argument(
        "--memory-budget",
        default=opt,
        help="cap on memory a step may use, e.g. 6GiB (with --micro-batch-size auto)",
    )
    train.add_argument(
        "--seed",
        type=int,
        default=opt,
        help="seeds the model, dropout and the data order (default 0)",
    )
    train.add_argument(
        "--out", metavar="DIR", default=opt, help="run folder (default runs/bigbatch)"
    )
    train.add_argument(
        "--save-every",
        type=int,
        default=opt,
        help="resume snapshot every N steps (default: each epoch's end)",
    )
    train.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=opt,
        help="continue the run in --out from its snapshot",
    )
    train.add_argument(
        "--eval-every", type=int, default=opt, help="evaluate every N steps (default: at the end)"
    )
    train.add_argument(
        "--device", choices=("cpu", "cuda"), default=opt, help="default: cuda when available"
    )
    train.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=opt,
        help="reshuffle every epoch (default on)",
    )
    train.add_argument(
        "--quiet",
        action=argparse.BooleanOptionalAction,
        default=opt,
        help="no progress bar and no table",
    )
    train.set_defaults(run=_run_train)


def _add_step_flags(train: argparse.ArgumentParser, opt: str) -> None:
    """How one optimizer step computes: checkpointing, precision, BatchNorm, clipping."""
    train.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=opt,
        help="recompute the model's repeated blocks in backward (less memory, ~1 more forward)",
    )
    train.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default=opt,
        help="fp32 (default), bf16 or fp16 autocast",
    )
    train.add_argument(
        "--batchnorm",
        choices=("keep", "micro", "freeze", "groupnorm"),
        default=opt,
        help="BatchNorm under accumulation: a micro-batch's statistics are not the full "
        "batch's. keep (default): leave the model, warn; micro: per-micro-batch statistics, "
        "running stats moved once per step; freeze: use the running stats (exact, for "
        "fine-tuning); groupnorm: swap in GroupNorm (exact)",
    )
    train.add_argument(
        "--max-grad-norm",
        type=float,
        default=opt,
        help="clip the gradient's 2-norm (default: no clipping)",
    )


def _run_train(args: argparse.Namespace) -> int:
    import torch

    from bigbatch.train.config import field_names, load_toml, make_config
    from bigbatch.train.loop import fit
    from bigbatch.train.task import load_task

    settings = load_toml(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if k in field_names()}
    config = make_config(settings, **flags)
    if not config.task:
        raise ValueError(
            'no task: give TASK (module:function) or `task = "module:function"` in --config.'
        )
    torch.manual_seed(config.seed)  # the task function builds the model: same seed, same weights
    fit(load_task(config.task), config)
    return 0


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or auto") from None


def _add_report(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser(
        "report",
        help="summarise a run folder and plot its loss and memory over steps (PNG)",
        description="Print the summary of a finished `bigbatch train` run and draw DIR/report.png: "
        "the loss per optimizer step and the peak memory per step.",
        epilog="example:\n  bigbatch report runs/bigbatch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("out", metavar="DIR", help="the --out folder of a `bigbatch train` run")
    report.add_argument(
        "--png", default=None, help="where to write the plot (default DIR/report.png)"
    )
    report.set_defaults(run=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from bigbatch.train.report import load_summary, plot_run, print_summary

    if not os.path.isdir(args.out):
        raise FileNotFoundError(
            f"run folder {args.out!r} does not exist: give the --out folder of a run."
        )
    path = plot_run(args.out, args.png)
    print_summary(load_summary(args.out), title="bigbatch report")
    print(f"plot: {path}")
    return 0


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_demo,
    _add_train,
    _add_report,
    _add_check,
    _add_plan,
]


if __name__ == "__main__":
    sys.exit(main())

"""The ``bigbatch`` command line: parse, build the settings, call the library, print.

Each subcommand is registered by one ``_add_<name>(subparsers)`` function that sets ``run``.
``bigbatch train``'s flags are made from the fields of ``TrainConfig`` (one list of settings).
``main`` is the one error boundary (Note [error boundary]).

Note [error boundary]
    Every error a user can cause ends in one line on stderr and exit code 2, never a traceback:
    a bad flag or setting, a task that cannot be used, a run folder that is locked, read-only or
    full, a step with NaN, no memory left. An error raised by bigbatch's own checks prints its
    message (it names the setting and what is allowed); one raised inside the user's code (the
    task function, the loss, the model) prints the user's frame instead: ``file:line in
    function``, the exception, and the line of code, since bigbatch's internals would not help.
    An error inside bigbatch that is not one of its checks (a bug) keeps its traceback, as does
    every error with ``BIGBATCH_TRACEBACK=1`` in the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from bigbatch.app.signals import Stopped

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/bigbatch
# Raised by bigbatch's own checks: their message is the whole story (Note [error boundary]).
CHECKED = (
    ValueError,
    TypeError,
    RuntimeError,
    OSError,
    MemoryError,
    FloatingPointError,
    ImportError,
    Stopped,  # not an error: a run stopped by SIGINT / SIGTERM says how to resume (exit 130 / 143)
)


def build_parser() -> argparse.ArgumentParser:
    """The full ``bigbatch`` argument parser (also used to render ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="bigbatch",
        description="Train with the batch size you want on the memory you have: exact gradient "
        "accumulation for PyTorch.",
        epilog="Errors print one line; set BIGBATCH_TRACEBACK=1 to see the full traceback.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def run() -> None:
    """The ``bigbatch`` console script: ``main``, then exit (Note [gloo exit] under torchrun)."""
    from bigbatch.distributed import launch as distributed

    try:
        import rich  # noqa: F401  (the application's one required extra)
    except ImportError:
        print(
            'bigbatch: the command line needs its extra: pip install "bigbatch[cli]" '
            "(the library itself, import bigbatch, needs only torch).",
            file=sys.stderr,
        )
        sys.exit(2)

    distributed.exit_process(main())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bigbatch`` command; returns the exit code (Note [error boundary])."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        with _warnings_in_one_line(args.command):
            return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"bigbatch {args.command}: interrupted.", file=sys.stderr)
        return 130
    except Exception as exc:
        code = getattr(exc, "exit_code", 2)  # a stopped run says how it stopped
        line = explain(exc)
        if line is None or os.environ.get("BIGBATCH_TRACEBACK"):
            raise
        print(f"bigbatch {args.command}: {'' if code != 2 else 'error: '}{line}", file=sys.stderr)
        return int(code)


@contextlib.contextmanager
def _warnings_in_one_line(command: str) -> Iterator[None]:
    """bigbatch's own warnings as ``bigbatch COMMAND: warning: message`` (not file, line and the
    line of bigbatch's code that warned); other packages' warnings as Python shows them. Only the
    text changes (``formatwarning``): filters and recording (``catch_warnings``) work as ever."""
    from bigbatch.core._warnings import BigBatchWarning

    original = warnings.formatwarning

    def one_line(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> str:
        if not issubclass(category, BigBatchWarning):
            return original(message, category, *args, **kwargs)
        return f"bigbatch {command}: warning: {message}\n"

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = original


def explain(exc: BaseException) -> str | None:
    """The line the user sees for ``exc``, or ``None`` for a bug in bigbatch (Note [error boundary])."""
    frames = traceback.extract_tb(exc.__traceback__)
    origin = frames[-1] if frames else None
    user = next((f for f in reversed(frames) if _is_user_code(f.filename)), None)
    message = str(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        message = f"{exc.filename}: {exc.strerror}"
    # a file that cannot be written is the whole story, wherever it was found (matplotlib, PIL)
    about_a_file = isinstance(exc, OSError) and exc.filename is not None and user is None
    if origin is None or _in_bigbatch(origin.filename) or about_a_file:
        if not isinstance(exc, CHECKED):
            return None
        return f"{_where(user)}: {message}" if user is not None else message
    frame = user or origin
    code = f"\n    {frame.line}" if frame.line else ""
    return f"{_where(frame)} in {frame.name}: {type(exc).__name__}: {message}{code}"


def _where(frame: traceback.FrameSummary) -> str:
    return f"{_short(frame.filename)}:{frame.lineno}"


def _short(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive
        return path


def _in_bigbatch(path: str) -> bool:
    return Path(path).resolve().is_relative_to(PACKAGE_DIR)


def _is_user_code(path: str) -> bool:
    if path.startswith("<") or _in_bigbatch(path):
        return False
    resolved = Path(path).resolve()
    libraries = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if any(resolved.is_relative_to(Path(lib).resolve()) for lib in libraries):
        return False
    return "site-packages" not in resolved.parts and "dist-packages" not in resolved.parts


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
        "--out", metavar="FILE.png", default="bigbatch-demo.png",
        help="where to write the plot (default bigbatch-demo.png)",
    )  # fmt: skip
    demo.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from bigbatch.app.demo import run_demo

    try:
        import sklearn.datasets  # noqa: F401  (the demo's data; imported here to say what to install)
    except ImportError as exc:
        raise ImportError(
            f"the demo's data come with scikit-learn ({exc}): run pip install scikit-learn "
            '(or pip install -e ".[demo]" in a clone).'
        ) from None
    result = run_demo(args.steps, args.batch_size, args.micro_batch_size, args.out)
    return 0 if result.exact() else 1


def _add_check(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser(
        "check",
        help="is accumulation exact for a task's model and loss? (exit 0 exact, 1 not)",
        description="Compute the gradient of the first --batch-size samples of TASK twice, on "
        "float64 copies of its model from the same seed: in one piece, and as "
        "bigbatch.Accumulator accumulates it over micro-batches of --micro-batch-size. Print "
        "the parameters that differ most, the verdict and, when not exact, why: a BatchNorm or "
        "other module that couples the samples, a loss that returns a mean as a sum, a "
        "batch-coupled loss, NaN or inf, non-determinism. Dropout is turned off in both runs "
        "(micro-batches draw other masks than the full batch: equal in distribution, not the "
        "same numbers), and the verdict says so. The model runs in the mode TASK builds it in "
        "(a transformers model built from a config: train); --eval checks it in eval mode.",
    )
    check.add_argument("task", metavar="TASK", help="module:function returning a bigbatch.Task")
    check.add_argument("--batch-size", type=int, default=16, help="samples in the batch compared")
    check.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="samples per micro-batch (default: a third)",
    )
    check.add_argument(
        "--tolerance", type=float, default=1e-10,
        help="relative difference counted as float64 rounding (default 1e-10; raised to 1e-5 "
        "where the model computes in float32, and the verdict says so)",
    )  # fmt: skip
    check.add_argument(
        "--eval", action="store_true", help="check the model in eval mode (model.eval())"
    )
    check.set_defaults(run=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from bigbatch.app.console import print_check
    from bigbatch.app.task import first_batch, load_task
    from bigbatch.core.split import batch_size
    from bigbatch.verifier._check import check

    if args.batch_size < 2:
        raise ValueError(f"--batch-size {args.batch_size} is too small: use at least 2.")
    task = load_task(args.task)
    batch = first_batch(task, args.batch_size)
    if batch_size(batch) < args.batch_size:
        raise ValueError(
            f"--batch-size {args.batch_size} is larger than the training data "
            f"({batch_size(batch)} samples): use --batch-size {batch_size(batch)} or less."
        )
    model = task.model.eval() if args.eval else task.model
    report = check(model, batch, task.loss_fn, args.micro_batch_size, tolerance=args.tolerance)
    print_check(report, title=f"bigbatch check {args.task}: worst parameters")
    return 0 if report.exact else 1


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="measure micro-batch sizes and checkpointing, choose the fastest that fits in memory",
        description="Run real optimizer steps of one effective batch of TASK on copies of its model "
        "and optimizer, at several micro-batch sizes, without checkpointing, with selective "
        "checkpointing and with 50% and 100% of the repeated blocks recomputed (offloaded too on "
        "CUDA). First the peak memory of each (model, gradients, optimizer state, activations; "
        "fitted as a + b x micro-batch to predict sizes not run); then the configurations that "
        "fit the budget less the safety margin are timed in --steps alternating rounds: the "
        "median time per step and its spread (interquartile range). Chooses the fastest; "
        "spreads that overlap within 5% tie, and a tie goes to the one with more headroom. "
        "Prints the table, the choice, the runner-up and why it lost.",
    )
    plan.add_argument("task", metavar="TASK", help="module:function returning a bigbatch.Task")
    plan.add_argument("--batch-size", type=int, required=True, help="samples per optimizer step")
    plan.add_argument(
        "--memory-budget", default=None,
        help="memory a step may use, e.g. 6GiB (default: the GPU's memory, or the CPU's available memory)",
    )  # fmt: skip
    plan.add_argument(
        "--margin", type=float, default=0.1,
        help="fraction of the budget kept free, in [0, 1) (default 0.1: peaks within 90%% of it)",
    )  # fmt: skip
    plan.add_argument(
        "--micro-batch-sizes", type=_int_list, default=None,
        help="comma-separated sizes to try, e.g. 1,2,4 (default: powers of two up to the batch)",
    )  # fmt: skip
    plan.add_argument(
        "--checkpointing", type=lambda text: [
            float(part) if part.strip()[:1].isdigit() else part.strip()
            for part in text.split(",") if part.strip()
        ], default=None,
        help="comma-separated options: fractions of the blocks recomputed whole and policy names "
        "none, selective, full, offload (selective:0.5 for a fraction); default: "
        "none,selective,0.5,1 (and offload on CUDA)",
    )  # fmt: skip
    plan.add_argument("--steps", type=int, default=5, help="timed rounds (default 5)")
    plan.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from bigbatch.app.console import print_plan
    from bigbatch.app.task import first_batch, load_task
    from bigbatch.core.split import batch_size
    from bigbatch.memory.planner import plan

    task = load_task(args.task)
    factory = task.optimizer
    batch = first_batch(task, args.batch_size)
    if batch_size(batch) < args.batch_size:
        raise ValueError(
            f"--batch-size {args.batch_size} is larger than the training data "
            f"({batch_size(batch)} samples): use --batch-size {batch_size(batch)} or less."
        )
    result = plan(
        task.model,
        batch,
        task.loss_fn,
        memory_budget=args.memory_budget,
        micro_batch_sizes=args.micro_batch_sizes,
        checkpointing=args.checkpointing,
        optimizer=(lambda params: factory(params, 1e-3)) if factory is not None else None,
        steps=args.steps,
        margin=args.margin,
    )
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
The run folder (--out) gets metrics.csv (one row per optimizer step), snapshot-*.pt (resume
state, written atomically; the newest --keep-snapshots kept), model.pt (final state dict) and
summary.json; `bigbatch report DIR` plots it. One run at a time per folder (a lock file). Ctrl-C
or SIGTERM finishes the step in flight, writes a snapshot and says how to resume (exit 130/143);
a second Ctrl-C stops at once.
"""


def _add_train(sub: argparse._SubParsersAction) -> None:
    from bigbatch.app.config import settings

    train = sub.add_parser(
        "train",
        help="train a task with exact gradient accumulation (progress bar, CSV, resume, report)",
        description="Train TASK's model on its data: one exact optimizer step per effective batch, "
        "cut into micro-batches that fit in memory.",
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument(
        "--config", metavar="FILE.toml", default=None,
        help="TOML file of settings (keys = these flags' names with _ for -)",
    )  # fmt: skip
    for f in settings():
        _add_setting(train, f)
    train.set_defaults(run=_run_train)


def _add_setting(parser: argparse.ArgumentParser, f: Any) -> None:
    """One flag for one ``TrainConfig`` field; only the flags given override ``--config``."""
    from bigbatch.app.config import setting_types

    kind, meta = setting_types()[f.name], f.metadata
    default = "" if f.default in (None, False, 0, "") else f" (default {f.default})"
    common: dict[str, Any] = {"default": argparse.SUPPRESS, "help": meta["help"] + default}
    if f.name == "task":
        parser.add_argument("task", metavar="TASK", nargs="?", **{**common, "help": meta["help"]})
    elif f.name == "resume":
        parser.add_argument(
            "--resume", nargs="?", const=True, type=_flag_type(meta["parse"]), **common
        )
        parser.add_argument(
            "--no-resume", dest="resume", action="store_false", default=argparse.SUPPRESS
        )
    elif kind is bool:
        parser.add_argument(
            "--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, **common
        )
    else:
        choices = [c for c in (meta["choices"] or ()) if c is not None] or None
        parse = meta["parse"] or next(t for t in (int, float, str) if t in (kind, *_args(kind)))
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=_flag_type(parse), choices=choices, **common)


def _args(kind: Any) -> tuple[Any, ...]:
    import typing

    return typing.get_args(kind)


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with argparse's error for text it cannot read."""

    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                str(exc)
                if parse not in (int, float)
                else f"{text!r} is not {'an integer' if parse is int else 'a number'}"
            ) from None

    read.__name__ = getattr(parse, "__name__", "value")
    return read


def _run_train(args: argparse.Namespace) -> int:
    from bigbatch.app.config import field_names, load_toml, make_config
    from bigbatch.app.loop import fit
    from bigbatch.app.task import load_task
    from bigbatch.core import _rng

    file_settings = load_toml(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if k in field_names()}
    config = make_config(file_settings, **flags)
    if not config.task:
        raise ValueError(
            'no task: give TASK (module:function) or `task = "module:function"` in --config.'
        )
    _rng.seed_all(config.seed)  # the task function builds the model: same seed, same weights
    fit(load_task(config.task), config)
    return 0


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
    from bigbatch.app.report import load_summary, plot_run, print_summary

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

TracebackLike = TracebackType | None

if __name__ == "__main__":
    sys.exit(main())

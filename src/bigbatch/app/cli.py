"""The ``bigbatch`` command line: parse, build the settings, call the library, print.

Each subcommand is one ``_run_<name>(args)`` function, whose docstring is its ``--help``
description, and a row of ``_COMMANDS`` (its one-line help and its flags). ``bigbatch train``'s
flags are made from the fields of ``TrainConfig`` (one list of settings; docs/design-settings.md
says why by hand on argparse). ``main`` is the one error boundary (Note [error boundary]);
docs/cli.md, the reference, is generated from this parser (tools/cli_docs.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import os
import re
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from bigbatch.app import demo, log, loop, report, settings, stopping
from bigbatch.app.task import Task, first_batch, load_task
from bigbatch.core import _rng
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.head import with_chunked_head
from bigbatch.distributed import launch as distributed
from bigbatch.memory.planner import plan
from bigbatch.verifier._check import check

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/bigbatch
# Raised by bigbatch's own checks: their message is the whole story (Note [error boundary]).
# Stopped is no error: a run stopped by a signal says how to resume (exit 130 / 143).
CHECKED = (
    ValueError,
    TypeError,
    RuntimeError,
    OSError,
    MemoryError,
    FloatingPointError,
    ImportError,
    stopping.Stopped,
)


class UsageError(Exception):
    """A command line argparse cannot read, as one line (Note [error boundary])."""


class _Parser(argparse.ArgumentParser):
    """argparse with one line for a mistake, "did you mean" and no abbreviated flags (an
    abbreviation would change meaning as settings are added)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"formatter_class": _Formatter, **kwargs, "allow_abbrev": False})

    def parse_known_args(  # type: ignore[override]  # typeshed's overloads: same behaviour
        self, args: Any = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        flag = next((a for a in extra if a.startswith("-")), None)  # (what follows is its value)
        if flag:
            self.error(f"unknown flag {flag}{_did_you_mean(flag, self._option_string_actions)}")
        if extra:
            self.error(f"unexpected argument(s): {' '.join(extra)}")
        return parsed, extra

    def error(self, message: str) -> NoReturn:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:  # a misspelt subcommand
            message += _did_you_mean(choice[1], re.findall(r"[\w-]+", choice[2]))
        raise UsageError(f"{self.prog}: error: {message.removeprefix('argument ')}")


def _did_you_mean(given: str, known: Any) -> str:
    close = settings.closest(given.split("=")[0], known)
    return f": did you mean {close}?" if close else ""


class _Formatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the help already speaks of one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        shown, text = shown_default(action), action.help or ""
        return text if shown is None or "default" in text else f"{text} (default {shown})"


class _Raw(_Formatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs kept as written (tables, examples)."""


def shown_default(action: argparse.Action) -> str | None:
    """The default a flag's help shows (``None``: none worth showing)."""
    value = getattr(action, "shown", action.default)
    if value is None or value is False or value in ("", argparse.SUPPRESS) or not action.help:
        return None
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    """The full ``bigbatch`` argument parser (also used to render ``--help`` and docs/cli.md)."""
    parser = _Parser(
        prog="bigbatch",
        description="Train with the batch size you want on the "
        "memory you have: exact gradient accumulation for PyTorch.",
        epilog="Errors print one line; set BIGBATCH_TRACEBACK=1 to see the full traceback.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for run, help, flags, options in _COMMANDS:
        name, doc = run.__name__.removeprefix("_run_"), inspect.cleandoc(run.__doc__ or "")
        description, example, epilog = doc.partition("\n\nexample")
        command = sub.add_parser(name, **{"help": help, "description": description, **options})
        command.epilog = command.epilog or (f"example{epilog}" if example else None)
        for names, settings_ in flags:
            command.add_argument(*names.split(), **settings_)
        for f in settings.settings() if name == "train" else []:
            _add_setting(command, f)
        command.set_defaults(run=run)
    return parser


def run() -> None:
    """The ``bigbatch`` console script: ``main``, then exit (Note [gloo exit] under torchrun)."""
    if importlib.util.find_spec("rich") is None:  # the application's one required extra
        print(
            'bigbatch: the command line needs its extra: pip install "bigbatch[cli]" (the '
            "library itself, import bigbatch, needs only torch).",
            file=sys.stderr,
        )
        sys.exit(2)
    distributed.exit_process(main())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bigbatch`` command; returns the exit code.

    Note [error boundary]
        Every error a user can cause ends in one line on stderr and exit code 2, never a traceback
        nor a usage block: a misspelt flag (with the closest one: "did you mean"), a bad value or
        setting, a task that cannot be used, a run folder that is locked, read-only or full, a step
        with NaN, no memory left. An error raised by bigbatch's own checks prints its message (it
        names the setting and what is allowed); one raised inside the user's code (the task
        function, the loss, the model) prints the user's frame instead: ``file:line in function``,
        the exception, and the line of code, since bigbatch's internals would not help. An error
        inside bigbatch that is not one of its checks (a bug) keeps its traceback, as does every
        error with ``BIGBATCH_TRACEBACK=1`` in the environment.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 0
    shown = warnings.formatwarning
    warnings.formatwarning = functools.partial(_one_line, args.command, shown)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"bigbatch {args.command}: interrupted.", file=sys.stderr)
        return 130
    except Exception as exc:
        code = getattr(exc, "exit_code", 2)  # a stopped run says how it stopped
        if (line := explain(exc)) is None or os.environ.get("BIGBATCH_TRACEBACK"):
            raise
        print(f"bigbatch {args.command}: {'' if code != 2 else 'error: '}{line}", file=sys.stderr)
        return int(code)
    finally:
        warnings.formatwarning = shown


def _one_line(command: str, shown: Any, message: Any, kind: type, *rest: Any, **kw: Any) -> str:
    """bigbatch's warnings as ``bigbatch COMMAND: warning: message`` (not file, line and the line
    of bigbatch's code that warned); other packages' warnings as Python ``shown`` them. Only the
    text changes (``formatwarning``): filters and recording (``catch_warnings``) work as ever."""
    if issubclass(kind, BigBatchWarning):
        return f"bigbatch {command}: warning: {message}\n"
    return str(shown(message, kind, *rest, **kw))


def explain(exc: BaseException) -> str | None:
    """The line the user sees for ``exc``; ``None`` for a bug in bigbatch (Note [error boundary])."""
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
    return f"{os.path.relpath(frame.filename)}:{frame.lineno}"  # (POSIX: fcntl locks the folder)


def _in_bigbatch(path: str) -> bool:
    return Path(path).resolve().is_relative_to(PACKAGE_DIR)


def _is_user_code(path: str) -> bool:
    resolved, paths = Path(path).resolve(), sysconfig.get_paths()
    libraries = [Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    installed = {"site-packages", "dist-packages"} & set(resolved.parts)
    library = installed or any(resolved.is_relative_to(lib) for lib in libraries)
    return not (path.startswith("<") or _in_bigbatch(path) or library)


def _add_setting(parser: argparse.ArgumentParser, f: Any) -> None:
    """The flags of one ``TrainConfig`` field; only the flags given override ``--config``."""
    flag, meta = "--" + f.name.replace("_", "-"), f.metadata
    names = [flag, *(a for a in meta["aliases"] if "=" not in a)]
    common: dict[str, Any] = {"default": argparse.SUPPRESS, "help": settings.helps()[f.name]}
    if f.name == "task":
        parser.add_argument("task", metavar="TASK", nargs="?", **common)
        return
    common["dest"] = f.name
    if settings.kinds(f) == (bool,):
        action = parser.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
    elif bool in settings.kinds(f):  # --resume, --resume auto, --no-resume
        metavar = "|".join(settings.words(f))
        optional: dict[str, Any] = {"nargs": "?", "const": True, "metavar": metavar}
        action = parser.add_argument(*names, type=_reader(f), **optional, **common)
        no = f"not {flag} (overrides --config)"
        parser.add_argument(f"--no-{flag[2:]}", action="store_false", **{**common, "help": no})
    else:
        shown = "{" + ",".join(settings.words(f)) + "}" if meta["choices"] else None
        action = parser.add_argument(*names, type=_reader(f), metavar=shown, **common)
    action.shown = f.default  # type: ignore[attr-defined]  # for the help (default: SUPPRESS)
    for switch, value in (a.split("=") for a in meta["aliases"] if "=" in a):
        same = {**common, "help": f"the same as {flag} {value}"}
        parser.add_argument(switch, action="store_const", const=value, **same)


def _reader(f: Any) -> Callable[[str], Any]:
    """Reads a flag's text as setting ``f``: a choice in any case (``TrainConfig`` refuses one
    not in its list, naming the list), else as ``_typed`` reads its types and words."""
    if f.metadata["choices"]:
        return functools.partial(settings.canonical, f)
    return _typed(*(k for k in settings.kinds(f) if k in _NAMED), words=settings.words(f))


_NAMED = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("text", "text")}


def _typed(*kinds: type, words: Sequence[str] = (), listed: bool = False) -> Callable[[str], Any]:
    """The reader of every flag with a value: one of ``words`` in any case, else the first of
    ``kinds`` that reads the text (``listed``: a comma-separated list of them). Text it cannot
    read is refused naming the text and what is allowed (argparse adds the flag's name)."""

    def one(text: str) -> Any:
        for kind in kinds:
            with contextlib.suppress(ValueError):
                return kind(text.strip())
        raise ValueError(text)

    def read(text: str) -> Any:
        word = next((w for w in words if w.lower() == text.strip().lower()), None)
        try:
            if word is not None or not listed:
                return word if word is not None else one(text)
            return [one(part) for part in text.split(",") if part.strip()]
        except ValueError:
            kind = " or ".join(_NAMED[k][listed] for k in kinds)
            wanted = [f"a comma-separated list of {kind}" if listed else kind, *words]
            raise argparse.ArgumentTypeError(f"{text!r} is not {' or '.join(wanted)}") from None

    return read


def _run_demo(args: argparse.Namespace) -> int:
    """``bigbatch demo`` (its description is the ``demo`` module's docstring)."""
    result = demo.run_demo(args.steps, args.batch_size, args.micro_batch_size, args.out)
    return 0 if result.exact() else 1


def _run_train(args: argparse.Namespace) -> None:
    """Train TASK's model on its data: one exact optimizer step per effective batch, cut into
    micro-batches that fit in memory. The optimizer is the task's (Task.optimizer(params,
    lr)), else torch.optim.AdamW(lr=--lr, betas=(0.9, 0.999), weight_decay=0.01),
    its rate following --lr-schedule after --warmup-steps.

    examples:
      bigbatch train my_project/tasks.py:mnist --batch-size 1024 --micro-batch-size 64 --epochs 3
      bigbatch train my_project.tasks:lm --batch-size 256 --micro-batch-size auto --memory-budget 6GiB
      bigbatch train my_project.tasks:lm --config run.toml --lr 3e-4        # flags override the file
      bigbatch train my_project.tasks:lm --config run.toml --resume         # continue after a crash

    Any two of --batch-size, --micro-batch-size and --gradient-accumulation-steps give the
    third (batch = micro-batch x steps); the step is the exact big-batch step however the
    batch is cut. A TOML --config holds the same names with _ for - (batch_size = 256).
    Values are read in any case (--micro-batch-size Auto); transformers' names work too
    (--learning-rate, --max-steps, --num-train-epochs, --per-device-train-batch-size, --fp16,
    --bf16). The run folder (--out) gets metrics.csv, train.log, snapshots, model.pt and
    summary.json (`bigbatch report DIR` plots it); one run at a time per folder. Ctrl-C or
    SIGTERM finishes the step in flight, writes a snapshot and says how to resume (exit
    130/143); a second Ctrl-C stops at once (a second SIGTERM is a copy of the first: pkill,
    SLURM, torchrun). Reference: docs/cli.md.
    """
    given = {k: v for k, v in vars(args).items() if k in {f.name for f in settings.settings()}}
    chosen = settings.make_config(settings.load_toml(args.config) if args.config else {}, **given)
    if not chosen.task:
        raise ValueError(
            'no task: give TASK (module:function) or `task = "module:function"` in --config.'
        )
    _rng.seed_all(chosen.seed)  # the task function builds the model: same seed, same weights
    loop.fit(load_task(chosen.task), chosen)


def _run_report(args: argparse.Namespace) -> None:
    """Print the summary of a `bigbatch train` run and draw DIR/report.png: the loss per
    optimizer step and the peak memory per step. A run still running, or stopped before its
    end, gets a partial report that says so."""
    summary, partial, path = report.report(args.out, args.png)
    report.print_summary(summary, title="bigbatch report" + (" (partial)" if partial else ""))
    print(f"partial report: {partial}.\nplot: {path}" if partial else f"plot: {path}")


def _run_check(args: argparse.Namespace) -> int:
    """Compute the gradient of the first --batch-size samples of TASK twice, on float64 copies of
    its model from the same seed: in one piece, and as bigbatch.Accumulator accumulates it over
    micro-batches of --micro-batch-size. Print the parameters that differ most, the verdict and,
    when not exact, why: a BatchNorm or other module that couples the samples, a loss that
    returns a mean as a sum, a batch-coupled loss, NaN or inf, non-determinism. Dropout is
    turned off in both runs (micro-batches draw other masks than the full batch: equal in
    distribution, not the same numbers), and the verdict says so. The model runs in the mode
    TASK builds it in (a transformers model built from a config: train); --eval checks it in
    eval mode."""
    if args.batch_size < 2:
        raise ValueError(f"--batch-size {args.batch_size} is too small: use at least 2.")
    task = load_task(args.task)
    batch = first_batch(task, args.batch_size)
    model = task.model.eval() if args.eval else task.model
    found = check(model, batch, _loss(task, args), args.micro_batch_size, tolerance=args.tolerance)
    report.print_check(found, title=f"bigbatch check {args.task}: worst parameters")
    return 0 if found.exact else 1


def _run_plan(args: argparse.Namespace) -> None:
    """Run real optimizer steps of one effective batch of TASK on copies of its model and
    optimizer, at several micro-batch sizes, without checkpointing and, where a size does not
    fit without it, with selective checkpointing and with 50% and 100% of the repeated blocks
    recomputed (offloaded too on CUDA; --checkpointing measures the options it names at every
    size). First the peak memory of each (model, gradients, optimizer state, activations;
    fitted as a + b x micro-batch to predict sizes not run); then the configurations that fit
    the budget less the safety margin are timed in --steps alternating rounds (after two, only
    those within 1.5x of the fastest): the median time per step and its spread (interquartile
    range). Chooses the fastest; spreads that overlap within 5% tie, and a tie goes to the one
    with more headroom. Shows its progress, then prints the table, the choice, the runner-up and
    why it lost. With --micro-batch-tokens (variable-length text), token budgets are compared
    too (a budget that cuts as a smaller one does is measured once), and every row shows the
    padding it computes."""
    task = load_task(args.task)
    factory = task.optimizer
    optimizer = None if factory is None else lambda params: factory(params, 1e-3)
    with log.progress_lines("bigbatch plan") as progress:
        result = plan(
            task.model,
            first_batch(task, args.batch_size),
            _loss(task, args),
            memory_budget=args.memory_budget,
            micro_batch_sizes=args.micro_batch_sizes,
            checkpointing=args.checkpointing,
            optimizer=optimizer,
            steps=args.steps,
            margin=args.margin,
            micro_batch_tokens=args.micro_batch_tokens,
            lengths=task.lengths,
            progress=progress,
        )
    report.print_plan(result)


def _loss(task: Task, args: argparse.Namespace) -> Any:
    """The task's loss, with ``--chunked-head`` as the trainer computes it (its memory counted)."""
    return with_chunked_head(task.loss_fn, task.model) if args.chunked_head else task.loss_fn


INT, NUMBER = _typed(int), _typed(float)
TASK = ("task", dict(metavar="TASK", help="module:function returning a bigbatch.Task"))
CHUNKED = (
    "--chunked-head",
    dict(
        action="store_true",
        help="the loss as `bigbatch train "
        "--chunked-head` computes it: from the hidden states, in chunks",
    ),
)
_COMMANDS: list[tuple[Callable[[argparse.Namespace], Any], str, list[tuple[str, dict]], dict]] = [
    (
        _run_demo,
        "train one model full-batch, accumulated and auto under a budget: same weights, "
        "less memory",
        [
            ("--steps", dict(type=INT, default=40, help="optimizer steps per run")),
            ("--batch-size", dict(type=INT, default=512, help="samples per optimizer step")),
            (
                "--micro-batch-size",
                dict(type=INT, default=64, help="the accumulated run's micro-batch"),
            ),
            (
                "--out",
                dict(
                    metavar="FILE.png", default="bigbatch-demo.png", help="where to write the plot"
                ),
            ),
        ],
        dict(
            description=demo.__doc__,
            formatter_class=_Raw,
            epilog="example:\n  bigbatch demo --steps 20 --out runs/demo.png",
        ),
    ),
    (
        _run_train,
        "train a task with exact gradient accumulation (progress, CSV, resume, report)",
        [
            (
                "--config",
                dict(
                    metavar="FILE.toml",
                    default=None,
                    help="TOML file of settings (keys = these flags' names with _ for -)",
                ),
            ),
        ],
        dict(formatter_class=_Raw),
    ),
    (
        _run_report,
        "summarise a run folder and plot its loss and memory over steps (PNG)",
        [
            ("out", dict(metavar="DIR", help="the --out folder of a `bigbatch train` run")),
            ("--png", dict(help="where to write the plot (default DIR/report.png)")),
        ],
        {},
    ),
    (
        _run_check,
        "is accumulation exact for a task's model and loss? (exit 0 exact, 1 not)",
        [
            TASK,
            ("--batch-size", dict(type=INT, default=16, help="samples in the batch compared")),
            (
                "--micro-batch-size",
                dict(type=INT, help="samples per micro-batch (default: a third)"),
            ),
            (
                "--tolerance",
                dict(
                    type=NUMBER,
                    default=1e-10,
                    help="relative difference counted as "
                    "float64 rounding (default 1e-10; raised to 1e-5 where the model computes in float32, "
                    "and the verdict says so)",
                ),
            ),
            (
                "--eval",
                dict(action="store_true", help="check the model in eval mode (model.eval())"),
            ),
            CHUNKED,
        ],
        {},
    ),
    (
        _run_plan,
        "measure micro-batch sizes and checkpointing, choose the fastest that fits in memory",
        [
            TASK,
            ("--batch-size", dict(type=INT, required=True, help="samples per optimizer step")),
            (
                "--memory-budget",
                dict(
                    help="memory a step may use, e.g. 6GiB (default: the GPU's "
                    "memory, or the CPU's available memory)"
                ),
            ),
            (
                "--margin",
                dict(
                    type=NUMBER,
                    default=0.1,
                    help="fraction of the budget kept free, in "
                    "[0, 1) (default 0.1: peaks within 90%% of it)",
                ),
            ),
            (
                "--micro-batch-sizes",
                dict(
                    type=_typed(int, listed=True),
                    help="comma-separated sizes "
                    "to try, e.g. 1,2,4 (default: powers of two up to the batch)",
                ),
            ),
            (
                "--checkpointing",
                dict(
                    type=_typed(float, str, listed=True),
                    help="comma-separated options: fractions of the blocks recomputed whole and policy "
                    "names none, selective, full, offload (selective:0.5 for a fraction); default: "
                    "none,selective,0.5,1 (and offload on CUDA)",
                ),
            ),
            ("--steps", dict(type=INT, default=5, help="timed rounds (default 5)")),
            (
                "--micro-batch-tokens",
                dict(
                    type=_typed(int, words=["auto"], listed=True),
                    help="token budgets to compare too, comma-separated, or auto (variable-length text)",
                ),
            ),
            CHUNKED,
        ],
        {},
    ),
]

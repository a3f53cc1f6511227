"""The task: what a user hands to the trainer (``Task``), and how one is found from a path.

A task is a model, its training data and its loss, with what is optional beside them (eval data,
a metric, optimizer and scheduler factories, collate, count). ``bigbatch train`` finds one from
``module:function`` or ``file.py:function`` (``load_task``), and ``bigbatch check`` and
``bigbatch plan`` measure on its first batch (``first_batch``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.core.loss import LossFn

OptimizerFactory = Callable[..., torch.optim.Optimizer]
"""``optimizer(params, lr) -> Optimizer``."""
SchedulerFactory = Callable[[torch.optim.Optimizer, int], Any]
"""``scheduler(optimizer, total_steps) -> LR scheduler`` stepped once per optimizer step."""
Metric = Callable[[torch.nn.Module, Any], Any]
"""``metric(model, batch) -> (metric_sum, count)`` or a scalar mean, like a ``loss_fn``."""


class TaskError(ValueError):
    """A task path or a task function that cannot be used; the message says what to fix."""


@dataclass
class Task:
    """A model, its training data and its loss: everything ``bigbatch train`` needs.

    Args:
        model: the module to train.
        train_data: a map-style dataset (or anything a ``DataLoader`` takes); one item per sample.
        loss_fn: ``loss_fn(model, micro_batch)`` returning a scalar mean or ``(loss_sum, count)``.
        eval_data: optional dataset to evaluate on after training (and every ``eval_every`` steps).
        metric: optional ``metric(model, batch)`` returning ``(metric_sum, count)`` or a mean,
            e.g. the number of correct predictions and the number of samples.
        optimizer: optional factory ``optimizer(params, lr)``; default ``AdamW``.
        scheduler: optional factory ``scheduler(optimizer, total_steps)``, stepped once per
            optimizer step (``ReduceLROnPlateau`` with the step's loss); default: the settings'
            ``lr_schedule``. A per-epoch schedule is one that changes every
            ``ceil(len(train_data) / batch_size)`` steps: write it as a step schedule, e.g.
            ``LambdaLR(opt, lambda step: 0.1 ** (step // steps_per_epoch))``.
        collate_fn: optional ``collate_fn`` for the ``DataLoader``.
        lengths: optional ``lengths(batch)`` -> each sample's tokens, for ``--micro-batch-tokens``
            when the batch has no ``attention_mask``.
        count_fn: optional ``count_fn(micro_batch)``, the count the loss will return for it
            (e.g. non-padding tokens): fp16 then back-propagates at the full batch's scale
            (Note [backward scale] in ``bigbatch.core.engine``).
        pad_values: optional ``{key: pad value}`` for a mapping batch's per-token tensors
            beyond transformers' keys, ``{key: None}`` for a 2-D tensor that is not per-token
            (Note [per-token tensors] in ``bigbatch.core._tokens``).

    Example:
        >>> def my_task():  # in my_project/tasks.py, run as `bigbatch train my_project.tasks:my_task`
        ...     data = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
        ...     loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        ...     return Task(model=torch.nn.Linear(3, 1), train_data=data, loss_fn=loss)
    """

    model: torch.nn.Module
    train_data: Any
    loss_fn: LossFn
    eval_data: Any = None
    metric: Metric | None = None
    optimizer: OptimizerFactory | None = None
    scheduler: SchedulerFactory | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    count_fn: Callable[[Any], Any] | None = None
    lengths: Callable[[Any], Any] | None = None
    pad_values: Mapping[str, float | None] | None = None


def check_task(task: object) -> None:
    """Refuse a task the trainer cannot use, naming the field and what it must be.

    Raises:
        TaskError: not a ``Task``, a model that is not a module, a loss or factory that is not
            callable, training data that is not a non-empty map-style dataset.
    """
    if not isinstance(task, Task):
        raise TaskError(
            f"the task is a {type(task).__name__}, not a bigbatch.Task: end the task "
            "function with `return bigbatch.Task(model=, train_data=, loss_fn=)`."
        )
    if not isinstance(task.model, torch.nn.Module):
        kind = type(task.model).__name__
        raise TaskError(f"Task.model is a {kind}; it must be a torch.nn.Module.")
    for name in ("loss_fn", "metric", "optimizer", "scheduler", "collate_fn", "count_fn"):
        value = getattr(task, name)
        if (value is not None or name == "loss_fn") and not callable(value):
            what = " loss_fn(model, batch) returning a mean or (loss_sum, count)"
            raise TaskError(
                f"Task.{name} is {value!r}; it must be a function"
                f"{what if name == 'loss_fn' else ''}."
            )
    data = task.train_data
    if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
        raise TaskError(
            f"Task.train_data is a {type(data).__name__}; the trainer needs a "
            "map-style dataset (len() and [i]), e.g. a TensorDataset(x, y) or a list."
        )
    if len(data) == 0:
        raise TaskError("Task.train_data is empty: the trainer needs at least one sample.")


def canonical_path(path: str) -> str:
    """One spelling per task: ``./tasks.py:small`` and ``/abs/tasks.py:small`` are the same run."""
    module, sep, func = path.partition(":")
    return f"{os.path.realpath(module)}:{func}" if sep and module.endswith(".py") else path


def load_task(path: str, **kwargs: Any) -> Task:
    """Import ``module:function`` (or ``file.py:function``), call it and check it returns a Task.

    Raises:
        TaskError: the path is malformed, the module or function is missing, or the function
            returns something other than a usable ``Task`` (the message starts with the path).
    """
    module_name, sep, func_name = path.partition(":")
    if not sep or not module_name or not func_name:
        raise TaskError(_no_function(path, module_name))
    with _current_folder_importable():
        func = getattr(_import(module_name, path), func_name, None)
        if func is None or not callable(func):
            raise TaskError(f"task {path!r}: module {module_name!r} has no function {func_name!r}.")
        task = func(**kwargs)
    try:
        check_task(task)
    except TaskError as exc:
        raise TaskError(f"task {path!r}: {exc}") from None
    return task


def _no_function(path: str, module_name: str) -> str:
    """Why ``path`` is not a task: the two forms, and the module's functions returning a Task."""
    names: list[str] = []
    if module_name:
        with _current_folder_importable():
            module = _import(module_name, path)
        names = [
            name
            for name, f in vars(module).items()
            if inspect.isfunction(f)  # -> Task
            and str(f.__annotations__.get("return")).rstrip("'>").endswith("Task")
        ]
    example = f"{module_name}:{names[0]}" if names else "my_project.tasks:mnist"
    return (
        f"task {path!r} names no function: give module:function or file.py:function, e.g. "
        f"{example} (its functions that return a bigbatch.Task: "
        f"{', '.join(names) or 'none'})."
    )


def _import(module_name: str, path: str) -> Any:
    """The module, imported by name or run from its file; a syntax error in the user's words."""
    file = module_name.endswith(".py")
    if file and not os.path.exists(module_name):
        raise TaskError(f"task {path!r}: file {module_name!r} does not exist.")
    try:
        if not file:
            return importlib.import_module(module_name)
        name = os.path.basename(module_name)[:-3]
        spec = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module
    except ModuleNotFoundError as exc:
        if file:  # the user's file imports something missing: the user's line says it
            raise
        raise TaskError(
            f"task {path!r}: cannot import {module_name!r} ({exc}); run from the "
            "folder that holds it or install it."
        ) from None
    except SyntaxError as exc:  # the user's file, line and caret; not importlib's frame
        raise TaskError(f"task {path!r}: {_syntax_error(exc)}") from None


def _syntax_error(exc: SyntaxError) -> str:
    """``file:line: SyntaxError: message``, then the line and a caret under the fault."""
    where = f"{os.path.relpath(exc.filename)}:{exc.lineno}" if exc.filename else "<unknown>"
    head = f"{where}: {type(exc).__name__}: {exc.msg}"
    if not exc.text:
        return head
    code = (line := exc.text.rstrip("\n")).lstrip()
    column = max(0, (exc.offset or 1) - 1 - (len(line) - len(code)))
    same_line = exc.end_offset and exc.end_lineno == exc.lineno
    width = max(1, exc.end_offset - (exc.offset or 0)) if same_line else 1  # type: ignore[operator]
    return f"{head}\n    {code.rstrip()}\n    {' ' * column}{'^' * width}"


@contextlib.contextmanager
def _current_folder_importable() -> Iterator[None]:
    """Like ``python -m``: modules next to the user resolve while the task is loaded and built;
    ``sys.path`` is given back as it was afterwards."""
    added = os.getcwd() not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        if added and os.getcwd() in sys.path:
            sys.path.remove(os.getcwd())


def first_batch(task: Task, batch_size: int) -> Any:
    """The first ``batch_size`` training samples of ``task``, collated, in order (no shuffling):
    what ``bigbatch check`` and ``bigbatch plan`` measure on.

    Raises:
        ValueError: ``batch_size`` is below 1 or larger than the training data (the batch
            measured would not be the batch asked for).
    """
    samples = len(task.train_data)
    if batch_size < 1:
        raise ValueError(
            f"--batch-size {batch_size} is not allowed: use a positive integer, at "
            f"most the task's {samples} training samples."
        )
    if batch_size > samples:
        raise ValueError(
            f"--batch-size {batch_size} is larger than the task's {samples} training "
            f"samples: the batch measured would hold only {samples}. Give "
            f"--batch-size {samples} or less."
        )
    collate = task.collate_fn or torch.utils.data.default_collate
    return collate([task.train_data[i] for i in range(batch_size)])

"""What a user hands to the trainer: a ``Task``, and how one is found from ``module:function``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.loss import LossFn

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
        scheduler: optional factory ``scheduler(optimizer, total_steps)``; default constant LR.
        collate_fn: optional ``collate_fn`` for the ``DataLoader``.

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


def load_task(path: str, **kwargs: Any) -> Task:
    """Import ``module:function`` (or ``file.py:function``), call it and check it returns a Task.

    Raises:
        TaskError: the path is malformed, the module or function is missing, or the function
            returns something other than a ``Task``.
    """
    module_name, sep, func_name = path.partition(":")
    if not sep or not module_name or not func_name:
        raise TaskError(
            f"task {path!r} is not of the form module:function (e.g. my_project.tasks:mnist)."
        )
    module = _import(module_name, path)
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        raise TaskError(f"task {path!r}: module {module_name!r} has no function {func_name!r}.")
    task = func(**kwargs)
    if not isinstance(task, Task):
        raise TaskError(
            f"task {path!r} returned {type(task).__name__}, not a bigbatch.Task: end the function with "
            "`return bigbatch.Task(model=..., train_data=..., loss_fn=...)`."
        )
    return task


def _import(module_name: str, path: str) -> Any:
    if module_name.endswith(".py"):
        if not os.path.exists(module_name):
            raise TaskError(f"task {path!r}: file {module_name!r} does not exist.")
        spec = importlib.util.spec_from_file_location(
            os.path.basename(module_name)[:-3], module_name
        )
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules next to the user resolve
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise TaskError(
            f"task {path!r}: cannot import {module_name!r} ({exc}); run from the folder that holds it "
            "or install it."
        ) from None

"""Loading a task leaves the process as it found it; one spelling per task in a run's identity."""

from __future__ import annotations

import os
import sys

import pytest

from bigbatch.app.task import TaskError, canonical_path, check_task, load_task

TASKS = os.path.join(os.path.dirname(__file__), "tasks.py")


def test_loading_a_module_by_name_gives_sys_path_back(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(
        "import torch, bigbatch\n"
        "def tiny():\n"
        "    data = torch.utils.data.TensorDataset(torch.randn(4, 3), torch.randn(4, 1))\n"
        "    loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])\n"
        "    return bigbatch.Task(model=torch.nn.Linear(3, 1), train_data=data, loss_fn=loss)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    task = load_task("my_tasks:tiny")  # found next to the user, like `python -m`
    assert len(task.train_data) == 4
    assert sys.path == before


def test_the_same_task_spelled_two_ways_is_one_run(tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(TASKS))
    assert canonical_path("./tasks.py:classify") == canonical_path(f"{TASKS}:classify")
    assert canonical_path("my.module:fn") == "my.module:fn"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": "a model"}, r"Task.model is a str; it must be a torch.nn.Module"),
        ({"loss_fn": None}, r"Task.loss_fn is None; it must be a function loss_fn\(model, batch\)"),
        ({"optimizer": 3}, r"Task.optimizer is 3; it must be a function"),
        ({"train_data": []}, r"Task.train_data is empty"),
        (
            {"train_data": iter([1])},
            r"Task.train_data is a list_iterator; the trainer needs a map-style",
        ),
    ],
)
def test_a_task_that_cannot_be_used_is_named(change, message):
    import dataclasses

    task = load_task(f"{TASKS}:classify")
    with pytest.raises(TaskError, match=message):
        check_task(dataclasses.replace(task, **change))
    with pytest.raises(TaskError, match=r"the task is a int, not a bigbatch.Task"):
        check_task(3)

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


BROKEN = {
    "a bracket": ("def broken(:\n    pass\n", 1, "def broken(:", 11, "SyntaxError"),
    "an indent": ("def f():\n    x = 1\n      y = 2\n", 3, "y = 2", 0, "IndentationError"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
@pytest.mark.parametrize("spelling", ["file", "module"])
def test_a_task_file_with_a_syntax_error_names_its_line(case, spelling, tmp_path, monkeypatch):
    """The user's file, line and caret, as Python prints them; not importlib's frame."""
    source, line, code, column, kind = BROKEN[case]
    (tmp_path / "user_tasks.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    path = "user_tasks.py:f" if spelling == "file" else "user_tasks:f"
    with pytest.raises(TaskError) as raised:
        load_task(path)
    head, shown, caret = str(raised.value).split("\n")
    assert head.startswith(f"task {path!r}: user_tasks.py:{line}: {kind}: ")
    assert shown == f"    {code}"
    assert caret.startswith("    " + " " * column + "^")
    assert "importlib" not in str(raised.value)
    sys.modules.pop("user_tasks", None)


def test_the_command_line_shows_the_syntax_error_not_importlib(tmp_path, monkeypatch, capsys):
    from bigbatch.app.cli import main

    (tmp_path / "user_tasks.py").write_text("def broken(:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "user_tasks.py:broken", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "bigbatch train: error: task 'user_tasks.py:broken': user_tasks.py:1: SyntaxError: "
        "invalid syntax\n    def broken(:\n               ^\n"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.needs("rich")
@pytest.mark.parametrize("command", ["plan", "check"])
def test_plan_and_check_refuse_a_batch_larger_than_the_data(command, capsys):
    """``first_batch`` would give them 50 samples where 1000 were asked for."""
    from bigbatch.app.cli import main
    from bigbatch.app.task import first_batch

    with pytest.raises(ValueError, match=r"--batch-size 51 is larger than the task's 50 training"):
        first_batch(load_task(f"{TASKS}:classify"), 51)
    assert len(first_batch(load_task(f"{TASKS}:classify"), 50)[0]) == 50
    assert main([command, f"{TASKS}:classify", "--batch-size", "1000"]) == 2
    assert capsys.readouterr().err == (
        f"bigbatch {command}: error: --batch-size 1000 is larger than the task's 50 training "
        "samples: the batch measured would hold only 50. Give --batch-size 50 or less.\n"
    )

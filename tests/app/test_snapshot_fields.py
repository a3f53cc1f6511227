"""Crafted snapshots: every field checked before anything is restored, and a bad one named with
its file (Note [snapshot fields] in bigbatch.app.folder), in one line, never a traceback.

A real run writes its snapshots; each case rewrites one field of ``snapshot.pt`` (the file a
resume reads), as a damaged or hand-edited file would hold it, and resumes.
"""

from __future__ import annotations

import math
import os

import pytest
import tasks
import torch

import bigbatch
from bigbatch.app.cli import main
from bigbatch.app.snapshot import RunMismatchError

SETTINGS = {"batch_size": 10, "micro_batch_size": 4, "steps": 2, "save_every": 1, "quiet": True}


@pytest.fixture
def run(tmp_path):
    """A finished run of 2 steps: ``snapshot.pt`` (step 2) and ``snapshot-00000001.pt``."""
    out = tmp_path / "run"
    bigbatch.fit(tasks.classify(n=20), out=str(out), **SETTINGS)
    return out


def rewrite(out, change):
    path = out / "snapshot.pt"
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
    return str(path)


def resume(out):
    bigbatch.fit(tasks.classify(n=20), out=str(out), resume=True, **SETTINGS)


def set_field(name, value):
    return lambda state: state.__setitem__(name, value)


CASES = {
    "missing": (lambda s: s.pop("rng"), "'rng' is missing"),
    "step as text": (set_field("step", "2"), "'step' is a str, not an int"),
    "step as bool": (set_field("step", True), "'step' is a bool, not an int"),
    "step past the end": (set_field("step", 7), r"'step' is out of range \(step=7, total_steps=2"),
    "negative step": (set_field("step", -1), r"'step' is out of range \(step=-1"),
    "no total": (set_field("total_steps", 0), r"'step' is out of range \(step=2, total_steps=0"),
    "another total": (set_field("total_steps", 5), "'total_steps' is 5, and this run takes 2"),
    "nan time": (set_field("elapsed_s", math.nan), "'elapsed_s' is nan, not a time in seconds"),
    "identity a list": (set_field("identity", []), "'identity' is a list, not a dict"),
    "model not a dict": (set_field("model", [1]), "'model' is a list, not a dict"),
    "model of another shape": (
        set_field("model", {"0.weight": torch.zeros(1)}),
        r"'model' cannot be restored \(RuntimeError: Error\(s\) in loading state_dict",
    ),
    "optimizer empty": (set_field("optimizer", {}), r"'optimizer' cannot be restored \(KeyError"),
    "scheduler empty": (set_field("scheduler", {}), r"'scheduler' cannot be restored \(KeyError"),
    "scheduler dropped": (set_field("scheduler", None), r"'scheduler' cannot be restored"),
    "engine empty": (set_field("engine", {}), r"'engine' cannot be restored \(ValueError"),
    "rng of text": (set_field("rng", ["x"]), "'rng' is not a list of every rank's random state"),
    "rng empty": (set_field("rng", []), "'rng' is not a list of every rank's random state"),
    "rng damaged": (set_field("rng", [{"torch": 3}]), r"'rng' cannot be restored \(TypeError"),
}


@pytest.mark.parametrize("keys", [["note"], ["note", 3]])
def test_a_key_bigbatch_does_not_write_is_named_with_its_file(keys, run):
    """Before: ``Snapshot.__init__() got an unexpected keyword argument``, naming no file."""
    path = rewrite(run, lambda state: state.update(dict.fromkeys(keys, 1)))
    unknown = ", ".join(map(repr, keys))
    with pytest.raises(RunMismatchError) as refused:
        resume(run)
    assert str(refused.value) == (
        f"{path}: the snapshot holds {unknown}, not a field of bigbatch's snapshots: the file is "
        "damaged or was not written by bigbatch; move it away (an older snapshot-*.pt is used "
        "then), or choose another --out."
    )


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_crafted_field_is_named_with_its_file(case, run):
    change, message = CASES[case]
    path = rewrite(run, change)
    before = {name: (run / name).read_bytes() for name in ("metrics.csv", "model.pt")}
    with pytest.raises(RunMismatchError, match=f"^{path}: the snapshot's field {message}"):
        resume(run)
    assert {name: (run / name).read_bytes() for name in before} == before  # nothing written


def test_the_command_line_says_it_in_one_line(run, capsys):
    path = rewrite(run, set_field("step", 99))
    tasks_py = os.path.join(os.path.dirname(tasks.__file__), "tasks.py")
    code = main(["train", f"{tasks_py}:classify", "--batch-size", "10", "--steps", "2",
                 "--out", str(run), "--resume", "--quiet"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"bigbatch train: error: {path}: the snapshot's field 'step' is out of")


def test_an_untouched_snapshot_resumes(run):
    """The checks refuse nothing bigbatch wrote: the finished run resumes to the same end."""
    model = torch.load(run / "model.pt")
    resume(run)
    again = torch.load(run / "model.pt")
    assert all(torch.equal(model[k], again[k]) for k in model)

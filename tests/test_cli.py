"""The command line: help that answers a newcomer, and one clear line (exit 2) for user errors."""

from __future__ import annotations

import os

import pytest

from bigbatch.app.cli import main
from bigbatch.app.resume import FORMAT

TASKS = os.path.join(os.path.dirname(__file__), "train", "tasks.py")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("train", "report", "demo"):
        assert name in out


def test_train_help_has_examples_and_every_setting(capsys):
    from bigbatch.app.config import settings

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "--resume" in out
    for name in (f.name for f in settings()):
        assert name in ("task",) or "--" + name.replace("_", "-") in out


def test_train_then_report(capsys, tmp_path):
    out_dir = str(tmp_path / "run")
    code, out, err = run(
        capsys,
        "train",
        f"{TASKS}:classify",
        "--batch-size",
        "10",
        "--micro-batch-size",
        "4",
        "--steps",
        "3",
        "--out",
        out_dir,
    )
    assert code == 0, err
    assert "final loss" in out and "samples/s" in out
    assert set(os.listdir(out_dir)) >= {"metrics.csv", "model.pt", "snapshot.pt", "summary.json"}
    code, out, err = run(capsys, "report", out_dir)
    assert code == 0, err
    assert os.path.getsize(os.path.join(out_dir, "report.png")) > 10_000
    assert "peak memory" in out and "report.png" in out


def test_config_file_and_flags_override_it(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'task = "{TASKS}:classify"\nbatch_size = 10\nsteps = 5\nquiet = true\n')
    out_dir = str(tmp_path / "run")
    code, _, err = run(capsys, "train", "--config", str(config), "--steps", "2", "--out", out_dir)
    assert code == 0, err
    with open(os.path.join(out_dir, "metrics.csv")) as f:
        assert len(f.readlines()) == 3  # header + 2 steps: the flag won


@pytest.mark.parametrize(
    "argv, line",
    [
        (["train", "no_such_module:task"], r"cannot import 'no_such_module'"),
        (["train", "tasks"], r"task 'tasks' is not of the form module:function"),
        (["train", f"{TASKS}:nope"], r"has no function 'nope'"),
        (
            ["train", f"{TASKS}:not_a_task"],
            r"returned dict, not a bigbatch.Task: end the function with",
        ),
        (
            [
                "train",
                f"{TASKS}:classify",
                "--batch-size",
                "10",
                "--micro-batch-size",
                "4",
                "--gradient-accumulation-steps",
                "2",
            ],
            r"contradict each other",
        ),
        (["train"], r"no task: give TASK"),
        (["report", "/nonexistent/run"], r"run folder '/nonexistent/run' does not exist"),
    ],
)
def test_user_errors_are_one_line(capsys, argv, line):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"bigbatch {argv[0]}: error:")
    assert __import__("re").search(line, err), err


def test_unreadable_and_unknown_config(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("batch_size = [1,\n")
    code, _, err = run(capsys, "train", f"{TASKS}:classify", "--config", str(bad))
    assert code == 2 and "is not valid TOML" in err and err.count("\n") == 1
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("micro_batch = 3\n")
    code, _, err = run(capsys, "train", f"{TASKS}:classify", "--config", str(unknown))
    assert code == 2 and "unknown setting(s) 'micro_batch'; allowed: task, batch_size" in err


def test_run_folder_of_another_run(capsys, tmp_path):
    out_dir = str(tmp_path / "run")
    common = (f"{TASKS}:classify", "--steps", "1", "--out", out_dir, "--quiet")
    assert run(capsys, "train", *common, "--batch-size", "10")[0] == 0
    code, _, err = run(capsys, "train", *common, "--batch-size", "8", "--resume")
    assert code == 2 and err.count("\n") == 1
    assert "belongs to another run (batch_size: 10 -> 8)" in err and "choose another --out" in err
    code, _, err = run(capsys, "train", *common, "--batch-size", "10")
    assert code == 2 and "already holds a run (step 1 of 1): add --resume" in err


@pytest.mark.parametrize(
    ("content", "line"),
    [
        (b"not a torch file", "is not a readable bigbatch snapshot (UnpicklingError)"),
        ({"step": 3}, "is not a bigbatch snapshot; choose another --out"),
        (
            {"format": "bigbatch-snapshot-1"},
            "was written by another version of bigbatch (bigbatch-snapshot-1; this one reads "
            f"{FORMAT}): resume it with that version",
        ),
    ],
)
def test_a_snapshot_that_cannot_be_resumed_is_one_line(capsys, tmp_path, content, line):
    import torch

    if isinstance(content, bytes):
        (tmp_path / "snapshot.pt").write_bytes(content)
    else:
        torch.save(content, tmp_path / "snapshot.pt")
    argv = ("train", f"{TASKS}:classify", "--steps", "1", "--out", str(tmp_path), "--resume")
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and line in err, err

"""The command line: help that answers a newcomer, and one clear line (exit 2) for user errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bigbatch.app.cli import main
from bigbatch.app.snapshot import FORMAT

TASKS = os.path.join(os.path.dirname(__file__), "tasks.py")


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
    from bigbatch.app.settings import settings

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "--resume" in out
    for name in (f.name for f in settings()):
        assert name in ("task",) or "--" + name.replace("_", "-") in out


@pytest.mark.needs("rich")
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
        (
            ["train", TASKS],
            r"task '.*tasks\.py' names no function: give module:function or file\.py:function, "
            r"e\.g\. .*tasks\.py:\w+ \(its functions that return a bigbatch\.Task: \w+, \w+, ",
        ),
        (["train", f"{TASKS}:nope"], r"has no function 'nope'"),
        (
            ["train", f"{TASKS}:not_a_task"],
            r"task .*: the task is a dict, not a bigbatch.Task: end the task function with",
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
    assert re.search(line, err), err


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


# ----------------------------------------------------------------------------- the first hour
def one_line(err, prog="bigbatch train"):
    """The one error line (asserted: one line, no usage block, no traceback)."""
    assert "usage:" not in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    return err.strip()


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--micro-batch-sise", "3"], "unknown flag --micro-batch-sise: did you mean --micro-batch-size?"),
        (["--learning_rate", "0.1"], "unknown flag --learning_rate: did you mean --learning-rate?"),
        (["--micro", "4"], "unknown flag --micro: did you mean --micro-batch-size?"),  # no prefixes
        (["--batch-size", "ten"], "--batch-size: 'ten' is not an integer"),
        (["--micro-batch-size", "some"], "'some' is not an integer or auto"),
        (["--lr", "fast"], "--lr/--learning-rate: 'fast' is not a number"),
        (["--precision", "fp8"], "precision='fp8' is not allowed: use one of 'fp32', 'bf16', 'fp16'."),
        (["--resume", "no"], "resume='no' is not allowed: use one of False, True, 'auto'."),
        (["--steps", "0"], "steps=0 is not allowed: use a positive integer."),
        (["--precision"], "--precision: expected one argument"),
    ],
)  # fmt: skip
def test_a_mistake_on_the_command_line_is_one_line(capsys, tmp_path, argv, line):
    code, _, err = run(capsys, "train", f"{TASKS}:classify", *argv, "--out", str(tmp_path / "r"))
    assert code == 2
    assert line in one_line(err)
    assert not (tmp_path / "r").exists()


def test_a_misspelt_subcommand_gets_the_closest(capsys):
    code, _, err = run(capsys, "trian")
    assert code == 2 and one_line(err, "bigbatch").endswith(
        "invalid choice: 'trian' (choose from 'demo', 'train', 'report', 'check', 'plan'): did "
        "you mean train?"
    )


def _metrics(out):
    import csv

    with open(os.path.join(out, "metrics.csv")) as file:
        return list(csv.DictReader(file))


def test_transformers_names_and_any_case_work(capsys, tmp_path):
    out = str(tmp_path / "run")
    argv = ["train", f"{TASKS}:classify", "--batch-size", "10", "--per-device-train-batch-size",
            "4", "--learning-rate", "0.25", "--max-steps", "2", "--lr-schedule", "Constant",
            "--precision", "FP32", "--out", out, "--quiet"]  # fmt: skip
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    rows = _metrics(out)
    assert [(r["step"], r["micro_batch_size"], r["micro_batches"]) for r in rows] == [
        ("1", "4", "3"),
        ("2", "4", "3"),
    ]
    assert float(rows[0]["lr"]) == 0.25
    auto = str(tmp_path / "auto")
    argv = ["train", f"{TASKS}:classify", "--batch-size", "10", "--micro-batch-size", "Auto",
            "--num-train-epochs", "1", "--out", auto, "--quiet"]  # fmt: skip
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    assert len(_metrics(auto)) == 5  # 50 samples, one epoch of batch 10


def test_switches_and_aliases_set_the_same_settings():
    from bigbatch.app.cli import build_parser

    def parsed(*flags):
        args = vars(build_parser().parse_args(["train", "t:f", *flags]))
        return {k: v for k, v in args.items() if k not in ("run", "command", "config", "task")}

    assert parsed("--fp16") == parsed("--precision", "fp16") == {"precision": "fp16"}
    assert parsed("--bf16") == {"precision": "bf16"}
    assert parsed("--num-train-epochs", "3") == parsed("--epochs", "3") == {"epochs": 3}
    assert parsed("--device", "CPU", "--resume", "AUTO") == {"device": "cpu", "resume": "auto"}
    assert parsed() == {}  # only the flags given override --config


def test_train_help_shows_the_defaults_and_the_optimizer(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--lr LR, --learning-rate LR learning rate", "(default 0.001)",
                  "torch.optim.AdamW(lr=--lr, betas=(0.9, 0.999), weight_decay=0.01)", "--precision {fp32,bf16,fp16} autocast precision "
                  "(default fp32)", "(default runs/bigbatch)", "--fp16 the same as --precision fp16",
                  "--micro-batch-size Auto"):  # fmt: skip
        assert words in text, words


def test_the_default_optimizer_is_the_one_help_names(capsys, tmp_path):
    """What --help says (AdamW, weight_decay=0.01, lr 0.001) is what a task without one gets."""
    from bigbatch.app.snapshot import read_snapshot

    out = tmp_path / "run"
    argv = ["train", f"{TASKS}:classify", "--steps", "1", "--out", str(out), "--quiet"]
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    snapshot = read_snapshot(str(out / "snapshot.pt"))
    assert snapshot.identity["optimizer"] == "torch.optim.adamw.AdamW"
    [group] = snapshot.optimizer["param_groups"]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (0.001, 0.01, (0.9, 0.999))


@pytest.mark.needs("rich")
def test_progress_reaches_train_log_and_stderr_when_not_a_terminal(capsys, tmp_path):
    out = tmp_path / "run"
    argv = ["train", f"{TASKS}:classify", "--batch-size", "10", "--steps", "5", "--log-every", "2",
            "--out", str(out)]  # fmt: skip
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    pattern = (r"step {}/5 \| loss \d\.\d{{4}} \| [\d,]+ samples/s \| micro-batch 10 x 1 \| "
               r"peak [\d.]+ [KMG]iB \| \d+:\d\d:\d\d left")  # fmt: skip
    lines = err.splitlines()
    assert len(lines) == 3 and all(
        re.fullmatch(pattern.format(step), line)
        for step, line in zip((2, 4, 5), lines, strict=True)
    ), err  # steps 2, 4 and the last; no bar frames
    logged = (out / "train.log").read_text().splitlines()
    assert logged[0].endswith(" started at step 0") and [line[20:] for line in logged[1:]] == lines
    code, _, err = run(capsys, *argv[:-2], "--out", str(tmp_path / "quiet"), "--quiet")
    assert code == 0 and err == ""  # --quiet: nothing on stderr, the file all the same
    assert len((tmp_path / "quiet" / "train.log").read_text().splitlines()) == 4


@pytest.mark.needs("rich")
def test_the_last_frame_on_a_terminal_is_printed_whole(capsys, tmp_path, monkeypatch):
    """On a narrow terminal the bar's text is cut to its width; when the bar ends, the last
    line is printed whole (the terminal wraps it). rich is told it writes to a terminal."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "40")
    argv = ["train", f"{TASKS}:classify", "--batch-size", "10", "--micro-batch-size", "4",
            "--steps", "3", "--out", str(tmp_path / "run")]  # fmt: skip
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err)  # the terminal's control codes
    assert "…" in plain  # the bar's frames were cut to 40 columns
    last = [line for line in plain.splitlines() if line.startswith("step 3/3 | loss ")]
    assert len(last) == 1 and " | micro-batch 4 x 3 | peak " in last[0], err
    assert last[0].endswith(" left") and len(last[0]) > 40


def test_cli_reference_is_generated_from_the_parser():
    """docs/cli.md is what tools/cli_docs.py writes (run it after changing a flag)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "tools"))
    import cli_docs

    from bigbatch.app.settings import settings

    text = cli_docs.render()
    with open(os.path.join(root, "docs", "cli.md")) as file:
        assert file.read() == text, "docs/cli.md is stale: run python tools/cli_docs.py"
    for f in settings()[1:]:
        assert re.search(f"`--{f.name.replace('_', '-')}[ ,`]", text), f.name


@pytest.mark.slow  # a real process: the exit code and stderr a shell sees
@pytest.mark.needs("rich")
def test_a_real_process_exits_2_with_one_line(tmp_path):
    src = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"
    )
    done = subprocess.run(
        [sys.executable, "-m", "bigbatch", "train", f"{TASKS}:classify", "--epoch", "2"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": src}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "bigbatch train: error: unknown flag --epoch: did you mean --epochs?\n"

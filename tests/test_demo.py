"""`bigbatch demo`: three runs, the same weights, the auto run under its budget, a plot; and the
one-line message when scikit-learn (the demo's data) is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bigbatch.cli import main
from bigbatch.demo import EXACT, run_demo

SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "src")


def test_three_runs_agree_and_auto_keeps_to_its_budget(tmp_path, capsys):
    result = run_demo(steps=4, out=str(tmp_path / "plots" / "demo.png"))
    full, accumulated, auto = result.runs
    assert max(result.differences) < EXACT  # float64 rounding: ~1e-16
    assert len(set(result.accuracies)) == 1 and result.accuracies[0] > 0.5
    assert accumulated.micro_batch_sizes == [64] * 4
    assert auto.micro_batch_size() < full.batch_size == 512
    assert auto.retries[0] >= 1  # the full batch went over the budget and was redone smaller
    assert auto.peak_bytes() <= result.budget_bytes < full.peak_bytes()
    assert accumulated.peak_bytes() < full.peak_bytes()
    assert result.exact()
    assert os.path.getsize(result.plot_path) > 0
    out = capsys.readouterr().out
    assert "Same result" in out and "auto" in out and "demo.png" in out


def test_cli_demo_exits_0_and_writes_the_plot(tmp_path, capsys):
    png = tmp_path / "demo.png"
    assert main(["demo", "--steps", "2", "--batch-size", "256", "--out", str(png)]) == 0
    assert png.exists()
    assert "Same result" in capsys.readouterr().out


def test_demo_help_says_what_it_does(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for word in ("full batch", "accumulated", "auto", "--steps", "--out", "digit images"):
        assert word in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--steps", "1"], "steps=1 is too few: use 2 or more"),
        (["--batch-size", "100"], "batch_size=100 is not allowed: use 256 to 1400"),
        (["--micro-batch-size", "0"], "micro_batch_size=0 is not allowed: use 1 to the batch"),
    ],
)
def test_bad_settings_are_one_line(capsys, argv, match):
    assert main(["demo", *argv]) == 2
    assert match in capsys.readouterr().err


def test_without_scikit_learn_one_line_says_what_to_install():
    # sys.modules[name] = None makes `import sklearn` raise ImportError: a real import failure.
    code = "import sys; sys.modules['sklearn'] = None; from bigbatch.cli import main; sys.exit(main(['demo']))"
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install scikit-learn" in lines[0], proc.stderr

"""`bigbatch demo`: three runs, the same weights, the auto run under its budget, a plot; and the
one-line message when scikit-learn (the demo's data) is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import forks
import pytest

from bigbatch.app.cli import main
from bigbatch.app.demo import EXACT

SRC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"
)


# Each run is a fresh process: resident-set readings in a process that earlier tests fragmented
# are not the demo's (STYLE.md rule 21: real processes).
CHILD = """
import json, sys
from bigbatch.app.demo import run_demo
r = run_demo(steps=4, out=sys.argv[1])
full, accumulated, auto = r.runs
print(json.dumps(dict(
    differences=r.differences, accuracies=r.accuracies, budget=r.budget_bytes, exact=r.exact(),
    sizes=[x.micro_batch_sizes for x in r.runs], retries=auto.retries,
    peaks=[x.peak_bytes() for x in r.runs], plot=r.plot_path)))
"""


def run_child(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.slow  # a child process
@pytest.mark.needs("rich", "matplotlib", "sklearn")
def test_three_runs_agree_and_auto_keeps_to_its_budget(tmp_path):
    done = run_child("-c", CHILD, str(tmp_path / "plots" / "demo.png"))
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.strip().splitlines()[-1])
    full_peak, accumulated_peak, auto_peak = r["peaks"]
    assert max(r["differences"]) < EXACT  # float64 rounding: ~1e-16
    assert len(set(r["accuracies"])) == 1 and r["accuracies"][0] > 0.5
    assert r["sizes"][:2] == [[512] * 4, [64] * 4]
    assert max(r["sizes"][2]) < 512
    assert r["retries"][0] >= 1  # the full batch went over the budget and was redone smaller
    assert auto_peak <= r["budget"] < full_peak
    assert accumulated_peak < full_peak
    assert r["exact"] and os.path.getsize(r["plot"]) > 0
    assert "Same result" in done.stdout


@pytest.mark.slow  # a child process
@pytest.mark.needs("rich", "matplotlib", "sklearn")
def test_cli_demo_exits_0_and_writes_the_plot(tmp_path):
    png = tmp_path / "demo.png"  # forked (torch imported once): the test reads no peaks
    argv = ["-m", "bigbatch", "demo", "--steps", "2", "--batch-size", "256", "--out", str(png)]
    done = forks.run(argv, env={**os.environ, "PYTHONPATH": SRC}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert png.exists() and "Same result" in done.stdout


def test_demo_help_says_what_it_does(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for word in ("full batch", "accumulated", "auto", "--steps", "--out", "digit images"):
        assert word in out


@pytest.mark.needs("sklearn")
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


@pytest.mark.slow  # a child process
def test_without_scikit_learn_one_line_says_what_to_install():
    # sys.modules[name] = None makes `import sklearn` raise ImportError: a real import failure.
    code = "import sys; sys.modules['sklearn'] = None; from bigbatch.app.cli import main; sys.exit(main(['demo']))"
    proc = run_child("-c", code)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install scikit-learn" in lines[0], proc.stderr

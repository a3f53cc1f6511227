"""``@pytest.mark.alone`` (tests/alone.py): in a real ``pytest -n 2`` run of its own, the alone
test's run overlaps no other test's, while the other tests do run beside each other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CASES = """
import os, time, pytest

def _log(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open(os.environ["INTERVALS"], "a") as f:
        f.write(f"{name} {start} {time.time()}\\n")

@pytest.mark.alone
def test_alone():
    _log("alone", 1.0)

@pytest.mark.parametrize("i", range(8))
def test_beside(i):
    _log(f"beside{i}", 0.3)
"""


@pytest.mark.slow  # a pytest of its own, with two workers
def test_an_alone_test_runs_with_no_other_test_beside_it(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    (tmp_path / "conftest.py").write_text("from alone import pytest_runtest_protocol  # noqa\n")
    (tmp_path / "test_cases.py").write_text(CASES)
    intervals = tmp_path / "intervals.txt"
    env = {**os.environ, "PYTHONPATH": str(TESTS), "INTERVALS": str(intervals)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
         "-o", "markers=alone: one at a time", "--rootdir", str(tmp_path), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    runs = {
        n: (float(a), float(b))
        for n, a, b in (x.split() for x in intervals.read_text().splitlines())
    }
    assert len(runs) == 9, runs
    a0, a1 = runs.pop("alone")
    assert all(b <= a0 or a >= a1 for a, b in runs.values()), (a0, a1, runs)
    beside = sorted(runs.values())
    assert any(b[0] < a[1] for a, b in zip(beside, beside[1:], strict=False)), (
        beside
    )  # two workers at work

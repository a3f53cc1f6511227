"""The code-quality gates of STYLE.md rules 18, 19 and 22: size budget, ruff, mypy.

tools/size.py covers the whole package. ``ruff check`` and ``ruff format --check`` run over every
Python file of the project (LINTED), mypy over the package (TYPED, untyped definitions refused).
They are skipped, saying why, where the tools are not installed (``pip install -e ".[test]"``
installs them).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import size  # noqa: E402  (tools/ is not a package)

pytestmark = pytest.mark.slow  # ruff, mypy and tools/size.py run as child processes

# Every Python file of the project: the package (also type-checked), its tests, benchmarks,
# examples and tools. A new file is checked from the day it is added.
LINTED = ["src", "tests", "benchmarks", "examples", "tools"]
TYPED = ["src/bigbatch"]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_size_budget_passes() -> None:
    done = _run(sys.executable, str(ROOT / "tools" / "size.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "engine.py" in done.stdout and "public names:" in done.stdout


def test_code_lines_leave_out_docstrings_comments_and_blank_lines() -> None:
    source = (
        '"""Module docstring\nover two lines."""\n\nX = 1  # a comment\n# only a comment\n\n'
        'def f(a):\n    """Doc."""\n    return (a +\n            1)\n'
    )
    assert sorted(size.code_lines(source)) == [4, 7, 9, 10]
    assert size.functions(source) == [("f", 7, 10)]


def test_size_names_what_is_over_a_cap(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "__init__.py").write_text(
        "__all__ = [" + ", ".join(f"'n{i}'" for i in range(26)) + "]\n"
    )
    (tmp_path / "engine.py").write_text(f"def long():\n{body}\n" + "y = 0\n" * 300)
    problems = size.violations(tmp_path)
    assert any("engine.py: 362 code lines, over the cap of 300" in p for p in problems)
    assert any("long() has 62 code lines, over the cap of 60" in p for p in problems)
    assert any("__all__ has 26 names, over the cap of 25" in p for p in problems)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install ruff)")
def test_ruff_check() -> None:
    done = _run("ruff", "check", *LINTED)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install ruff)")
def test_ruff_format() -> None:
    done = _run("ruff", "format", "--check", *LINTED)
    assert done.returncode == 0, (
        done.stdout + done.stderr + "\nrun: ruff format src/bigbatch/<module>"
    )


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install mypy)"
)
def test_mypy() -> None:
    done = _run(sys.executable, "-m", "mypy", *TYPED)
    assert done.returncode == 0, done.stdout + done.stderr

"""tools/size.py's own behaviour: what counts as a code line, what is over a cap.

The gates themselves (tools/size.py on the package, ruff check, ruff format --check, mypy) are
not pytest items: CI runs them after the suite (``.ci/run``, and ``tools/gates.sh`` by hand).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import size  # noqa: E402  (tools/ is not a package)


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
        "__all__ = [" + ", ".join(f"'n{i}'" for i in range(size.PUBLIC_NAMES_HARD + 1)) + "]\n"
    )
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "engine.py").write_text(f"def long():\n{body}\n" + "y = 0\n" * 300)
    problems = size.violations(tmp_path)
    assert any("core/engine.py: 362 code lines, over the cap of 300" in p for p in problems)
    assert any("long() has 62 code lines, over the cap of 40" in p for p in problems)
    cap = size.PUBLIC_NAMES_HARD
    assert any(f"__all__ has {cap + 1} names, over the cap of {cap}" in p for p in problems)

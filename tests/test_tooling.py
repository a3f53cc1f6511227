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


def test_size_counts_the_code_as_ruff_format_writes_it(tmp_path: Path) -> None:
    # a call packed on one line with a marker counts as the lines ruff format gives it
    packed = "def f(a, b):\n    return g(aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa, bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb, cccccccccccccccccccccccccccccc, d=1)  # fmt: skip\n"
    (tmp_path / "__init__.py").write_text("__all__ = []\n")
    (tmp_path / "m.py").write_text(packed)
    modules, funcs = size.measure(tmp_path)
    assert dict(modules)["m.py"] == 7  # def, return g(, the four arguments, )
    assert size.fmt_markers(tmp_path) == ["m.py:2"]
    (tmp_path / "n.py").write_text("X = 1  # fmt: skip\n" * (size.FMT_SKIP_HARD + 1))
    assert any("fmt markers, over the cap" in p for p in size.violations(tmp_path))

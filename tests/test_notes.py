"""Every ``Note [name]`` holds (STYLE.md rule 14), read from the source with ``ast`` and ``re``.

A definition is a line of a docstring that is exactly ``Note [name]`` (indented or not), followed
by its paragraph, indented deeper. A reference is ``Note [name]`` anywhere else: in code, a
comment, another docstring, the package's READMEs, docs/*.md, README.md or CONTRIBUTING.md. A
name may wrap across a line break inside its brackets (whitespace is normalised), but ``Note [``
stays on one line, so that ``grep 'Note \\['`` finds every reference. Every reference names
exactly one definition, and every definition is referenced at least once: a Note nobody points
to is read by nobody at the moment it matters.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "bigbatch"
SOURCES = sorted(PACKAGE.rglob("*.py"))
TEXTS = sorted(
    [*PACKAGE.rglob("*.md"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    + [ROOT / "CONTRIBUTING.md"]
)
NOTE = re.compile(r"\bNote\s+\[([^\[\]]*)\]")
DEFINITION = re.compile(r"[ \t]*Note \[([^\[\]]+)\][ \t]*")
INTERVAL = re.compile(r"[\[(]-?[\w.]+, -?[\w.]+[\])]")  # (0, 1], [0, 1)


def _docstring_lines(source: str) -> set[int]:
    """Line numbers inside a bare string statement (a docstring, as tools/size.py counts them)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def _scan() -> tuple[dict[str, list[str]], list[tuple[str, str]], list[str], list[str]]:
    """``(definitions: name -> where, references: (name, where), Notes split before their [,
    definitions without their paragraph)``, ``where`` as ``path:line``."""
    definitions: dict[str, list[str]] = defaultdict(list)
    references: list[tuple[str, str]] = []
    split: list[str] = []
    bare: list[str] = []
    for path in [p for p in SOURCES + TEXTS if p.is_file()]:
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        docstrings = _docstring_lines(text) if path.suffix == ".py" else set()
        for match in NOTE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            name = " ".join(match.group(1).split())
            if "\n" in text[match.start() : match.start(1)]:
                split.append(where)
            if line in docstrings and DEFINITION.fullmatch(lines[line - 1]):
                definitions[name].append(where)
                if not _indented_paragraph(lines, line):
                    bare.append(where)
            else:
                references.append((name, where))
    return definitions, references, split, bare


def _unbalanced() -> list[str]:
    """Docstring paragraphs that name a Note and do not close their parentheses: what a splice
    leaves (one half of a Note glued to another opens a parenthesis or closes one never opened).
    Intervals such as ``[0, 1)`` are not parentheses."""
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                text = node.value.value if isinstance(node.value.value, str) else ""
                start = 0
                for paragraph in re.split(r"\n[ \t]*\n", text):
                    start = text.index(paragraph, start)
                    line = node.lineno + text.count("\n", 0, start)
                    plain = INTERVAL.sub("", paragraph)
                    if "Note [" in plain and plain.count("(") != plain.count(")"):
                        found.append(f"{path.relative_to(ROOT)}:{line}: {paragraph[:60]!r}")
    return found


def _indented_paragraph(lines: list[str], line: int) -> bool:
    """The definition on ``line`` (1-based) is followed by a line indented deeper than it."""
    if line >= len(lines) or not lines[line].strip():
        return False
    indent = len(lines[line - 1]) - len(lines[line - 1].lstrip())
    return len(lines[line]) - len(lines[line].lstrip()) > indent


DEFINITIONS, REFERENCES, SPLIT, BARE = _scan()


def test_the_scan_finds_the_notes():
    """The scan itself works: the engine's Notes are found, defined and referenced."""
    assert len(DEFINITIONS) > 50 and len(REFERENCES) > 100
    assert DEFINITIONS["window normalisation"] and "window normalisation" in dict(REFERENCES)


def test_every_reference_names_exactly_one_definition():
    """``Note [x]`` points to one Note: not elided (``...``), not misspelt, not ambiguous."""
    wrong = [
        f"{where}: Note [{name}] is defined {len(DEFINITIONS.get(name, []))} times"
        for name, where in REFERENCES
        if len(DEFINITIONS.get(name, [])) != 1
    ]
    assert not wrong, "\n".join(wrong)


def test_every_definition_is_unique_and_referenced():
    """A Note is defined once and referenced at least once, from code, a docstring or the docs."""
    referenced = {name for name, _ in REFERENCES}
    twice = [f"Note [{n}] defined at {', '.join(w)}" for n, w in DEFINITIONS.items() if len(w) > 1]
    unread = [
        f"Note [{n}] ({w[0]}) is never referenced"
        for n, w in DEFINITIONS.items()
        if n not in referenced
    ]
    assert not twice + unread, "\n".join(twice + unread)


def test_notes_are_whole_and_greppable():
    """A definition has its indented paragraph, and ``Note [`` is never split across lines."""
    assert not BARE, f"Note definitions without an indented paragraph: {BARE}"
    assert not SPLIT, f"'Note' and its '[' on different lines (grep cannot find them): {SPLIT}"


def test_paragraphs_naming_notes_close_their_parentheses():
    """No Note is spliced into another: a docstring paragraph that defines or names a Note
    closes every parenthesis it opens."""
    unbalanced = _unbalanced()
    assert not unbalanced, "\n".join(unbalanced)

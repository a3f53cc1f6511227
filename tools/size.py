"""Code-line budget of the package (STYLE.md rules 1-3, 9, 22): print sizes, fail above the caps.

"Code lines" leave out docstrings (any bare string statement), comments and blank lines, and are
counted as ``ruff format`` writes the code: the package is copied, its ``# fmt: skip`` / ``# fmt:
off`` markers are taken out and the copy is formatted with the project's own settings before it is
counted, so a line packed by hand counts as the lines it formats to. ``# fmt: skip`` stays for
tables that read better aligned, each with its reason on the line, at most ``FMT_SKIP_HARD`` of them.

Run: python tools/size.py            modules, and the functions over the soft budget
     python tools/size.py --all      every function too

Exits 1, naming each offender, when a module, function or the public API is over its hard cap.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "bigbatch"
MODULE_SOFT, MODULE_HARD = 300, 500
FUNCTION_SOFT, FUNCTION_HARD = 30, 40
# The package total is a ratchet at what is reached, counted as ruff format writes the code
# (issue 36: 7,573 formatted lines when the count stopped trusting packed lines, against 6,735
# counted as packed; the renovation's own cost, +127, re-based it at 7,700). Round 5 adds what its
# issues add (37: the LM path's mends, <= 350; 38: packing and the ledger, <= 450; 39: DeepSpeed
# and count groups, <= 300: +333 with its audit under DeepSpeed, ZeRO 3's chunked head and
# Lightning's DeepSpeed refused, the 33 over said in its closing note), and +1 for the planner's
# choice that a CI run found following timing noise. Lower it as code goes; raise it only by an
# issue's allowance.
PACKAGE_SOFT, PACKAGE_HARD = 4800, 8970
FMT_SKIP_HARD = 10  # "# fmt: skip" for tables that read better aligned, with their reason
PUBLIC_NAMES_HARD = 26  # issue 31 names one more: bigbatch.head_cross_entropy (STYLE.md: target 25)
MODULE_CAPS = {"core/engine.py": 300}  # the engine stays small enough to read in one sitting
FUNCTION_CAPS: dict[tuple[str, str], int] = {}  # none: fit() fits the common cap now
# Over a hard cap when the budget landed, to be split; none left (cli._add_train was generated
# from TrainConfig's settings in round 2). Each may shrink, not grow.
KNOWN_OVER: dict[tuple[str, str], int] = {}


def code_lines(source: str) -> set[int]:
    """Line numbers holding code: not blank, not only a comment, not part of a docstring."""
    lines: set[int] = set()
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
        tokenize.ENCODING,
    }
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                lines.difference_update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def functions(source: str) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, last line)`` of every function, methods as ``Class.name``."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((name, child.lineno, child.end_lineno or child.lineno))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def public_names(init: Path) -> list[str]:
    """The names listed in ``__all__`` of ``init`` (read, not imported)."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    return []


MARKER = re.compile(r"[ \t]*# fmt: (skip|off|on)\b.*$", re.MULTILINE)


def fmt_markers(package: Path) -> list[str]:
    """``module:line`` of every ``# fmt: skip`` / ``off`` / ``on`` marker in ``package``."""
    return [
        f"{path.relative_to(package).as_posix()}:{n}"
        for path in sorted(package.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if MARKER.search(line)
    ]


def formatted(package: Path, into: Path) -> Path:
    """A copy of ``package`` under ``into``, its fmt markers taken out, as ``ruff format`` writes
    it with the repository's ``pyproject.toml`` (what the budget counts)."""
    copy = into / package.name
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for path in copy.rglob("*.py"):
        path.write_text(MARKER.sub("", path.read_text()))
    config = ROOT / "pyproject.toml"
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        sys.exit("tools/size.py counts the code as ruff formats it: pip install ruff")
    subprocess.run([ruff, "format", "--quiet", "--config", str(config), str(copy)], check=True)
    return copy


def measure(package: Path) -> tuple[list[tuple[str, int]], list[tuple[str, str, int]]]:
    """Code lines per module (relative path) and per function ``(module, function, lines)``, of
    ``package`` as ``ruff format`` writes it (``formatted``)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _measure(formatted(package, Path(tmp)))


def _measure(package: Path) -> tuple[list[tuple[str, int]], list[tuple[str, str, int]]]:
    modules, funcs = [], []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        source = path.read_text()
        lines = code_lines(source)
        modules.append((rel, len(lines)))
        for name, first, last in functions(source):
            funcs.append((rel, name, len([n for n in lines if first <= n <= last])))
    return modules, funcs


def violations(package: Path) -> list[str]:
    """One message per hard cap exceeded."""
    modules, funcs = measure(package)
    found = []
    for rel, n in modules:
        cap = MODULE_CAPS.get(rel, MODULE_HARD)
        if n > cap:
            found.append(f"{rel}: {n} code lines, over the cap of {cap}: split it by job.")
    for rel, name, n in funcs:
        short = name.rsplit(".", 1)[-1]
        cap = FUNCTION_CAPS.get((rel, short), FUNCTION_HARD)
        if n > cap and n <= KNOWN_OVER.get((rel, short), 0):
            print(f"known: {rel}: {name}() has {n} code lines, over the cap of {cap} (to be split)")
        elif n > cap:
            found.append(
                f"{rel}: {name}() has {n} code lines, over the cap of {cap}: extract steps."
            )
    total = sum(n for _, n in modules)
    if total > PACKAGE_HARD:
        found.append(f"the package has {total} code lines, over the cap of {PACKAGE_HARD}.")
    markers = fmt_markers(package)
    if len(markers) > FMT_SKIP_HARD:
        found.append(
            f"{len(markers)} fmt markers, over the cap of {FMT_SKIP_HARD} (for aligned tables "
            f"only): {', '.join(markers[:5])}..."
        )
    names = public_names(package / "__init__.py")
    if len(names) > PUBLIC_NAMES_HARD:
        found.append(
            f"bigbatch.__all__ has {len(names)} names, over the cap of {PUBLIC_NAMES_HARD}."
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--all", action="store_true", help="print every function, not only long ones"
    )
    args = parser.parse_args(argv)
    modules, funcs = measure(PACKAGE)
    print(
        f"{'code lines':>10}  module (soft {MODULE_SOFT}, hard {MODULE_HARD}; core/engine.py "
        f"{MODULE_CAPS['core/engine.py']})"
    )
    for rel, n in modules:
        print(f"{n:>10}  {rel}{'  (over soft budget)' if n > MODULE_SOFT else ''}")
    total = sum(n for _, n in modules)
    print(f"{total:>10}  total (soft budget {PACKAGE_SOFT}, hard {PACKAGE_HARD})")
    shown = [f for f in funcs if args.all or f[2] > FUNCTION_SOFT]
    print(
        f"\n{'code lines':>10}  function ({'all' if args.all else f'over the soft budget of {FUNCTION_SOFT}'}; hard {FUNCTION_HARD})"
    )
    for rel, name, n in sorted(shown, key=lambda f: -f[2]):
        print(f"{n:>10}  {rel}: {name}")
    print(f"\npublic names: {len(public_names(PACKAGE / '__init__.py'))} (cap {PUBLIC_NAMES_HARD})")
    print(f"fmt markers: {len(fmt_markers(PACKAGE))} (cap {FMT_SKIP_HARD})")
    problems = violations(PACKAGE)
    for problem in problems:
        print(f"OVER: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

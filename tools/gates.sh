#!/usr/bin/env bash
# The code-quality gates (STYLE.md rules 18, 19 and 22), run by CI after the test suite:
# the size budget, ruff check, ruff format --check over every Python file, mypy over the package.
set -euo pipefail
cd "$(dirname "$0")/.."
linted=(src tests benchmarks examples tools)
echo "+ python tools/size.py" && python tools/size.py | tail -n 3
echo "+ ruff check" && ruff check "${linted[@]}"
echo "+ ruff format --check" && ruff format --check "${linted[@]}" || {
    echo "run: ruff format <file>"; exit 1; }
echo "+ mypy src/bigbatch" && python -m mypy src/bigbatch

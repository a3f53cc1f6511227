"""Collection at the project's root: under ``--doctest-modules`` a module of the package that
imports an optional extra is skipped where the extra is not installed (the suite runs with torch
alone; tests/conftest.py skips the tests that need an extra), and where it has no example to run
(collecting it would only import the extra in every test worker: Lightning's import, with
torchmetrics', takes ~5 s; the tests that use it import it)."""

import importlib.util
import os
import sys

# One OpenMP thread in every process of the suite (the tests' and their children's, set before
# torch is imported): pytest -n 2 runs one test process per core, and threads that outnumber
# the cores spin against each other (tests/conftest.py sets torch's count per test too).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Bytecode cached (__pycache__, git-ignored) where the environment turned it off: every child
# process of the suite would compile bigbatch again, and every test worker rewrite the tests.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

NEEDS_EXTRA = {
    "hf.py": "transformers", "integrations/hf.py": "transformers",
    "lightning.py": "lightning", "integrations/lightning.py": "lightning",
    "keras.py": "keras", "integrations/keras.py": "keras",
}  # fmt: skip


def pytest_ignore_collect(collection_path, config):
    try:
        parts = collection_path.relative_to(config.rootpath).parts
    except ValueError:
        return None
    if parts[:2] != ("src", "bigbatch"):
        return None
    extra = NEEDS_EXTRA.get("/".join(parts[2:]))
    if extra is None:
        return None
    lines = collection_path.read_text().splitlines()
    examples = [line for line in lines if ">>>" in line and "+SKIP" not in line]
    return importlib.util.find_spec(extra) is None or not examples or None

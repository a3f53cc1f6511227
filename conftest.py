"""Collection at the project's root: under ``--doctest-modules`` a module of the package that
imports an optional extra is skipped where the extra is not installed (the suite runs with torch
alone; tests/conftest.py skips the tests that need an extra)."""

import importlib.util

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
    return (extra is not None and importlib.util.find_spec(extra) is None) or None

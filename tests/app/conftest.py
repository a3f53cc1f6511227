"""Fixtures shared by the trainer's fault tests."""

from __future__ import annotations

import pytest
import runs


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """The run folder of ``tasks.killable`` trained by the CLI, never interrupted (``runs.argv``)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    done = runs.run(runs.argv(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out

"""``@pytest.mark.alone``, in the suite's one ``pytest -n 2`` run (the hook, imported by
``conftest.py``; tests/test_alone.py runs it in a pytest of its own)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest

try:
    import fcntl
except ImportError:  # not POSIX: no workers beside each other to keep apart
    fcntl = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``@pytest.mark.alone``: the test runs with no other test running beside it, in the same
    ``pytest -n 2`` run (it reads time or resident-set peaks, which a test in the other worker
    moves). Two file locks shared by the workers: every test passes a gate and holds the work
    lock shared; an ``alone`` test holds the gate, so that no new test starts, then the work
    lock alone, once the test running beside it has ended."""
    with _turn(item.get_closest_marker("alone") is not None, item.config):
        yield


@contextlib.contextmanager
def _turn(alone, config):
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None or fcntl is None:
        yield
        return
    factory = getattr(config, "_tmp_path_factory", None)  # the workers' common folder
    shared = factory.getbasetemp().parent if factory else Path(tempfile.gettempdir())
    with open(shared / f"gate-{run}", "a") as gate, open(shared / f"work-{run}", "a") as work:
        fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(work, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # the files' locks go with their closing

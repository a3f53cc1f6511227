"""Real filesystems for the tests: a small tmpfs that fills up, a remount read-only (both need
root; the test is skipped where mounting is refused)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "4m"):
    """A small tmpfs mounted at ``path`` for the block: a real filesystem that fills up (the
    test is skipped where mounting is refused, i.e. not root)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def read_only(path: Path) -> None:
    """Remount the tmpfs at ``path`` read-only."""
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)

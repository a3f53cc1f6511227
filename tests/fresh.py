"""Run a test module's function in a new Python process and read back its result.

CPU peak readings are resident-set high-water marks, and a process that earlier tests have used
(large allocations move glibc's dynamic mmap threshold and leave free heap behind) reads peaks
that a user's fresh process would not; a new process reads them as a user's would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def in_a_fresh_process(module: Path, call: str, out: Path, forked: bool = False) -> object:
    """Evaluate ``<module>.<call>`` (e.g. ``"train_under(123)"``) of the test module at path
    ``module`` in a new process with its folder, ``tests`` and ``src`` on its path; return what it
    returned (through ``out``).
    ``forked``: for what reads no peaks (timings, choices), a child of the suite's fork server
    (``forks``), which has imported torch already (~4 s less per child)."""
    code = f"import torch, {module.stem} as m; torch.save(m.{call}, {str(out)!r})"
    path = [str(HERE.parent / "src"), str(HERE), str(module.resolve().parent)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if forked:
        import forks

        script = out.with_suffix(".py")
        script.write_text(code + "\n")
        done = forks.run([str(script)], env=env, timeout=600)
    else:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)

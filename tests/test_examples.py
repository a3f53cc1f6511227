"""Every script in examples/ runs to completion (each checks its own claim where it makes one), in
a child forked from the test worker's fork server (``forks.py``: a process of its own, without a
new interpreter's two seconds of importing torch)."""

from __future__ import annotations

import os
from pathlib import Path

import forks
import pytest

pytestmark = pytest.mark.slow  # each example runs in a child process

ROOT = Path(__file__).resolve().parents[1]
# keras_fit.py needs Keras and runs as a slow test in test_keras.py
EXAMPLES = sorted(
    p.name
    for p in (ROOT / "examples").glob("*.py")
    if p.name not in ("ddp_torchrun.py", "keras_fit.py")
)
NEEDS = {
    "causal_lm.py": "transformers",
    "chunked_head.py": "transformers",
    "hf_trainer.py": "transformers",
    "packing.py": "transformers",
}
# What each example prints once it has checked its claim (most print their steps).
SAYS = {"hf_trainer.py": "bigbatch.integrations.hf.Trainer: exact=True"}


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name: str) -> None:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    env["OMP_NUM_THREADS"] = "1"
    done = forks.run([str(ROOT / "examples" / name)], env, timeout=180, cwd=str(ROOT))
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    assert SAYS.get(name, "step 0") in done.stdout

"""``cached_loss`` with ``micro_batch_size="auto"`` recovers from a real out-of-memory error.

The child (``cached_oom_child.py``) runs under ``RLIMIT_DATA``; the CPU allocator's failure is a
real ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory"). The whole batch of 48 runs
first as the plain loss (one piece, with a graph) and fails; then, by the margin:

* 42 MiB: pass 1 of 24 + 24 (no graph) fails too, and 12 at a time completes;
* 62 MiB: pass 1 of 24 + 24 fits but pass 2's backward fails, and 12 at a time completes.

Either way the step equals the plain full-batch step computed before the limit (float64). The
child fixes glibc's mmap threshold: with the default, dynamic one, a freed 1 MiB block raises the
threshold and later blocks come from a heap that never shrinks, so the limit's headroom drifts
(the margins were measured to sit in the middle of the ranges that give these failures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from seeds import seed_for

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"


def _run_child(margin_mib: int) -> dict:
    seed = seed_for("tests/losses/test_cached_oom.py")
    print(f"cached oom child seed={seed}")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]),
        "MALLOC_ARENA_MAX": "2",
        "MALLOC_MMAP_THRESHOLD_": "65536",  # see the module docstring
    }
    config = json.dumps({"n": 48, "margin_mib": margin_mib, "seed": seed})
    child = Path(__file__).with_name("cached_oom_child.py")
    proc = subprocess.run([sys.executable, str(child), config], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "margin_mib,second_failure",
    [(42, {"size": 24, "graph": False}), (62, {"size": None, "graph": "backward"})],
    ids=["pass 1", "pass 2"],
)
def test_real_oom_in_either_pass_recovers_exactly(margin_mib, second_failure):
    out = _run_child(margin_mib)
    assert out["error_to_full_batch"] < 1e-10, out
    assert (out["micro_batch_size"], out["micro_batches"], out["oom_retries"]) == (12, 4, 2), out
    real = {"oom": True, "type": "RuntimeError"}
    assert out["events"] == [{"size": 48, "graph": True, **real}, {**second_failure, **real}], out

"""``micro_batch_tokens="auto"`` survives a real out-of-memory error (issue 22 item 1): in a child
process under RLIMIT_DATA (``tokens_oom_child.py``), the whole window of variable-length text does
not fit; the token budget shrinks, the window is redone, and the step equals the full batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from seeds import seed_for

TESTS = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a child process under a memory limit


def test_auto_token_budget_recovers_from_a_real_allocator_failure():
    config = {"seed": seed_for("tests/core/test_tokens_oom.py"), "margin_mib": 160}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)]),
        "MALLOC_ARENA_MAX": "2",
    }
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("tokens_oom_child.py")), json.dumps(config)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["oom_retries"] >= 1 and out["budget"] < out["whole"], out
    assert out["tokens"] == out["real_tokens"] and out["micro_batches"] > 1, out
    assert out["equal_to_same_budget"], out  # bitwise: the failed tries left nothing behind
    assert out["error_to_full_batch"] < 1e-10, out

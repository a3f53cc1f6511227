"""``bigbatch train`` on a ``cached_loss`` task, SIGKILLed mid-window and resumed: bitwise equal.

The machinery of ``test_resume.py`` (a child that stops itself, a real SIGKILL, ``--resume``,
``model.pt`` compared bitwise and ``metrics.csv`` row by row) on ``cached_tasks.killable``: a
two-tower model with dropout whose InfoNCE is accumulated exactly. Batch 10 at micro-batch 4 is
3 micro-batches, each encoded twice (pass 1 without a graph, pass 2 replaying its random state):
6 encodes per step, 60 in the 10 steps; snapshots after steps 3, 5, 6, 9 and 10.
"""

from __future__ import annotations

import pytest
from runs import HERE, argv, assert_same_run, kill_when_stopped, snapshot_step, train_ok

CACHED = HERE / "cached_tasks.py"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    train_ok(argv(out, tasks=CACHED))
    return out


KILL_POINTS = {
    # encode 23 = pass 2's second micro-batch of step 4 (19-21 pass 1, 22-24 pass 2): redo from 3
    "pass 2 of a window": (23, 3),
    # encode 32 = pass 1's second micro-batch of step 6, just after the end-of-epoch snapshot
    "pass 1 of a window": (32, 5),
}


@pytest.mark.slow
@pytest.mark.parametrize("point", KILL_POINTS, ids=list(KILL_POINTS))
def test_sigkill_mid_window_then_resume_is_bitwise_equal(point, tmp_path, uninterrupted):
    stop_at, snapshot = KILL_POINTS[point]
    out, calls = tmp_path / "run", tmp_path / "calls.log"
    stop = {"KILL_LOG": str(calls), "STOP_AT": str(stop_at)}
    kill_when_stopped(argv(out, tasks=CACHED), tmp_path / "err", **stop)
    assert calls.read_text().split()[-1] == str(stop_at)  # killed where intended
    assert snapshot_step(out) == snapshot
    train_ok(argv(out, "--resume", tasks=CACHED))
    assert_same_run(out, uninterrupted)

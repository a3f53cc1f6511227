"""A real ``torchrun --nproc_per_node 2`` job (gloo) equals the same script on one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # real torchrun ranks

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"


def _run(args: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _torchrun(nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """One plain process and one torchrun job, each training at every micro-batch size."""
    tmp, child = tmp_path_factory.mktemp("torchrun"), str(HERE / "torchrun_child.py")
    sizes = "2,auto"
    one = _run([sys.executable, child, str(tmp / "one.pt"), "6", sizes], tmp / "one.pt")
    two = _run([*_torchrun(2), child, str(tmp / "two.pt"), "6", sizes], tmp / "two.pt")
    return one, two


@pytest.mark.xdist_group("torchrun")  # one worker runs the two jobs for both rows
@pytest.mark.parametrize("micro_batch_size", ["2", "auto"])
def test_torchrun_two_ranks_equal_one_process(jobs, micro_batch_size):
    one, two = (job[micro_batch_size] for job in jobs)
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert len(two["losses"]) == 8  # 20 samples at a global 6: 6 + 6 + 6 + 2, two epochs
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-10)
    for name, value in one["state"].items():
        assert torch.allclose(two["state"][name], value, rtol=1e-10, atol=0), name

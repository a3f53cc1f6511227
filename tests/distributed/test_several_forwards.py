"""Several forwards, then their backwards, on 2 real gloo ranks (Note [several forwards]).

accelerate supports and tests this pattern (``test_distributed_sync_multiple_fwd``). With DDP the
forward under ``micro_batch(last=True)`` would make the first backward that follows all-reduce
with only its own micro-batch's gradient (23% off, measured before the fix). The engine notices
the pattern and synchronises once, at step time: the result equals single-process full-batch
training on the union of the ranks' data, in float64, with unequal shares (10 = 4+4+2 and 7 = 4+3).
"""

from __future__ import annotations

import pytest
import torch
from cases import OPTIMIZERS, SAMPLES, cat
from models import classification_batch, mean_ce, mlp
from ranks import run_ranks
from reference import full_batch_step, max_relative_error
from torch.nn.parallel import DistributedDataParallel as DDP

import bigbatch

pytestmark = pytest.mark.slow
STEPS, MICRO = 3, 4


def _windows(seed: int, dtype: torch.dtype) -> list[list]:
    gen = torch.Generator().manual_seed(seed)
    return [[classification_batch(n, dtype, gen) for n in SAMPLES] for _ in range(STEPS)]


RUNS = [("fp32", name, 7) for name in OPTIMIZERS] + [("bf16", "adamw", 8)]


def _rank(rank: int, world_size: int) -> dict:
    """Every run, one after the other, on the same two ranks (one spawn for the module)."""
    return {run: _train(rank, *run) for run in RUNS}


def _train(rank: int, precision: str, opt_name: str, seed: int) -> dict:
    dtype = torch.float64 if precision == "fp32" else torch.float32
    model = DDP(mlp(dtype))
    acc = bigbatch.Accumulator(model, OPTIMIZERS[opt_name](model.parameters()), precision=precision)
    for window in _windows(seed, dtype):
        pieces = bigbatch.split(window[rank], MICRO)
        outputs = []
        for i, piece in enumerate(pieces):  # every forward first ...
            with acc.micro_batch(last=i == len(pieces) - 1):
                outputs.append((mean_ce(model, piece) * len(piece[1]), len(piece[1])))
        for loss_sum, count in outputs:  # ... then every backward, outside the contexts
            acc.backward(loss_sum, count)
        acc.step()
    return model.module.state_dict()


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_rank)


def _got(runs: list, run: tuple) -> list:
    return [by_run[run] for by_run in runs]


@pytest.mark.xdist_group("several_forwards")  # one worker runs the ranks for every test
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_forwards_then_backwards_equal_the_full_batch_on_the_union(opt_name, runs):
    got = _got(runs, ("fp32", opt_name, 7))
    ref = mlp(torch.float64)
    opt = OPTIMIZERS[opt_name](ref.parameters())
    for window in _windows(7, torch.float64):
        full_batch_step(ref, opt, mean_ce, cat(window))
    for state in got:
        model = mlp(torch.float64)
        model.load_state_dict(state)
        assert max_relative_error(ref, model) < 1e-10


@pytest.mark.xdist_group("several_forwards")
def test_forwards_then_backwards_in_bf16_are_close_to_fp32(runs):
    got = _got(runs, ("bf16", "adamw", 8))
    ref = mlp(torch.float32)
    opt = OPTIMIZERS["adamw"](ref.parameters())
    for window in _windows(8, torch.float32):
        full_batch_step(ref, opt, mean_ce, cat(window))
    model = mlp(torch.float32)
    model.load_state_dict(got[0])
    assert max_relative_error(ref, model) < 5e-2  # bf16 rounding, not a missing micro-batch
    assert all(torch.equal(got[0][k], got[1][k]) for k in got[0])  # the ranks agree bitwise

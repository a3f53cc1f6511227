"""``micro_batch_size="auto"`` on 2 real gloo ranks when only ONE rank runs out of memory.

The out-of-memory error is injected (a ``torch.OutOfMemoryError`` raised on rank 1 for any
micro-batch over 3 samples, in the forward or inside the backward): a real one on one rank
only cannot be provoked reliably on CPU without also starving gloo. Both ranks must finish,
adopt the same micro-batch size, and match one full-batch step on the union
(Note [auto micro-batch across ranks] in bigbatch.sync).
"""

from __future__ import annotations

import os

import pytest
import torch
from models import classification_batch, mean_ce, mlp
from ranks import run_ranks
from reference import full_batch_step, max_relative_error
from test_ddp import OPTIMIZERS, _cat
from torch.nn.parallel import DistributedDataParallel as DDP

import bigbatch
from bigbatch.split import batch_size

SAMPLES = (10, 12)
FITS = 3  # rank 1 "runs out of memory" above this many samples per micro-batch
STEPS = 3
CASES = [("forward", "adamw"), ("backward", "sgd_momentum")]


def _batches(seed: int) -> list[list]:
    gen = torch.Generator().manual_seed(seed)
    return [[classification_batch(n, torch.float64, gen) for n in SAMPLES] for _ in range(STEPS)]


def _oom(*_):
    raise torch.OutOfMemoryError("injected: out of memory on rank 1 only")


def _loss_fn(rank: int, where: str):
    def loss_fn(model, batch):
        too_big = rank == 1 and batch_size(batch) > FITS
        if too_big and where == "forward":
            _oom()
        loss = mean_ce(model, batch)
        if too_big and where == "backward":
            loss.register_hook(_oom)  # raised inside loss.backward()
        return loss

    return loss_fn


def _case(rank: int, where: str, opt_name: str, seed: int) -> dict:
    ddp = DDP(mlp(torch.float64))
    acc = bigbatch.Accumulator(ddp, OPTIMIZERS[opt_name](ddp.parameters()), micro_batch_size="auto")
    results = [acc.train_step(b[rank], _loss_fn(rank, where)) for b in _batches(seed)]
    return {
        "losses": [r.loss for r in results],
        "sizes": [r.micro_batch_size for r in results],
        "retries": [r.oom_retries for r in results],
        "state": acc.auto_state,
        "params": [p.detach().clone() for p in ddp.module.parameters()],
    }


def _refusals(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    out = {}
    for name, model in {
        "fsdp": fully_shard(mlp(torch.float64)),
        "buffers": DDP(
            torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)).double()
        ),
    }.items():
        try:
            bigbatch.Accumulator(
                model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size="auto"
            )
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _all_cases(rank: int, world_size: int, seed: int) -> dict:
    out = {case: _case(rank, *case, seed) for case in CASES}
    out["refusals"] = _refusals(rank)
    return out


@pytest.fixture(scope="module")
def ranks():
    seed = int(os.environ.get("BIGBATCH_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"BIGBATCH_TEST_SEED={seed}")
    return seed, run_ranks(_all_cases, seed, timeout_s=90)


@pytest.mark.parametrize("where,opt_name", CASES)
def test_one_rank_out_of_memory_all_ranks_shrink_together(ranks, where, opt_name):
    _, results = ranks
    for got in (r[(where, opt_name)] for r in results):
        # 12 fails on rank 1 -> everyone 6 -> fails on rank 1 -> everyone 3, then it stays.
        assert got["retries"] == [2, 0, 0]
        assert got["sizes"] == [FITS] * STEPS
    assert results[0][(where, opt_name)]["state"] == results[1][(where, opt_name)]["state"]


@pytest.mark.parametrize("where,opt_name", CASES)
def test_auto_across_ranks_equals_full_batch_on_union(ranks, where, opt_name):
    seed, results = ranks
    ref = mlp(torch.float64)
    opt = OPTIMIZERS[opt_name](ref.parameters())
    ref_losses = [full_batch_step(ref, opt, mean_ce, _cat(b)) for b in _batches(seed)]
    for got in (r[(where, opt_name)] for r in results):
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-10)
        gathered = mlp(torch.float64)
        with torch.no_grad():
            for p, q in zip(gathered.parameters(), got["params"], strict=True):
                p.copy_(q)
        assert max_relative_error(ref, gathered) < 1e-10


def test_auto_refuses_fsdp_and_ddp_buffer_broadcast_on_several_ranks(ranks):
    _, results = ranks
    for r in results:
        with pytest.raises(ValueError, match=r'"auto" is not supported with FSDP on 2 ranks'):
            raise ValueError(r["refusals"]["fsdp"])
        with pytest.raises(ValueError, match=r"broadcast_buffers=False\), or use a fixed"):
            raise ValueError(r["refusals"]["buffers"])

"""``micro_batch_size="auto"`` on 2 real gloo ranks when only ONE rank runs out of memory.

Two kinds of failure on rank 1 only: an injected ``torch.OutOfMemoryError`` for any micro-batch
over 3 samples (in the forward, or inside the backward), which fixes the sizes exactly; and a
real allocator failure under ``RLIMIT_DATA`` set on rank 1 alone (rank 0 has no limit). Both
ranks must finish, adopt the same micro-batch size, and match one full-batch step on the union
(Note [auto micro-batch across ranks] in bigbatch.core._sync).
"""

from __future__ import annotations

import pytest
import torch
from cases import OPTIMIZERS, cat
from limits import limit_data
from models import classification_batch, mean_ce, mlp
from ranks import run_ranks
from reference import full_batch_step, max_relative_error
from seeds import seed_for
from torch.nn.parallel import DistributedDataParallel as DDP

import bigbatch
from bigbatch.core.split import batch_size

pytestmark = pytest.mark.slow  # real gloo ranks

SAMPLES = (10, 12)
FITS = 3  # rank 1 "runs out of memory" above this many samples per micro-batch
STEPS = 3
CASES = [("forward", "adamw"), ("backward", "sgd_momentum")]


def rank_windows(seed: int) -> list[list]:
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
    results = [acc.train_step(b[rank], _loss_fn(rank, where)) for b in rank_windows(seed)]
    return {
        "losses": [r.loss for r in results],
        "sizes": [r.micro_batch_size for r in results],
        "retries": [r.oom_retries for r in results],
        "state": acc.state_dict()["sizing"],
        "params": [p.detach().clone() for p in ddp.module.parameters()],
    }


class Expand(torch.nn.Module):
    """A forward whose activations grow by ~8 MiB per sample (float64): memory tracks the micro-batch."""

    def __init__(self, d_in: int = 256, expand: int = 2048) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.v = torch.nn.Parameter(torch.linspace(-1, 1, expand, dtype=torch.float64))
        self.head = torch.nn.Linear(d_in, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x[:, :, None] * self.v).mean(-1))


REAL_SAMPLES, REAL_MARGIN_MIB = 24, 160


def _realrank_windows(seed: int) -> list[list]:
    gen = torch.Generator().manual_seed(seed)

    def batch():
        x = torch.randn(REAL_SAMPLES, 256, generator=gen, dtype=torch.float64)
        return x, torch.randint(0, 3, (REAL_SAMPLES,), generator=gen)

    return [[batch() for _ in range(2)] for _ in range(STEPS)]


def _low_level(rank: int, seed: int) -> list[torch.Tensor]:
    """The low-level path of an auto-mode Accumulator still syncs on ``last=True``."""
    ddp = DDP(mlp(torch.float64))
    acc = bigbatch.Accumulator(ddp, OPTIMIZERS["adamw"](ddp.parameters()), micro_batch_size="auto")
    for per_rank in rank_windows(seed):
        pieces = bigbatch.split(per_rank[rank], 4)
        for i, piece in enumerate(pieces):
            with acc.micro_batch(last=i == len(pieces) - 1):
                acc.backward(mean_ce(ddp, piece) * batch_size(piece), batch_size(piece))
        acc.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _real_oom(rank: int, seed: int) -> dict:
    model = Expand()
    batches = _realrank_windows(seed)
    ddp = DDP(model)
    acc = bigbatch.Accumulator(
        ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), micro_batch_size="auto"
    )
    mean_ce(
        model, (batches[0][rank][0][:2], batches[0][rank][1][:2])
    ).backward()  # warm up, locally
    model.zero_grad(set_to_none=True)
    if rank == 1:
        limit_data(REAL_MARGIN_MIB)
    results = [acc.train_step(b[rank], mean_ce) for b in batches]
    limit_data(None)
    return {
        "losses": [r.loss for r in results],
        "sizes": [r.micro_batch_size for r in results],
        "retries": [r.oom_retries for r in results],
        "state": acc.state_dict()["sizing"],
        "params": [p.detach().clone() for p in model.parameters()],
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
    out["real"] = _real_oom(rank, seed)
    out["low_level"] = _low_level(rank, seed)
    return out


@pytest.fixture(scope="module")
def ranks():
    seed = seed_for("tests/distributed/test_auto_ranks.py")
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
    ref_losses = [full_batch_step(ref, opt, mean_ce, cat(b)) for b in rank_windows(seed)]
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


def test_real_out_of_memory_on_one_rank_only(ranks):
    seed, results = ranks
    got = [r["real"] for r in results]
    assert got[0]["retries"][0] >= 1  # rank 0 had no limit: it redid the window for rank 1
    assert got[0]["retries"] == got[1]["retries"]
    assert got[0]["sizes"] == got[1]["sizes"] and got[0]["sizes"][0] < REAL_SAMPLES
    assert got[0]["state"] == got[1]["state"]
    ref = Expand()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = [full_batch_step(ref, opt, mean_ce, cat(b)) for b in _realrank_windows(seed)]
    for g in got:
        assert g["losses"] == pytest.approx(ref_losses, rel=1e-10)
        gathered = Expand()
        with torch.no_grad():
            for p, q in zip(gathered.parameters(), g["params"], strict=True):
                p.copy_(q)
        assert max_relative_error(ref, gathered) < 1e-10
    print("real OOM on rank 1: sizes", got[0]["sizes"], "retries", got[0]["retries"])


def test_low_level_path_in_auto_mode_syncs_on_last(ranks):
    seed, results = ranks
    ref = mlp(torch.float64)
    opt = OPTIMIZERS["adamw"](ref.parameters())
    for b in rank_windows(seed):
        full_batch_step(ref, opt, mean_ce, cat(b))
    for r in results:
        gathered = mlp(torch.float64)
        with torch.no_grad():
            for p, q in zip(gathered.parameters(), r["low_level"], strict=True):
                p.copy_(q)
        assert max_relative_error(ref, gathered) < 1e-10

"""FSDP2 (``fully_shard``) and FSDP1 + accumulation on 2 real gloo ranks (CPU, float64).

The same check as ``test_ddp.py``: unequal data per rank (10 samples cut 4 + 4 + 2, and 9 cut
4 + 4 + 1; far fewer tokens on rank 1 for the padded LM), parameters and losses equal one
full-batch step on the union. Unlike DDP, FSDP all-gathers the parameters in every forward, so
every rank must run the same NUMBER of micro-batches per window (10 and 7 samples at 4 would be
3 and 2 forwards: the third all-gather on rank 0 waits forever). Gradient syncs are counted with torch's profiler: the reduce-scatter events
(``c10d::_reduce_scatter_base_``) of one optimizer step must equal those of ONE synced backward
(one per FSDP unit), not k of them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from cases import MICRO, MODELS, OPTIMIZERS, STEPS, cat, rank_windows
from models import TinyCausalLM
from ranks import run_ranks
from reference import full_batch_step, max_relative_error
from seeds import seed_for

import bigbatch
from bigbatch.core.loss import as_sum_and_count
from bigbatch.core.split import batch_size, split

pytestmark = pytest.mark.slow  # real gloo ranks

SAMPLES = (10, 9)  # same number of micro-batches (3) on both ranks, unequal sizes and tokens
REDUCE_SCATTER = "c10d::_reduce_scatter_base_"
CASES = [
    ("fsdp2", "mlp", "sgd_momentum"),
    ("fsdp2", "mlp", "adamw"),
    ("fsdp2", "causal_lm", "sgd_momentum"),
    ("fsdp2", "causal_lm", "adamw"),
    ("fsdp1", "mlp", "sgd_momentum"),
    ("fsdp1", "causal_lm", "adamw"),
]
# The memory-saving alternative: sync (reduce-scatter) every micro-batch through the low-level
# path, so no unsharded gradient outlives its micro-batch; still exact, k times the traffic.
EVERY = ("fsdp2", "causal_lm", "adamw", "sync_every_micro_batch")


def _shard(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard

    units = model.blocks if isinstance(model, TinyCausalLM) else model
    for module in units:
        if any(True for _ in module.parameters()):
            fully_shard(module)
    return fully_shard(model)


@contextlib.contextmanager
def _count_reduce_scatters(counter: list):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield
    counter.append(sum(e.name == REDUCE_SCATTER for e in prof.events()))


def _full_params(kind: str, model: torch.nn.Module) -> list[torch.Tensor]:
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _case(
    rank: int, kind: str, model_name: str, opt_name: str, seed: int, every: bool = False
) -> dict:
    make_model, loss_fn = MODELS[model_name]
    steps = rank_windows(model_name, seed, SAMPLES)
    model = _shard(kind, make_model(torch.float64))
    units: list = []
    with _count_reduce_scatters(units):  # one synced backward: one reduce-scatter per unit
        out = loss_fn(model, split(steps[0][rank], MICRO)[0])
        (out[0] if isinstance(out, tuple) else out).backward()
    model.zero_grad(set_to_none=True)
    acc = bigbatch.Accumulator(
        model, OPTIMIZERS[opt_name](model.parameters()), micro_batch_size=MICRO
    )
    losses, calls = [], []
    for per_rank in steps:
        with _count_reduce_scatters(calls):
            if every:
                for piece in split(per_rank[rank], MICRO):
                    with acc.micro_batch(last=True):
                        acc.backward(*as_sum_and_count(loss_fn(model, piece), batch_size(piece)))
                losses.append(acc.step().loss)
            else:
                losses.append(acc.train_step(per_rank[rank], loss_fn).loss)
    return {
        "losses": losses,
        "calls": calls,
        "units": units[0],
        "params": _full_params(kind, model),
    }


def _all_cases(rank: int, world_size: int, seed: int) -> dict:
    out = {case: _case(rank, *case, seed) for case in CASES}
    out[EVERY] = _case(rank, *EVERY[:3], seed, every=True)
    return out


@pytest.fixture(scope="module")
def ranks():
    seed = seed_for("tests/distributed/test_fsdp.py")
    return seed, run_ranks(_all_cases, seed, timeout_s=90)


@pytest.mark.parametrize("case", [*CASES, EVERY], ids="-".join)
def test_fsdp_accumulation_equals_full_batch_on_union_float64(ranks, case):
    kind, model_name, opt_name = case[:3]
    seed, results = ranks
    make_model, loss_fn = MODELS[model_name]
    ref = make_model(torch.float64)
    opt = OPTIMIZERS[opt_name](ref.parameters())
    ref_losses = [
        full_batch_step(ref, opt, loss_fn, cat(b)) for b in rank_windows(model_name, seed, SAMPLES)
    ]
    for rank_result in results:
        got = rank_result[case]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-10)
        gathered = make_model(torch.float64)
        with torch.no_grad():
            for p, q in zip(gathered.parameters(), got["params"], strict=True):
                p.copy_(q)
        assert max_relative_error(ref, gathered) < 1e-10


@pytest.mark.parametrize("kind,model_name,opt_name", CASES)
def test_fsdp_one_reduce_scatter_round_per_step(ranks, kind, model_name, opt_name):
    _, results = ranks
    for rank, rank_result in enumerate(results):
        got = rank_result[(kind, model_name, opt_name)]
        assert got["units"] >= 1
        assert -(-SAMPLES[rank] // MICRO) > 1  # several micro-batches, one sync
        assert got["calls"] == [got["units"]] * STEPS


def test_fsdp_sync_every_micro_batch_reduce_scatters_k_times(ranks):
    _, results = ranks
    for rank, rank_result in enumerate(results):
        got = rank_result[EVERY]
        assert got["calls"] == [-(-SAMPLES[rank] // MICRO) * got["units"]] * STEPS

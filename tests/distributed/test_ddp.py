"""DDP + accumulation on 2 real gloo ranks against single-process full-batch training.

The ranks hold deliberately unequal data (10 samples cut 4 + 4 + 2 on rank 0, 7 cut 4 + 3 on
rank 1; for the padded LM rank 1's sequences are also much shorter, so the token counts differ)
and the reference takes one full-batch step on the union. Gradient all-reduces are counted with
a DDP communication hook that counts each bucket and then does the default all-reduce.

All cases run in one pair of rank processes (spawning is the slow part); the tests below check
each case's results.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import CASES, MICRO, MODELS, OPTIMIZERS, SAMPLES, STEPS, cat, rank_windows
from models import (
    PAD,
    mean_ce,
    mlp,
)
from ranks import run_ranks
from reference import full_batch_step, max_relative_error
from seeds import seed_for
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import bigbatch
from bigbatch.core.loss import as_sum_and_count
from bigbatch.core.split import batch_size

pytestmark = pytest.mark.slow  # real gloo ranks


def _pieces(batch, size: int) -> list:
    return bigbatch.split(batch, size)


def counting_hook(state: dict, bucket):
    """Count one bucket's all-reduce, then do DDP's default one."""
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def _ddp(model: torch.nn.Module) -> tuple[DDP, dict]:
    # A tiny bucket cap so the model spans several buckets: one sync = several hook calls.
    ddp = DDP(model, bucket_cap_mb=0.002)
    state = {"calls": 0}
    ddp.register_comm_hook(state, counting_hook)
    return ddp, state


def _buckets(ddp: DDP, state: dict, loss_fn, batch) -> int:
    """Hook calls of one synced backward (the second: DDP rebuilds its buckets after the first)."""
    for _ in range(2):
        before = state["calls"]
        out = loss_fn(ddp, batch)
        (out[0] if isinstance(out, tuple) else out).backward()
        ddp.zero_grad(set_to_none=True)
    return state["calls"] - before


def _case(rank: int, model_name: str, opt_name: str, path: str, steps: list) -> dict:
    make_model, loss_fn = MODELS[model_name]
    ddp, state = _ddp(make_model(torch.float64))
    buckets = _buckets(ddp, state, loss_fn, _pieces(steps[0][rank], MICRO)[0])
    acc = bigbatch.Accumulator(ddp, OPTIMIZERS[opt_name](ddp.parameters()), micro_batch_size=MICRO)
    losses, calls = [], []
    for per_rank in steps:
        before = state["calls"]
        if path == "train_step":
            result = acc.train_step(per_rank[rank], loss_fn)
        else:
            pieces = _pieces(per_rank[rank], MICRO)
            for i, piece in enumerate(pieces):
                with acc.micro_batch(last=i == len(pieces) - 1):
                    acc.backward(*as_sum_and_count(loss_fn(ddp, piece), batch_size(piece)))
            result = acc.step()
        losses.append(result.loss)
        calls.append(state["calls"] - before)
    params = [p.detach().clone() for p in ddp.module.parameters()]
    return {"losses": losses, "calls": calls, "buckets": buckets, "params": params}


def _sync_every_micro_batch(rank: int, steps: list) -> dict:
    """The naive loop: every micro-batch's backward all-reduces (no ``no_sync``)."""
    ddp, state = _ddp(mlp(torch.float64))
    buckets = _buckets(ddp, state, mean_ce, _pieces(steps[0][rank], MICRO)[0])
    before = state["calls"]
    for piece in _pieces(steps[0][0], MICRO):  # the same k on both ranks, or a rank would wait
        mean_ce(ddp, piece).backward()
    return {"calls": state["calls"] - before, "buckets": buckets}


def _all_cases(rank: int, world_size: int, seed: int) -> dict:
    out = {}
    for model_name, opt_name, path in CASES:
        out[(model_name, opt_name, path)] = _case(
            rank, model_name, opt_name, path, rank_windows(model_name, seed)
        )
    out["naive"] = _sync_every_micro_batch(rank, rank_windows("mlp", seed))
    out["world_size"] = dist.get_world_size()
    return out


@pytest.fixture(scope="module")
def ranks():
    seed = seed_for("tests/distributed/test_ddp.py")
    return seed, run_ranks(_all_cases, seed)


@pytest.mark.parametrize("model_name,opt_name,path", CASES)
def test_ddp_accumulation_equals_full_batch_on_union_float64(ranks, model_name, opt_name, path):
    seed, results = ranks
    make_model, loss_fn = MODELS[model_name]
    ref = make_model(torch.float64)
    opt = OPTIMIZERS[opt_name](ref.parameters())
    ref_losses = [
        full_batch_step(ref, opt, loss_fn, cat(per_rank))
        for per_rank in rank_windows(model_name, seed)
    ]
    for rank_result in results:
        got = rank_result[(model_name, opt_name, path)]
        assert got["losses"] == pytest.approx(
            ref_losses, rel=1e-10
        )  # the global mean, on every rank
        engine_model = make_model(torch.float64)
        with torch.no_grad():
            for p, q in zip(engine_model.parameters(), got["params"], strict=True):
                p.copy_(q)
        assert max_relative_error(ref, engine_model) < 1e-10


def test_padded_lm_ranks_hold_unequal_token_counts(ranks):
    seed, _ = ranks
    for per_rank in rank_windows("causal_lm", seed):
        tokens = [int((b["labels"][:, 1:] != PAD).sum()) for b in per_rank]
        assert tokens[0] > 2 * tokens[1]


@pytest.mark.parametrize("model_name,opt_name,path", CASES)
def test_one_gradient_sync_per_optimizer_step(ranks, model_name, opt_name, path):
    _, results = ranks
    for rank_result in results:
        got = rank_result[(model_name, opt_name, path)]
        assert got["buckets"] > 1  # the model spans several buckets
        assert got["calls"] == [got["buckets"]] * STEPS  # each bucket all-reduced once per step


def test_without_no_sync_every_micro_batch_all_reduces(ranks):
    _, results = ranks
    k = -(-SAMPLES[0] // MICRO)
    for rank_result in results:
        assert rank_result["naive"]["calls"] == k * rank_result["naive"]["buckets"]
    assert results[0]["world_size"] == 2

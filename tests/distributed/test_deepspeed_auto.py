"""``micro_batch_size="auto"`` on a DeepSpeed engine: a window that runs out of memory part-way
is dropped from the engine's buffers and run again in smaller micro-batches.

An ``OutOfMemoryError`` is raised for a micro-batch of over 5 samples, and for one of 4 or 5
after the first of the try (as when the gradient buffers fill the memory the first one left), in
the forward or inside ``engine.backward`` (a hook on the loss): the window of 10 runs out at 10,
then at its second micro-batch of 5, after the first has accumulated into the engine. ZeRO 1 on
2 gloo ranks with the error on rank 1 only (the ranks agree on the size: Note [auto micro-batch
across ranks]); ZeRO 2 and 3 on one rank (on several they reduce in every backward and are
refused with "auto"). And a real allocator failure under ``RLIMIT_DATA`` on one of two ZeRO 1
ranks. Each equals one process taking a plain float64 step on each window's union, to float32's
1e-6. Needs DeepSpeed."""

from __future__ import annotations

import itertools

import pytest
import torch
from ranks import run_ranks

pytest.importorskip("deepspeed")

from token_lm import (  # noqa: E402
    counts,
    engine,
    environment,
    gathered,
    model,
    reference,
    relative_error,
    token_loss,
    windows,
)

import bigbatch  # noqa: E402
from bigbatch.core.split import batch_size  # noqa: E402

pytestmark = pytest.mark.slow  # gloo ranks that start DeepSpeed

FITS, FIRST_FITS = 3, 5  # samples that fit in a micro-batch, in the first of a try
CASES = [(1, 2, "forward"), (1, 2, "backward"), (2, 1, "backward"), (3, 1, "backward")]


def _oom(*_):
    raise torch.OutOfMemoryError("injected: out of memory")


def _loss_fn(rank: int, world: int, where: str, calls: list):
    """The loss, running out of memory on the last rank; ``calls`` gets (samples, raised)."""

    def loss_fn(m, mb):
        size = batch_size(mb)
        first = not calls or calls[-1][0] != size  # the first micro-batch of a try
        too_big = rank == world - 1 and size > (FIRST_FITS if first else FITS)
        calls.append((size, too_big))
        if too_big and where == "forward":
            _oom()
        loss_sum, count = token_loss(m, mb)
        if too_big and where == "backward":
            loss_sum.register_hook(_oom)  # raised inside engine.backward
        return loss_sum, count

    return loss_fn


def _train(rank: int, world: int, stage: int, where: str) -> dict:
    environment(rank, world)
    m = model()
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    eng, optimizer = engine(m, optimizer, stage)
    acc = bigbatch.Accumulator(eng, optimizer, micro_batch_size="auto")
    results, calls = [], []
    for per_rank in windows(seed=stage, world=world):
        calls.append([])
        loss_fn = _loss_fn(rank, world, where, calls[-1])
        results.append(acc.train_step(per_rank[rank], loss_fn, count_fn=counts))
    return {"params": gathered(eng), "results": results, "steps": eng.global_steps, "calls": calls}


def _part_way(calls: list) -> bool:
    """A micro-batch ran out of memory after one of the same size in its window did not."""
    return any(
        ok[0] == bad[0] and not ok[1] and bad[1]
        for window in calls
        for ok, bad in itertools.pairwise(window)
    )


@pytest.mark.parametrize(("stage", "world", "where"), CASES)
def test_auto_after_an_out_of_memory_equals_the_full_batch(stage, world, where):
    ranks = run_ranks(_train, stage, where, world_size=world, timeout_s=600)
    optimizer = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, eps=1e-6)  # noqa: E731
    want = reference(windows(seed=stage, world=world), optimizer)
    for got in ranks:
        error = relative_error(got["params"], want["params"])
        sizes = [r.micro_batch_size for r in got["results"]]
        print(f"ZeRO-{stage} on {world} rank(s), OOM in the {where}: {error:.1e}, sizes {sizes}")
        assert error < 1e-6
        assert got["steps"] == 3 and all(0 < s <= FITS for s in sizes)
        assert sum(r.oom_retries for r in got["results"]) > 0
    assert len({tuple(r.micro_batch_size for r in g["results"]) for g in ranks}) == 1
    assert _part_way(ranks[-1]["calls"]), ranks[-1]["calls"]


def _real(rank: int, world: int, seed: int) -> dict:
    """ZeRO 1 over ``test_auto_ranks``'s ``Expand`` (about 8 MiB of activations per sample):
    rank 1's allocator really fails, under ``RLIMIT_DATA`` set on it alone. DeepSpeed's own
    buckets are made small: at their default (5e8 elements) the first backward's bucket alone
    is over the limit, and not even one sample fits."""
    from limits import limit_data
    from models import mean_ce
    from test_auto_ranks import REAL_MARGIN_MIB, Expand, _realrank_windows

    environment(rank, world)
    m, batches = Expand(), _realrank_windows(seed)
    mean_ce(m, (batches[0][rank][0][:2], batches[0][rank][1][:2])).backward()  # warm up
    m.zero_grad(set_to_none=True)
    buckets = {"stage": 1, "reduce_bucket_size": 10**6, "allgather_bucket_size": 10**6}
    eng, optimizer = engine(
        m, torch.optim.AdamW(m.parameters(), lr=1e-2), stage=1, zero_optimization=buckets
    )
    acc = bigbatch.Accumulator(eng, optimizer, micro_batch_size="auto")
    if rank == 1:
        limit_data(REAL_MARGIN_MIB)
    results = [acc.train_step(b[rank], mean_ce) for b in batches]
    limit_data(None)
    return {"params": gathered(eng), "results": results}


def test_a_real_out_of_memory_on_one_zero1_rank():
    from cases import cat
    from models import mean_ce
    from reference import full_batch_step
    from seeds import seed_for
    from test_auto_ranks import Expand, _realrank_windows

    seed = seed_for("tests/distributed/test_deepspeed_auto.py")
    ranks = run_ranks(_real, seed, timeout_s=600)
    want = Expand()
    optimizer = torch.optim.AdamW(want.parameters(), lr=1e-2)
    for b in _realrank_windows(seed):
        full_batch_step(want, optimizer, mean_ce, cat(b))
    want_state = {k: v.detach() for k, v in want.named_parameters()}
    for got in ranks:
        sizes = [r.micro_batch_size for r in got["results"]]
        error = relative_error({k: v.double() for k, v in got["params"].items()}, want_state)
        print(f"ZeRO-1, rank 1 under RLIMIT_DATA: {error:.1e}, sizes {sizes}")
        assert error < 1e-6
        assert sum(r.oom_retries for r in got["results"]) > 0 and max(sizes) < 24
    assert len({tuple(r.micro_batch_size for r in g["results"]) for g in ranks}) == 1

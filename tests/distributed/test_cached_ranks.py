"""``cached_loss`` on 2 real gloo ranks with unequal shares = one process on the union, float64.

Rank 0 holds 10 samples (4 + 4 + 2 at micro-batch 4), rank 1 holds 7 (4 + 3); with
``gather=True`` the symmetric InfoNCE of every rank scores each sample against all 17, so the
reference is one plain full-batch step on the concatenation (rank 0's samples first). Cases:

* DDP, temperature returned by the model's forward (0-dim output), SGD with momentum; DDP's
  all-reduces are counted with a communication hook: one round per optimizer step;
* DDP, temperature used directly by the loss, false negatives masked with gathered labels
  (``(loss_sum, count)``), AdamW;
* DDP with ``micro_batch_size="auto"``: rank 0's encode fails (``MemoryError``) without a graph
  above 4 samples, so rank 1 must learn it before the gather and both redo the window smaller;
* FSDP2 (each tower and the root sharded), 10 and 9 samples (FSDP needs the same number of
  micro-batches on every rank), AdamW;
* ``gather=False``: each rank's loss covers its own share; the step's loss is
  ``Σ_r S_r / Σ_r C_r`` (the reference computes that on the union);
* tensors of the batch that differ past the sample dimension: both ranks raise, naming it.

Dropout is off here: each rank draws from its own generator, which a one-process reference
cannot replay (tests/losses/test_cached.py covers dropout on one process).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from contrastive import concat_reps, losses, pairs, two_tower
from ranks import run_ranks
from reference import max_relative_error
from seeds import seed_for
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import bigbatch

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9, nesterov=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}
SHARES = {"ddp": (10, 7), "fsdp2": (10, 9)}
MICRO, STEPS = 4, 3
CASES = {  # name: (wrapper, loss kind, temperature, optimizer, micro_batch_size, gather)
    "ddp": ("ddp", "clip", "encode", "sgd_momentum", MICRO, True),
    "ddp_direct_masked": ("ddp", "masked_sum", "direct", "adamw", MICRO, True),
    "ddp_auto_oom": ("ddp", "clip", "encode", "sgd_momentum", "auto", True),
    "fsdp2": ("fsdp2", "clip", "encode", "adamw", MICRO, True),
    "ddp_no_gather": ("ddp", "clip", "encode", "sgd_momentum", MICRO, False),
}


def _batches(seed: int, shares: tuple[int, ...]) -> list[list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    return [[pairs(n, gen) for n in shares] for _ in range(STEPS)]


def _wrap(kind: str, model: torch.nn.Module):
    if kind == "ddp":
        ddp = DDP(model, bucket_cap_mb=0.0005)  # several buckets
        state = {"calls": 0}

        def counting_hook(state, bucket):
            state["calls"] += 1
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(state, counting_hook)
        return ddp, state
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.a)
    fully_shard(model.b)
    return fully_shard(model), None


def _params(kind: str, model: torch.nn.Module) -> list[torch.Tensor]:
    if kind == "ddp":
        return [p.detach().clone() for p in model.module.parameters()]
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _case(rank: int, name: str, seed: int) -> dict:
    kind, loss_kind, temperature, opt, micro, gather = CASES[name]
    inner = two_tower()
    model, hook = _wrap(kind, inner)
    encode, batch_loss = losses(inner, loss_kind, temperature)  # "direct": inner.logit_scale
    failed = []
    if name == "ddp_auto_oom" and rank == 0:
        plain_encode = encode

        def encode(m, mb):
            if not torch.is_grad_enabled() and len(mb["x"]) > 4:
                failed.append(len(mb["x"]))
                raise MemoryError(f"{len(mb['x'])} samples")
            return plain_encode(m, mb)

    loss_fn = bigbatch.cached_loss(encode, batch_loss, gather=gather)
    acc = bigbatch.Accumulator(model, OPTIMIZERS[opt](model.parameters()), micro_batch_size=micro)
    out = {"losses": [], "calls": [], "sizes": [], "retries": [], "counts": []}
    for per_rank in _batches(seed, SHARES[kind]):
        before = hook["calls"] if hook else 0
        result = acc.train_step(per_rank[rank], loss_fn)
        out["calls"].append((hook["calls"] if hook else 0) - before)
        for key, value in (("losses", result.loss), ("sizes", result.micro_batch_size),
                           ("retries", result.oom_retries), ("counts", result.count)):  # fmt: skip
            out[key].append(value)
    out["params"] = _params(kind, model)
    out["buckets"] = _buckets(model, hook, per_rank[rank]) if hook else None
    return {**out, "failed": failed}


def _buckets(ddp: DDP, state: dict, batch: dict) -> int:
    """Hook calls of one synced backward (the second: DDP rebuilds its buckets after the first)."""
    for _ in range(2):
        before = state["calls"]
        q, d, scale = ddp(batch["x"], batch["y"])
        (scale * (q * d).sum()).backward()
        ddp.zero_grad(set_to_none=True)
    return state["calls"] - before


def _mismatched_batch(rank: int, seed: int) -> str:
    """A batch tensor 3 wide on rank 0 and 4 wide on rank 1, gathered for batch_loss."""
    inner = two_tower()
    encode, batch_loss = losses(inner)
    batch = {**pairs(SHARES["ddp"][rank], torch.Generator().manual_seed(seed))}
    batch["extra"] = torch.zeros(len(batch["x"]), 3 + rank)
    acc = bigbatch.Accumulator(DDP(inner), torch.optim.SGD(inner.parameters(), lr=0.1), MICRO)
    try:
        acc.train_step(batch, bigbatch.cached_loss(encode, batch_loss))
    except ValueError as exc:
        return str(exc)
    return "no error"


def _all_cases(rank: int, world_size: int, seed: int) -> dict:
    out = {name: _case(rank, name, seed) for name in CASES}
    out["mismatch"] = _mismatched_batch(rank, seed)
    out["world_size"] = dist.get_world_size()
    return out


@pytest.fixture(scope="module")
def ranks():
    seed = seed_for("tests/distributed/test_cached_ranks.py")
    return seed, run_ranks(_all_cases, seed, timeout_s=180)


def _reference(name: str, seed: int) -> tuple[torch.nn.Module, list[float]]:
    """Plain full-batch steps on the union of the ranks' batches (per rank when not gathered)."""
    kind, loss_kind, temperature, opt_name, _, gather = CASES[name]
    model = two_tower()
    encode, batch_loss = losses(model, loss_kind, temperature)
    opt = OPTIMIZERS[opt_name](model.parameters())
    got = []
    for per_rank in _batches(seed, SHARES[kind]):
        opt.zero_grad(set_to_none=True)
        union = {k: torch.cat([b[k] for b in per_rank]) for k in per_rank[0]}
        shares = [union] if gather else per_rank
        outs = [batch_loss(concat_reps([encode(model, b)]), b) for b in shares]
        sums = [
            o[0] if isinstance(o, tuple) else o * len(b["x"])
            for o, b in zip(outs, shares, strict=True)
        ]
        counts = [
            o[1] if isinstance(o, tuple) else len(b["x"]) for o, b in zip(outs, shares, strict=True)
        ]
        loss = sum(sums) / sum(counts)
        loss.backward()
        opt.step()
        got.append(float(loss.detach()))
    return model, got


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_ranks_equal_one_process_on_the_union(ranks, name):
    seed, results = ranks
    ref, ref_losses = _reference(name, seed)
    for rank_result in results:
        got = rank_result[name]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-10)  # the global batch's loss
        engine_model = copy.deepcopy(ref)
        with torch.no_grad():
            for p, q in zip(engine_model.parameters(), got["params"], strict=True):
                p.copy_(q)
        assert max_relative_error(ref, engine_model) < 1e-10


@pytest.mark.slow
def test_ddp_all_reduces_once_per_step(ranks):
    _, results = ranks
    for rank_result in results:
        calls, buckets = rank_result["ddp"]["calls"], rank_result["ddp"]["buckets"]
        assert buckets > 1  # the model spans several buckets
        # the first step uses DDP's initial bucketing; then each bucket is all-reduced once a step
        assert 1 <= calls[0] <= buckets and calls[1:] == [buckets] * (STEPS - 1)
        assert rank_result["ddp"]["counts"] == [sum(SHARES["ddp"])] * STEPS  # C over all ranks


@pytest.mark.slow
def test_out_of_memory_on_one_rank_redoes_the_window_on_both(ranks):
    _, results = ranks
    assert results[0]["ddp_auto_oom"]["failed"] == [10]  # rank 0 alone ran out, in pass 1
    for rank_result in results:
        got = rank_result["ddp_auto_oom"]
        assert got["retries"] == [1, 0, 0]
        assert got["sizes"] == [3, 3, 3]  # both adopt half of the smallest failed size (7)


@pytest.mark.slow
def test_batch_tensors_that_differ_past_the_sample_dimension(ranks):
    _, results = ranks
    for rank, rank_result in enumerate(results):
        assert rank_result["mismatch"].startswith(
            f"gather=True: batch['extra'] is torch.float32 of shape [n, {3 + rank}] on rank {rank}, "
            f"not on rank {1 - rank}: every rank's tensors must agree past the sample dimension"
        )

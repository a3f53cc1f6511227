"""``bigbatch.Accumulator`` on a ``deepspeed.initialize`` engine (ZeRO 1, 2, 3) on 2 gloo ranks.

Each window is one ``engine.step()`` after one ``engine.backward`` per micro-batch, carrying
``W / C`` with ``C`` the window's global count known before it (Note [DeepSpeed windows] in
``bigbatch.core._deepspeed``). Compared with one process taking a plain float64 step on each
window's union of the ranks' batches. DeepSpeed's ZeRO keeps float32 master weights and gradient
partitions whatever the model's dtype (a float64 model trains to the same 1e-7 as a float32 one:
``_configure_master_weights`` in ``deepspeed/runtime/base_optimizer.py`` returns float32 unless
fp16 / bf16 masters are asked for), so the engine runs float32 and the bar is 1e-6 relative.

Needs DeepSpeed (``pip install -e ".[deepspeed]"``; skipped without it) and its CPU accelerator.
"""

from __future__ import annotations

import math

import pytest
import torch
from ranks import run_ranks

pytest.importorskip("deepspeed")

from deepspeed_ranks import (  # noqa: E402
    MICRO,
    counts,
    engine,
    environment,
    gathered,
    model,
    reference,
    relative_error,
    sample_mean,
    token_loss,
    windows,
)

import bigbatch  # noqa: E402

pytestmark = pytest.mark.slow  # gloo ranks that start DeepSpeed

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, eps=1e-6),
}
# (optimizer, loss, Accumulator settings): counted before the window by count_fn, by the count
# pass (a loss returning counts, no count_fn), a mean over samples (1 / N), token windows
VARIANTS = {
    "count_fn": ("sgd_momentum", "tokens", {"micro_batch_size": MICRO}, True),
    "count_pass": ("adamw", "tokens", {"micro_batch_size": MICRO}, False),
    "sample_mean": ("sgd_momentum", "mean", {"micro_batch_size": MICRO}, False),
    "token_windows": ("adamw", "tokens", {"micro_batch_tokens": 20}, True),
    "token_windows_pass": ("sgd_momentum", "tokens", {"micro_batch_tokens": 14}, False),
}
LOSSES = {"tokens": token_loss, "mean": sample_mean}
CLIP = 0.05


def _train(rank, world, stage, variant, clip=None):
    opt_name, loss, settings, with_counts = VARIANTS[variant]
    m = model()
    optimizer = OPTIMIZERS[opt_name](m.parameters())
    eng, optimizer = engine(m, optimizer, stage, gradient_clipping=clip or 0.0)
    acc = bigbatch.Accumulator(eng, optimizer, **settings)
    results = [
        acc.train_step(per_rank[rank], LOSSES[loss], count_fn=counts if with_counts else None)
        for per_rank in windows(seed=stage, world=world)
    ]
    return {"params": gathered(eng), "results": results}


def _ranks(rank, world, stage):
    environment(rank, world)
    out = {v: _train(rank, world, stage, v) for v in VARIANTS}
    out["clipped"] = _train(rank, world, stage, "count_fn", clip=CLIP)
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda s: f"zero{s}")
def runs(request):
    stage = request.param
    return stage, run_ranks(_ranks, stage, world_size=2, timeout_s=600)


def _want(stage, variant, clip=None):
    opt_name, loss, _, _ = VARIANTS[variant]
    if loss == "mean":
        return None  # compared in its own test, against a sample-mean reference
    return reference(windows(seed=stage, world=2), OPTIMIZERS[opt_name], clip)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "sample_mean"])
def test_zero_equals_the_full_batch(runs, variant):
    stage, ranks = runs
    want = _want(stage, variant)
    got = ranks[0][variant]
    assert relative_error(got["params"], want["params"]) < 1e-6
    assert relative_error(ranks[1][variant]["params"], want["params"]) < 1e-6
    for result, loss in zip(got["results"], want["losses"], strict=True):
        assert math.isclose(result.loss, loss, rel_tol=1e-6)
        assert not result.skipped


def test_windows_of_different_micro_batch_counts(runs):
    _, ranks = runs
    assert [r.micro_batches for r in ranks[0]["count_fn"]["results"]] == [3, 2, 2]
    tokens = [[r.micro_batches for r in ranks[i]["token_windows"]["results"]] for i in (0, 1)]
    assert len({n for per_rank in tokens for n in per_rank}) > 1  # token windows vary too


def test_a_mean_over_samples_needs_no_count_pass(runs):
    stage, ranks = runs
    m = model(dtype=torch.float64)
    optimizer = OPTIMIZERS["sgd_momentum"](m.parameters())
    for per_rank in windows(seed=stage, world=2):
        batch = {k: torch.cat([b[k] for b in per_rank]) for k in per_rank[0]}
        optimizer.zero_grad()
        sample_mean(m, batch).backward()
        optimizer.step()
    want = {n: p.detach() for n, p in m.named_parameters()}
    assert relative_error(ranks[0]["sample_mean"]["params"], want) < 1e-6


def test_deepspeed_clips_and_reports_the_norm_before_clipping(runs):
    stage, ranks = runs
    want = _want(stage, "count_fn", clip=CLIP)
    got = ranks[0]["clipped"]
    assert relative_error(got["params"], want["params"]) < 1e-6
    norms = [r.grad_norm for r in got["results"]]
    assert norms == pytest.approx(want["norms"], rel=1e-5) and min(norms) > CLIP

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

from token_lm import (  # noqa: E402
    MICRO,
    counts,
    engine,
    environment,
    gathered,
    head_loss,
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
    "chunked_head": ("adamw", "head", {"micro_batch_size": MICRO}, True),
}
LOSSES = {"tokens": token_loss, "mean": sample_mean, "head": head_loss}
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


FIXED = (
    8,
    8,
    8,
)  # two micro-batches of 4 per window: what a fixed gradient_accumulation_steps takes


def _managed(rank, world, stage):
    """What users do: DeepSpeed's own accumulation (gradient_accumulation_steps=2), each
    micro-batch's token mean to engine.backward, engine.step() after each."""
    m = model()
    optimizer = OPTIMIZERS["sgd_momentum"](m.parameters())
    eng, _ = engine(
        m, optimizer, stage, managed_gradient_accumulation=True, gradient_accumulation_steps=2
    )
    for per_rank in windows(seed=stage, world=world, samples=FIXED):
        for i in range(0, FIXED[0], MICRO):
            mb = {k: v[i : i + MICRO] for k, v in per_rank[rank].items()}
            loss_sum, count = token_loss(eng, mb)
            eng.backward(loss_sum / count)
            eng.step()
    return gathered(eng)


def _ranks(rank, world, stage):
    environment(rank, world)
    out = {v: _train(rank, world, stage, v) for v in VARIANTS}
    out["clipped"] = _train(rank, world, stage, "count_fn", clip=CLIP)
    out["managed"] = _managed(rank, world, stage)
    m = model()
    eng, optimizer = engine(m, OPTIMIZERS["sgd_momentum"](m.parameters()), stage)
    acc = bigbatch.Accumulator(eng, optimizer, micro_batch_size=MICRO)
    for per_rank in windows(seed=stage, world=world, samples=FIXED):
        acc.train_step(per_rank[rank], token_loss, count_fn=counts)
    out["fixed"] = gathered(eng)
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


# ------------------------------------------------------------------ refusals, in one line each
def _refused(rank, world):
    environment(rank, world)
    out = {}

    def built(stage=1, **config):
        m = model()
        return engine(m, torch.optim.SGD(m.parameters(), lr=0.1), stage, **config)

    for name, config, match in (
        (
            "managed",
            {"managed_gradient_accumulation": True},
            '^DeepSpeed: the engine runs its own accumulation: add "managed_gradient_accumulation": '
            "false to the DeepSpeed config",
        ),
        (
            "overlap_comm",
            {
                "managed_gradient_accumulation": True,
                "zero_optimization": {"stage": 1, "overlap_comm": True},
            },
            '^DeepSpeed: ZeRO stage 0/1 with "overlap_comm": true cannot run caller-owned windows',
        ),
        (
            "zero0",
            {"zero_optimization": {"stage": 0}},
            "^DeepSpeed: ZeRO stage 0 keeps no gradient norm",
        ),
        (
            "deepcompile",
            {"managed_gradient_accumulation": True, "compile": {"deepcompile": True}},
            '^DeepSpeed: DeepCompile cannot run caller-owned windows: set "compile": ',
        ),
    ):
        eng, optimizer = built(**config)
        with pytest.raises(ValueError, match=match) as info:
            bigbatch.Accumulator(eng, optimizer)
        out[name] = str(info.value)
    eng, optimizer = built()
    other = torch.optim.SGD(eng.module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(other, 1)
    for name, kwargs, match in (
        ("optimizer", {"optimizer": other}, "pass the optimizer deepspeed.initialize returned"),
        ("scheduler", {"scheduler": scheduler}, r"give the scheduler to deepspeed.initialize\("),
        (
            "max_grad_norm",
            {"max_grad_norm": 0.5},
            "max_grad_norm=0.5 is not allowed: DeepSpeed "
            'clips at its config\'s "gradient_clipping": 0.0',
        ),
        (
            "precision",
            {"precision": "bf16"},
            "precision='bf16' is not allowed with DeepSpeed, whose config runs fp32",
        ),
    ):
        with pytest.raises(ValueError, match=match) as info:
            bigbatch.Accumulator(eng, **{"optimizer": optimizer, **kwargs})
        out[name] = str(info.value)
    eng2, optimizer2 = built(stage=2)
    with pytest.raises(
        ValueError, match='micro_batch_size="auto" on 2 ranks cannot run ZeRO stage 2'
    ):
        bigbatch.Accumulator(eng2, optimizer2, micro_batch_size="auto")
    with pytest.warns(bigbatch.BigBatchWarning, match="gradient_accumulation_steps=2 is not used"):
        bigbatch.Accumulator(*built(gradient_accumulation_steps=2))
    out["nothing_changed"] = _nothing_changed(built)
    out["skipped"] = {stage: _skipped(built, stage) for stage in (1, 2, 3)}
    out["bf16"] = _bf16(built)
    return out


def _nan_gradient(m, mb):
    """A finite loss whose gradient is NaN (sqrt's at 0, times 0): only the step can see it."""
    logits = m(mb["input_ids"]).double()
    labels = mb["labels"].reshape(-1)
    loss_sum = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels, ignore_index=-100, reduction="sum"
    )
    return loss_sum + torch.sqrt(logits.sum() * 0.0), (labels != -100).sum()


def _skipped(built, stage):
    """A NaN gradient: DeepSpeed skips the step (ZeRO checks the norm even in float32); bigbatch
    reports it, or raises NonFiniteError by default, the engine unchanged either way."""
    eng, optimizer = built(stage=stage)
    before = gathered(eng)
    mb = windows(seed=0, world=1)[0][0]
    skip = bigbatch.Accumulator(eng, optimizer, micro_batch_size=MICRO, nonfinite="skip")
    result = skip.train_step(mb, _nan_gradient, count_fn=counts)
    with pytest.raises(bigbatch.NonFiniteError, match="the window's gradient norm is inf"):
        bigbatch.Accumulator(eng, optimizer, MICRO).train_step(mb, _nan_gradient, count_fn=counts)
    after = gathered(eng)
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    return result.skipped, result.nonfinite, unchanged


def _bf16(built):
    """DeepSpeed's bf16 (the config's): the engine casts the model; bigbatch reports bf16."""
    eng, optimizer = built(stage=2, bf16={"enabled": True})
    acc = bigbatch.Accumulator(eng, optimizer, micro_batch_size=MICRO, precision="bf16")
    result = acc.train_step(windows(seed=0, world=1)[0][0], token_loss, count_fn=counts)
    return acc.precision, result.skipped, math.isfinite(result.grad_norm)


def _nothing_changed(built):
    """Refused windows under ZeRO 2 (whose partial sums live in the engine's own buffers): the
    engine then trains as a fresh one does, to the bit."""
    eng, optimizer = built(stage=2)
    acc = bigbatch.Accumulator(eng, optimizer, micro_batch_size=MICRO)
    mb = windows(seed=0, world=1)[0][0]
    with pytest.raises(ValueError, match="under DeepSpeed each backward carries 1 / the window's"):
        with acc.micro_batch():
            acc.backward(*token_loss(eng, mb))
    with pytest.raises(
        ValueError,
        match="accumulate_grads.. cannot add gradients to an FSDP model or a DeepSpeed engine",
    ):
        acc.accumulate_grads([torch.zeros_like(p) for p in eng.module.parameters()], 1)
    with pytest.raises(bigbatch.NonFiniteError, match="the window's loss is nan"):
        acc.train_step(mb, lambda m, b: (token_loss(m, b)[0] * math.nan, counts(b)))
    with pytest.raises(ValueError, match="count_fn counted .* loss_fn's counts add up to"):
        acc.train_step(mb, token_loss, count_fn=lambda b: counts(b) + 1)
    acc.train_step(mb, token_loss)
    fresh, fresh_optimizer = built(stage=2)
    bigbatch.Accumulator(fresh, fresh_optimizer, micro_batch_size=MICRO).train_step(mb, token_loss)
    got, want = gathered(eng), gathered(fresh)
    return all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def refused():
    return run_ranks(_refused, world_size=2, timeout_s=600)[0]


@pytest.mark.parametrize(
    "setting",
    [
        "managed",
        "overlap_comm",
        "zero0",
        "deepcompile",
        "optimizer",
        "scheduler",
        "max_grad_norm",
        "precision",
    ],
)
def test_refused_in_one_line(refused, setting):
    assert "\n" not in refused[setting] and len(refused[setting]) < 300


def test_a_refused_backward_changes_nothing(refused):
    assert refused["nothing_changed"]


def test_deepspeeds_own_accumulation_of_means_is_measured_beside_it(runs):
    """The usual per-micro-batch mean under DeepSpeed's managed accumulation: a mean of means,
    off the full batch by ~1e-2 here (printed); bigbatch on the same windows: exact."""
    stage, ranks = runs
    want = reference(windows(seed=stage, world=2, samples=FIXED), OPTIMIZERS["sgd_momentum"])
    managed = relative_error(ranks[0]["managed"], want["params"])
    exact = relative_error(ranks[0]["fixed"], want["params"])
    print(f"ZeRO-{stage}: DeepSpeed's own accumulation {managed:.2e}, bigbatch {exact:.2e}")
    assert exact < 1e-6 < 1e-3 < managed


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_deepspeed_skips_is_reported_as_skipped(refused, stage):
    assert refused["skipped"][stage] == (True, True, True)


def test_bf16_is_the_configs(refused):
    assert refused["bf16"] == ("bf16", False, True)

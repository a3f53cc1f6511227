"""The engine against the plain full-batch reference: the exactness table (float64, ~1e-10)."""

from __future__ import annotations

import copy
import functools
import gc

import pytest
import torch
import torch.nn.functional as F
from cases import OPTIMIZERS  # the optimizers every exactness test uses
from models import (
    PAD,
    causal_lm,
    classification_batch,
    cnn,
    lm_token_loss,
    mean_ce,
    mlp,
    padded_lm_batch,
)
from reference import full_batch_step, max_relative_error

import bigbatch

MODELS = {
    "mlp": (mlp, lambda n, g, dt: classification_batch(n, dt, g), mean_ce),
    "cnn": (cnn, lambda n, g, dt: classification_batch(n, dt, g, image=True), mean_ce),
    "causal_lm": (causal_lm, lambda n, g, dt: padded_lm_batch(n, g), lm_token_loss),
    # right-padded text with its mask: each micro-batch is trimmed to its longest sample
    "causal_lm_masked": (causal_lm, lambda n, g, dt: masked(padded_lm_batch(n, g)), lm_token_loss),
}


def masked(batch: dict) -> dict:
    return {**batch, "attention_mask": (batch["labels"] != PAD).long()}


def _eps(make_opt, eps, params):
    opt = make_opt(params)
    for group in opt.param_groups:
        group["eps"] = eps
    return opt


def _twins(make_model, make_opt, dtype, scheduler=False):
    ref = make_model(dtype)
    eng = copy.deepcopy(ref)
    opt_ref, opt_eng = make_opt(ref.parameters()), make_opt(eng.parameters())

    def sched(o):
        return torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) if scheduler else None

    return ref, eng, opt_ref, opt_eng, sched(opt_ref), sched(opt_eng)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("n,micro", [(10, 4), (10, 5), (10, 1), (10, 10), (10, 32), (9, 2)])
def test_train_step_equals_full_batch_float64(model_name, opt_name, n, micro, gen):
    make_model, make_batch, loss_fn = MODELS[model_name]
    ref, eng, opt_ref, opt_eng, _, _ = _twins(make_model, OPTIMIZERS[opt_name], torch.float64)
    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size=micro)
    for _ in range(3):
        batch = make_batch(n, gen, torch.float64)
        ref_loss = full_batch_step(ref, opt_ref, loss_fn, batch)
        result = acc.train_step(batch, loss_fn)
        assert result.loss == pytest.approx(ref_loss, rel=1e-10)
        assert result.micro_batches == -(-n // micro)
        assert result.samples == n
        if "attention_mask" in batch:  # real and computed tokens, as token cuts report them
            lengths = batch["attention_mask"].sum(-1).tolist()
            cuts = [lengths[i : i + micro] for i in range(0, n, micro)]
            assert result.tokens == sum(lengths)
            assert result.padded_tokens == sum(len(c) * max(c) for c in cuts)
    assert max_relative_error(ref, eng) < 1e-10


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("micro", [3, 4])
def test_clipping_and_scheduler_once_per_step(opt_name, micro, gen):
    ref, eng, opt_ref, opt_eng, s_ref, s_eng = _twins(
        mlp, OPTIMIZERS[opt_name], torch.float64, True
    )
    acc = bigbatch.Accumulator(
        eng, opt_eng, micro_batch_size=micro, scheduler=s_eng, max_grad_norm=0.05
    )
    for _ in range(4):
        batch = classification_batch(10, torch.float64, gen)
        full_batch_step(ref, opt_ref, mean_ce, batch, scheduler=s_ref, max_grad_norm=0.05)
        result = acc.train_step(batch, mean_ce)
        assert result.grad_norm > 0.05  # clipping really bit
    assert s_eng.get_last_lr() == pytest.approx(s_ref.get_last_lr(), rel=1e-12)
    assert max_relative_error(ref, eng) < 1e-10


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("cuts", [[4, 4, 2], [1, 9], [3, 3, 3, 1]])
def test_low_level_path_equals_full_batch(opt_name, cuts, gen):
    ref, eng, opt_ref, opt_eng, _, _ = _twins(causal_lm, OPTIMIZERS[opt_name], torch.float64)
    acc = bigbatch.Accumulator(eng, opt_eng)
    for _ in range(3):
        batch = padded_lm_batch(sum(cuts), gen)
        full_batch_step(ref, opt_ref, lm_token_loss, batch)
        start = 0
        for i, size in enumerate(cuts):
            piece = {k: v[start : start + size] for k, v in batch.items()}
            start += size
            with acc.micro_batch(last=i == len(cuts) - 1):
                acc.backward(*lm_token_loss(eng, piece))
        result = acc.step()
        assert result.micro_batches == len(cuts) and result.micro_batch_size is None
    assert max_relative_error(ref, eng) < 1e-10


def _weighted_ce(model, batch):
    """Per-sample weights (the third column): a sum of weighted losses over the weights' sum."""
    x, y, w = batch
    return (w * F.cross_entropy(model(x), y, reduction="none")).sum(), w.sum()


def _nothing_counted(cause, gen):
    """A model, its loss and 4 batches of 10 whose 2nd and 3rd count nothing: every label
    ignored (a causal LM) or every sample weight 0 (an MLP)."""
    if cause == "labels":
        batches = [padded_lm_batch(10, gen) for _ in range(4)]
        for b in batches[1:3]:
            b["labels"][:] = PAD
        return causal_lm, lm_token_loss, batches
    batches = [(*classification_batch(10, torch.float64, gen), torch.rand(10, generator=gen,
                dtype=torch.float64) * (i not in (1, 2))) for i in range(4)]  # fmt: skip
    return mlp, _weighted_ce, batches


@pytest.mark.parametrize("cause", ["labels", "weights"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("path", ["train_step", "low_level"])
def test_a_window_that_counts_nothing_steps_with_a_zero_gradient(cause, opt_name, path, gen):
    """As the full batch does (transformers' Trainer, Keras): the optimizer steps on a zero
    gradient (AdamW decays, SGD's momentum moves), the loss is 0, one warning for two such
    windows. Before, the window raised and stopped training."""
    make_model, loss_fn, batches = _nothing_counted(cause, gen)
    ref, eng, opt_ref, opt_eng, _, _ = _twins(make_model, OPTIMIZERS[opt_name], torch.float64)
    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size=4)
    with pytest.warns(bigbatch.BigBatchWarning, match="total count is 0") as warned:
        for batch in batches:
            want = full_batch_step(ref, opt_ref, loss_fn, batch)
            if path == "train_step":
                result = acc.train_step(batch, loss_fn)
            else:
                for i, piece in enumerate(bigbatch.split(batch, 4)):
                    with acc.micro_batch(last=i == 2):
                        acc.backward(*loss_fn(eng, piece))
                result = acc.step()
            assert result.loss == pytest.approx(want, rel=1e-10, abs=0)
            assert max_relative_error(ref, eng) < 1e-10
    assert [str(w.message)[:20] for w in warned] == ["a window's total cou"]


def test_naive_mean_over_k_is_wrong_on_padded_data_but_engine_is_right(gen):
    """The tutorial loop (each micro-batch mean / k) trains a different model on padded data."""
    ref, eng, opt_ref, opt_eng, _, _ = _twins(causal_lm, OPTIMIZERS["sgd_momentum"], torch.float64)
    naive = copy.deepcopy(ref)
    opt_naive = OPTIMIZERS["sgd_momentum"](naive.parameters())
    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size=4)
    for _ in range(3):
        batch = padded_lm_batch(10, gen)
        full_batch_step(ref, opt_ref, lm_token_loss, batch)
        acc.train_step(batch, lm_token_loss)
        pieces = bigbatch.split(batch, 4)
        for piece in pieces:
            loss_sum, count = lm_token_loss(naive, piece)
            (loss_sum / count / len(pieces)).backward()
        opt_naive.step()
        opt_naive.zero_grad()
    assert max_relative_error(ref, eng) < 1e-10
    assert max_relative_error(ref, naive) > 1e-4


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_float32_within_1e5(model_name, opt_name, gen):
    make_model, make_batch, loss_fn = MODELS[model_name]
    make_opt = OPTIMIZERS[opt_name]
    if opt_name == "adamw":  # Adam's first step is lr * g / (|g| + eps): at eps 1e-8 a gradient
        # element within float32 rounding of 0 moves by up to lr either way (measured: 1.3e-5 on
        # this CPU, SGD's parameters 1e-8 apart); at 1e-6 the rounding moves it by lr / 100
        make_opt = functools.partial(_eps, make_opt, 1e-6)
    ref, eng, opt_ref, opt_eng, _, _ = _twins(make_model, make_opt, torch.float32)
    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size=3)
    for _ in range(3):
        batch = make_batch(10, gen, torch.float32)
        full_batch_step(ref, opt_ref, loss_fn, batch)
        acc.train_step(batch, loss_fn)
    assert max_relative_error(ref, eng) < 1e-5


def test_dict_batch_with_non_tensor_leaves_and_namedtuple(gen):
    from collections import namedtuple

    Pair = namedtuple("Pair", "x y")
    seen = []

    def loss_fn(model, mb):
        seen.append((type(mb["pair"]).__name__, mb["tag"]))
        return F.cross_entropy(model(mb["pair"].x), mb["pair"].y)

    model = mlp()
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4
    )
    x, y = classification_batch(10, torch.float64, gen)
    assert acc.train_step({"pair": Pair(x, y), "tag": "keep"}, loss_fn).micro_batches == 3
    assert seen == [("Pair", "keep")] * 3


@pytest.mark.slow  # hundreds of steps
def test_memory_stays_flat_over_hundreds_of_steps(gen):
    """Nothing (running loss, result) keeps a graph alive from one step to the next."""
    import weakref

    model = mlp(torch.float32)
    acc = bigbatch.Accumulator(model, torch.optim.AdamW(model.parameters()), micro_batch_size=3)
    batch = classification_batch(10, torch.float32, gen)
    results, losses = [], []

    def loss_fn(m, mb):
        loss = mean_ce(m, mb)
        losses.append(weakref.ref(loss))
        return loss

    for step in range(300):
        results.append(acc.train_step(batch, loss_fn))
        if step == 50:
            gc.collect()
            baseline = len(gc.get_objects())
    gc.collect()
    assert all(ref() is None for ref in losses), "a loss tensor (and its graph) outlived its step"
    assert len(gc.get_objects()) - baseline < 2000  # 250 StepResults ~ 250 objects; no graphs
    assert all(isinstance(r.loss, float) for r in results)


def test_fp16_skips_step_and_scheduler_on_inf(gen):
    model = mlp(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    acc = bigbatch.Accumulator(model, opt, micro_batch_size=4, scheduler=sched, precision="fp16")
    before = copy.deepcopy(model.state_dict())
    batch = classification_batch(10, torch.float32, gen)
    result = acc.train_step(batch, lambda m, b: mean_ce(m, b) * float("inf"))
    assert result.skipped
    assert sched.last_epoch == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    result = acc.train_step(batch, mean_ce)
    assert not result.skipped and sched.last_epoch == 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_close_to_fp32_reference(precision, gen):
    ref, eng, opt_ref, opt_eng, _, _ = _twins(mlp, OPTIMIZERS["adamw"], torch.float32)
    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size=4, precision=precision)
    for _ in range(3):
        batch = classification_batch(10, torch.float32, gen)
        full_batch_step(ref, opt_ref, mean_ce, batch)
        result = acc.train_step(batch, mean_ce)
        assert not result.skipped
    assert max_relative_error(ref, eng) < 5e-2

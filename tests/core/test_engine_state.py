"""What the engine owns: ``state_dict`` / ``load_state_dict``, the sizing policy, gradients given
from elsewhere (``accumulate_grads``), and schedulers stepped once per optimizer step."""

from __future__ import annotations

import copy

import pytest
import torch
from models import TinyCausalLM, classification_batch, mean_ce, mlp
from reference import full_batch_step, max_relative_error
from refusals import assert_refused

import bigbatch
from bigbatch.core._sizing import Sizing


def _failing_above(limit: int):
    """A loss whose forward really raises the allocator's error type above ``limit`` samples."""

    def loss(model, batch):
        if len(batch[1]) > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. ({len(batch[1])} > {limit})")
        return mean_ce(model, batch)

    return loss


def test_state_dict_round_trip_keeps_the_adopted_micro_batch(gen):
    model = mlp()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto")
    batch = classification_batch(10, torch.float64, gen)
    assert acc.train_step(batch, _failing_above(4)).micro_batch_size == 2
    state = acc.state_dict()
    assert state["sizing"]["policy"] == "auto" and state["sizing"]["size"] == 2
    other = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto")
    other.load_state_dict(state)
    result = other.train_step(batch, _failing_above(4))
    assert (result.micro_batch_size, result.oom_retries) == (2, 0)  # no new search


def test_state_dict_holds_the_loss_scaler():
    model = mlp(torch.float32)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 4, precision="fp16"
    )
    state = acc.state_dict()
    assert state["scaler"]["scale"] == 65536.0
    state["scaler"]["scale"] = 1024.0
    acc.load_state_dict(state)
    assert acc.state_dict()["scaler"]["scale"] == 1024.0


def test_state_dict_is_refused_mid_window_and_across_policies(gen):
    model = mlp()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    x, y = classification_batch(4, torch.float64, gen)
    with acc.micro_batch():
        acc.backward(mean_ce(model, (x, y)) * 4, 4)
    with pytest.raises(RuntimeError, match=r"state_dict\(\) called in the middle of a window"):
        acc.state_dict()
    acc.step()
    fixed = acc.state_dict()
    auto = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto")
    with pytest.raises(
        ValueError, match=r"saved with a fixed micro-batch size.*micro_batch_size=4"
    ):
        auto.load_state_dict(fixed)
    eight = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 8)
    with pytest.raises(ValueError, match=r"holds micro_batch_size=4, this Accumulator uses 8"):
        eight.load_state_dict(fixed)
    fp16 = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 4, precision="fp16"
    )
    with pytest.raises(
        ValueError, match=r"saved with no loss scaler; this Accumulator uses precision='fp16'"
    ):
        fp16.load_state_dict(fixed)


def test_sizing_is_chosen_once():
    assert Sizing("auto").retries and not Sizing(3).retries  # auto redoes; fixed raises
    with pytest.raises(
        ValueError, match=r'micro_batch_size=0 is not allowed: use a positive integer or "auto"'
    ):
        Sizing(0)
    assert Sizing(4).size_for(3) == 3 and Sizing("auto").size_for(7) == 7


@pytest.mark.parametrize("kind", ["list", "dict", "generator"])
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_accumulate_grads_equals_the_full_batch(opt_name, kind, gen):
    """Gradients computed elsewhere (here torch.autograd.grad of each micro-batch's loss sum),
    as a dict, a list or a generator (before: "object of type 'generator' has no len()")."""
    make_opt = {
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    }[opt_name]
    ref, ours = mlp(), mlp()
    opt_ref, opt = make_opt(ref.parameters()), make_opt(ours.parameters())
    acc = bigbatch.Accumulator(ours, opt, micro_batch_size=4, max_grad_norm=0.5)
    params = list(ours.parameters())
    for _ in range(3):
        batch = classification_batch(10, torch.float64, gen)
        full_batch_step(ref, opt_ref, mean_ce, batch, max_grad_norm=0.5)
        for piece in bigbatch.split(batch, 4):  # 4 + 4 + 2
            n = len(piece[1])
            loss_sum = mean_ce(ours, piece) * n
            grads = torch.autograd.grad(loss_sum, params)
            given = {
                "list": list(grads), "dict": dict(zip(params, grads, strict=True)),
                "generator": (g for g in grads),
            }[kind]  # fmt: skip
            acc.accumulate_grads(given, n, loss_sum)
        result = acc.step()
    assert max_relative_error(ref, ours) < 1e-10
    assert result.micro_batches == 3 and result.count == 10


def test_accumulate_grads_refuses_what_does_not_match(gen):
    model = mlp()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    with pytest.raises(ValueError, match=r"got 1 gradients for the optimizer's 6 parameters"):
        acc.accumulate_grads([torch.zeros(1)], 3)
    first = next(model.parameters())
    with assert_refused(
        model, ValueError, match=r"a gradient of shape \(2,\) for a parameter of shape \(16, 6\)"
    ):
        acc.accumulate_grads({first: torch.zeros(2)}, 3)
    for wrong, kind in [(5, "int"), (first, "Parameter")]:
        with pytest.raises(
            TypeError,
            match=rf"accumulate_grads\(\) got grads of type {kind}: pass \{{parameter: gradient\}}",
        ):
            acc.accumulate_grads(wrong, 3)


def test_reduce_lr_on_plateau_is_stepped_with_the_window_loss(gen):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the loss never improves
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    acc = bigbatch.Accumulator(model, opt, 4, scheduler=plateau)
    opt.param_groups[0]["lr"] = 0.0
    batch = classification_batch(8, torch.float64, gen)
    losses = [acc.train_step(batch, mean_ce).loss for _ in range(3)]
    assert plateau.best == pytest.approx(min(losses))
    assert plateau.num_bad_epochs == 0 and plateau.last_epoch == 3  # stepped once per step


def test_current_micro_batch_size(gen):
    model = mlp()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto")
    assert acc.current_micro_batch_size is None  # auto: the whole batch first
    acc.train_step(classification_batch(10, torch.float64, gen), _failing_above(3))
    assert acc.current_micro_batch_size == 2
    assert copy.copy(acc).precision == "fp32"


@pytest.mark.parametrize(
    "saved, loaded",
    [
        ({"micro_batch_tokens": "auto"}, {"micro_batch_size": "auto"}),
        ({"micro_batch_size": "auto"}, {"micro_batch_tokens": "auto"}),
        ({"micro_batch_tokens": 120}, {"micro_batch_size": 120}),
    ],
    ids=["tokens into samples", "samples into tokens", "fixed"],
)
def test_a_state_of_another_sizing_is_refused_naming_both(saved, loaded, gen):
    """Issue 37: a micro_batch_tokens="auto" state loaded into micro_batch_size="auto" silently
    (its next window cut at 120 samples, the token budget), and the reverse."""
    model = TinyCausalLM().double()
    batch = {"input_ids": torch.randint(1, 17, (6, 8), generator=gen)}
    batch.update(attention_mask=torch.ones_like(batch["input_ids"]), labels=batch["input_ids"])
    loss = lambda m, b: bigbatch.token_cross_entropy(m(b["input_ids"]), b["labels"], shift=True)  # noqa: E731
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **saved)
    acc.train_step(batch, loss)
    other = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **loaded)
    (name, value), (mine, _) = next(iter(saved.items())), next(iter(loaded.items()))
    shown = '"auto"' if value == "auto" else value
    with pytest.raises(ValueError, match=rf"saved with {name}={shown} .* sizes {mine}: build it"):
        other.load_state_dict(acc.state_dict())
    assert other.current_micro_batch_size is None or other.current_micro_batch_size == value

"""Every bad-input error of the engine, the split and the loss contract, matched by message.

And: a step that fails leaves the parameters, the optimizer state and ``.grad`` as they were.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from models import (
    PAD,
    causal_lm,
    classification_batch,
    lm_token_loss,
    mean_ce,
    mlp,
    padded_lm_batch,
)
from reference import full_batch_step, max_relative_error
from refusals import assert_refused
from torch import nn

import bigbatch
from bigbatch.core._stepping import NonFiniteError
from bigbatch.core.split import split


def _acc(**kwargs):
    model = mlp()
    return bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def _batch(gen, n=10):
    return classification_batch(n, torch.float64, gen)


# ---------------------------------------------------------------- micro_batch_size
@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_micro_batch_size(value):
    with pytest.raises(
        ValueError,
        match=rf"micro_batch_size={value} is not allowed: use a positive integer or \"auto\"",
    ):
        _acc(micro_batch_size=value)


@pytest.mark.parametrize("value", [2.5, 4.0, "8", "Auto"])
def test_non_integer_micro_batch_size(value):
    with pytest.raises(
        TypeError,
        match=rf"micro_batch_size={re.escape(repr(value))} is not allowed: use a positive integer",
    ):
        _acc(micro_batch_size=value)


def test_micro_batch_size_none_is_the_default_of_32():
    """``None`` is the default: 32 samples (no row cap with ``micro_batch_tokens``)."""
    assert _acc(micro_batch_size=None).current_micro_batch_size == 32


def test_bool_micro_batch_size():
    with pytest.raises(TypeError, match=r"micro_batch_size=True is not allowed"):
        _acc(micro_batch_size=True)


@pytest.mark.parametrize("typo", ["Auto", "atuo", "auto "])
def test_auto_typo(typo):
    with pytest.raises(
        TypeError, match=rf"micro_batch_size={re.escape(repr(typo))} is not allowed: .*\"auto\""
    ):
        _acc(micro_batch_size=typo)


def test_split_checks_micro_batch_size_too():
    with pytest.raises(ValueError, match=r"micro_batch_size=0 is not allowed"):
        split(torch.zeros(4, 2), 0)


# ---------------------------------------------------------------- the batch
def test_tensors_disagree_on_first_dimension(gen):
    batch = {
        "x": torch.randn(10, 6, dtype=torch.float64, generator=gen),
        "y": torch.zeros(9, dtype=torch.long),
    }
    with pytest.raises(
        ValueError,
        match=r"disagree on the first \(sample\) dimension \(batch\['x'\] has 10, batch\['y'\] has 9\)",
    ):
        _acc(micro_batch_size=4).train_step(batch, lambda m, b: F.cross_entropy(m(b["x"]), b["y"]))


def test_empty_batch():
    batch = (torch.zeros(0, 6, dtype=torch.float64), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"the batch is empty \(first dimension 0\)"):
        _acc(micro_batch_size=4).train_step(batch, mean_ce)


@pytest.mark.parametrize("batch", [[], {"ids": [1, 2, 3]}, "text", None])
def test_batch_without_tensors(batch):
    with pytest.raises(
        TypeError, match=r"batch: found no tensor in a \w+; pass a tensor or a tuple"
    ):
        _acc(micro_batch_size=4).train_step(batch, mean_ce)


def test_zero_dimensional_tensor_in_batch():
    with pytest.raises(TypeError, match=r"batch\[1\] is a 0-dimensional tensor"):
        _acc(micro_batch_size=4).train_step(
            (torch.zeros(10, 6, dtype=torch.float64), torch.tensor(3)), mean_ce
        )


# ---------------------------------------------------------------- the loss contract
def test_non_scalar_loss(gen):
    per_sample = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")  # noqa: E731
    with pytest.raises(
        ValueError, match=r"loss_fn's return value has shape \(4,\); it must be a scalar"
    ):
        _acc(micro_batch_size=4).train_step(_batch(gen), per_sample)


def test_non_scalar_loss_sum_in_pair(gen):
    pair = lambda m, b: (F.cross_entropy(m(b[0]), b[1], reduction="none"), len(b[1]))  # noqa: E731
    with pytest.raises(
        ValueError, match=r"loss_fn's loss_sum has shape \(4,\); it must be a scalar"
    ):
        _acc(micro_batch_size=4).train_step(_batch(gen), pair)


@pytest.mark.parametrize(
    "output, message",
    [
        (
            1.5,
            r"loss_fn returned float; return a scalar tensor .* a pair \(loss_sum, count\) or named terms",
        ),
        (None, r"loss_fn returned NoneType; return a scalar tensor"),
        ((torch.ones(()), 1, 2), r"loss_fn returned tuple; return a scalar tensor"),
        ((2.0, 4), r"loss_fn returned a pair whose first item is a float; it must be the loss sum"),
    ],
)
def test_loss_fn_returns_the_wrong_type(output, message, gen):
    with pytest.raises(TypeError, match=message):
        _acc(micro_batch_size=4).train_step(_batch(gen), lambda m, b: output)


@pytest.mark.parametrize(
    "count, error, message",
    [
        (-1, ValueError, r"loss_fn's count=-1 is negative; it must count the items summed over"),
        ("4", TypeError, r"loss_fn's count='4' is not a number"),
        (True, TypeError, r"loss_fn's count=True is not a number"),
        (torch.ones(2), ValueError, r"loss_fn's count has shape \(2,\); it must be a scalar"),
    ],
)
def test_bad_count(count, error, message, gen):
    with pytest.raises(error, match=message):
        _acc(micro_batch_size=4).train_step(_batch(gen), lambda m, b: (m(b[0]).sum(), count))


def test_backward_rejects_non_scalar_loss_sum():
    acc = _acc()
    with pytest.raises(ValueError, match=r"loss_sum has shape \(2, 3\); it must be a scalar"):
        acc.backward(torch.ones(2, 3, requires_grad=True), 6)


def _snapshot(acc):
    params = [p.detach().clone() for p in acc.model.parameters()]
    state = copy.deepcopy(acc.optimizer.state_dict())
    return params, state


def _assert_unchanged(acc, snapshot):
    params, state = snapshot
    for before, p in zip(params, acc.model.parameters(), strict=True):
        assert torch.equal(before, p)
        assert p.grad is None
    now = acc.optimizer.state_dict()
    assert now["param_groups"] == state["param_groups"]
    assert now["state"].keys() == state["state"].keys()
    for key, values in state["state"].items():
        for name, value in values.items():
            other = now["state"][key][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def test_a_sum_over_a_count_of_0_is_refused_and_changes_nothing(gen):
    """A sum with nothing to average over has no full-batch value (sum / 0); a window that
    counts nothing with a sum of 0 steps on a zero gradient instead (test_engine.py)."""
    model = mlp()
    acc = bigbatch.Accumulator(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), micro_batch_size=4
    )
    acc.train_step(_batch(gen), mean_ce)  # the optimizer now has state to protect
    before = _snapshot(acc)
    no_items = lambda m, b: (m(b[0]).sum(), 0)  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"term 'loss' sums to -?[\d.]+ over a count of 0: with no item to average over it "
        r"has no full-batch value \(sum / 0\).* nothing was changed",
    ):
        acc.train_step(_batch(gen), no_items)
    _assert_unchanged(acc, before)
    acc.train_step(_batch(gen), mean_ce)  # usable afterwards


def _labelled(batch):
    """The count of ``lm_token_loss`` (labels shifted by one, padding ignored): a tensor."""
    return (batch["labels"][:, 1:] != PAD).sum()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(
    "count_fn, error, message",
    [
        (lambda b: math.nan, ValueError, r"count_fn's result 'loss'=nan is not finite"),
        (lambda b: -3, ValueError, r"count_fn's result 'loss'=-3 is negative"),
        (lambda b: torch.tensor(math.nan), ValueError, r"count_fn counted nan before the window"),
        (lambda b: torch.tensor(-2), ValueError, r"count_fn counted -6 before the window"),
        (lambda b: 0, ValueError, r"count_fn counted 0 before the window"),
        (lambda b: 1, ValueError, r"count_fn counted 3 before the window"),
        (lambda b: torch.tensor(1), ValueError, r"count_fn counted 3 before the window"),
        (lambda b: _labelled(b) * 2, ValueError, r"count_fn counted \d+ before the window"),
    ],
    ids=["nan", "negative", "tensor nan", "tensor negative", "0", "1", "tensor 1", "double"],
)
def test_a_count_fn_that_is_not_the_losss_count_is_refused(
    count_fn, error, message, precision, gen
):
    """The backward runs at ``1 / count_fn``'s total: a wrong count sets another scale than the
    full batch's, and in fp16 the step overflowed and was skipped silently. Checked at the step,
    from the totals it reads anyway; nothing changed, and a right count_fn trains on."""
    model = causal_lm()
    acc = bigbatch.Accumulator(model, torch.optim.AdamW(model.parameters()), micro_batch_size=4,
                               precision=precision)  # fmt: skip
    acc.train_step(padded_lm_batch(10, gen), lm_token_loss, count_fn=_labelled)
    before, batch = _snapshot(acc), padded_lm_batch(10, gen)
    with pytest.raises(error, match=message) as refused:
        acc.train_step(batch, lm_token_loss, count_fn=count_fn)
    if "window" in message:  # the loss's count, named
        assert f"loss_fn's counts add up to {int(_labelled(batch))}: count_fn must" in str(
            refused.value
        )
    _assert_unchanged(acc, before)
    assert not acc.train_step(batch, lm_token_loss, count_fn=_labelled).skipped


# ---------------------------------------------------------------- misuse of the two paths
def test_step_with_nothing_accumulated():
    with pytest.raises(
        RuntimeError,
        match=r"step\(\) called with nothing accumulated: call backward\(loss_sum, count\)",
    ):
        _acc().step()


def test_train_step_with_pending_backward(gen):
    acc = _acc(micro_batch_size=4)
    x, y = _batch(gen)
    acc.backward(F.cross_entropy(acc.model(x), y, reduction="sum"), len(y))
    with pytest.raises(
        RuntimeError,
        match=r"train_step\(\) called while 1 micro-batch\(es\) from backward\(\) await a step\(\)",
    ):
        acc.train_step((x, y), mean_ce)
    acc.step()  # the pending window is still intact and can be stepped


def test_train_step_with_gradients_already_present(gen):
    acc = _acc(micro_batch_size=4)
    x, y = _batch(gen)
    mean_ce(acc.model, (x, y)).backward()
    with pytest.raises(
        RuntimeError,
        match=r"found gradients already in the parameters' \.grad.*zero_grad\(set_to_none=True\)",
    ):
        acc.train_step((x, y), mean_ce)


def test_backward_outside_micro_batch_under_bf16(gen):
    acc = _acc(precision="bf16")
    x, y = classification_batch(4, torch.float64, gen)
    with pytest.raises(
        RuntimeError,
        match=r"precision='bf16' needs the forward under autocast: .*acc\.micro_batch\(last=\.\.\.\)",
    ):
        acc.backward(F.cross_entropy(acc.model(x), y, reduction="sum"), 4)


# ---------------------------------------------------------------- constructor arguments
@pytest.mark.parametrize("name", ["fp8", "float32", "BF16", ""])
def test_unknown_precision(name):
    with pytest.raises(
        ValueError,
        match=rf"precision={re.escape(repr(name))} is not allowed: use one of 'fp32', 'bf16', 'fp16'",
    ):
        _acc(precision=name)


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_bad_max_grad_norm(value):
    with pytest.raises(
        ValueError,
        match=rf"max_grad_norm={re.escape(repr(value))} is not allowed: use a positive number or None",
    ):
        _acc(max_grad_norm=value)


@pytest.mark.parametrize("value", ["6 gigs", "GiB", "6QB", "-1GiB"])
def test_bad_memory_budget_string(value):
    with pytest.raises(
        ValueError,
        match=rf"memory_budget={re.escape(repr(value))} is not a size: write a number with a unit, e\.g\. memory_budget=\"6GiB\"",
    ):
        _acc(memory_budget=value)


@pytest.mark.parametrize("value", ["0GiB", 0, -5])
def test_non_positive_memory_budget(value):
    with pytest.raises(
        ValueError,
        match=rf"memory_budget={re.escape(repr(value))} is not a positive finite size: e\.g\. memory_budget=\"6GiB\"",
    ):
        _acc(memory_budget=value)


# ---------------------------------------------------------------- a failing step changes nothing
class _FailOnCall:
    """A loss_fn that fails on its ``n``-th call (with ``error``), and works otherwise."""

    def __init__(self, n, error):
        self.calls, self.n, self.error = 0, n, error

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls == self.n:
            if self.error == "non-scalar":
                return F.cross_entropy(model(batch[0]), batch[1], reduction="none")
            raise self.error
        return mean_ce(model, batch)


@pytest.mark.parametrize(
    "error", [KeyError("labels"), "non-scalar"], ids=["user-exception", "bad-loss"]
)
@pytest.mark.parametrize("micro", [4, 3])  # 10 = 4+4+2 and 3+3+3+1
def test_failure_in_second_micro_batch_changes_nothing(error, micro, gen):
    ref = mlp()
    model = copy.deepcopy(ref)
    make_opt = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)  # noqa: E731
    opt_ref, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    acc = bigbatch.Accumulator(model, opt, micro_batch_size=micro, max_grad_norm=0.5)
    first = _batch(gen)
    full_batch_step(ref, opt_ref, mean_ce, first, max_grad_norm=0.5)
    acc.train_step(first, mean_ce)  # the optimizer has state now
    before = _snapshot(acc)
    failing = _FailOnCall(2, error)  # the window's first micro-batch has back-propagated by then
    with pytest.raises(
        (KeyError, ValueError), match=rf"labels|has shape \({micro},\); it must be a scalar"
    ):
        acc.train_step(_batch(gen), failing)
    assert failing.calls == 2
    _assert_unchanged(acc, before)
    batch = _batch(gen)
    full_batch_step(ref, opt_ref, mean_ce, batch, max_grad_norm=0.5)
    acc.train_step(batch, mean_ce)
    assert max_relative_error(ref, model) < 1e-10


# ---------------------------------------------------------------- counts (issue 10, item 3)
@pytest.mark.parametrize(
    "count", [-4.0, float("nan"), float("inf")], ids=["negative", "nan", "inf"]
)
def test_a_bad_tensor_count_is_refused_at_step_and_changes_nothing(count, gen):
    """A tensor count lives on the device: it is checked once, at step, before anything changes."""
    acc = _acc(micro_batch_size=4)
    acc.train_step(_batch(gen), mean_ce)
    before = _snapshot(acc)
    calls = [0]

    def second_is_bad(model, batch):
        calls[0] += 1
        loss_sum = F.cross_entropy(model(batch[0]), batch[1], reduction="sum")
        return loss_sum, torch.tensor(count if calls[0] == 2 else float(len(batch[1])))

    with pytest.raises(
        ValueError,
        match=r"^1 micro-batch count\(s\) were negative or not finite: a count must be the number "
        r"of items summed over\. The window was discarded; nothing was changed\.$",
    ):
        acc.train_step(_batch(gen), second_is_bad)
    _assert_unchanged(acc, before)


@pytest.mark.parametrize(
    "count, what", [(float("nan"), "not finite"), (float("inf"), "not finite"), (-2.5, "negative")]
)
def test_a_bad_python_count_is_refused_at_once(count, what, gen):
    with pytest.raises(
        ValueError,
        match=rf"^loss_fn's count={re.escape(repr(count))} is {what}; it must count the items",
    ):
        _acc(micro_batch_size=4).train_step(_batch(gen), lambda m, b: (m(b[0]).sum(), count))


def test_numpy_counts_are_numbers(gen):
    np = pytest.importorskip("numpy")
    batch = _batch(gen)
    results = []
    for to_count in (int, np.int64, np.float32):
        acc = _acc(micro_batch_size=4)

        def pair(model, mb, to_count=to_count):
            return F.cross_entropy(model(mb[0]), mb[1], reduction="sum"), to_count(len(mb[1]))

        results.append((acc.train_step(batch, pair), [p.detach() for p in acc.model.parameters()]))
    for result, params in results[1:]:
        assert result.count == results[0][0].count == 10
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][1], strict=True))


# ---------------------------------------------------------------- optimizer and scheduler
def test_an_optimizer_missing_trainable_parameters_is_refused():
    model = mlp()
    with pytest.raises(
        ValueError,
        match=r"^the optimizer does not hold the trainable parameter\(s\) 4\.weight, 4\.bias: their "
        r"gradients would grow, unused\. Give them to the optimizer, or call "
        r"requires_grad_\(False\) on them\.$",
    ):
        bigbatch.Accumulator(model, torch.optim.SGD(list(model.parameters())[:4], lr=0.1))
    with pytest.raises(ValueError, match=r"^the optimizer holds none of the model's trainable"):
        bigbatch.Accumulator(model, torch.optim.SGD(mlp(seed=1).parameters(), lr=0.1))
    for p in list(model.parameters())[4:]:
        p.requires_grad_(False)  # frozen: not the optimizer's business
    bigbatch.Accumulator(model, torch.optim.SGD(list(model.parameters())[:4], lr=0.1))


def test_something_that_is_not_an_optimizer_is_refused():
    model = mlp()
    with pytest.raises(
        TypeError, match=r"^optimizer=list is not an optimizer: pass a torch\.optim"
    ):
        bigbatch.Accumulator(model, list(model.parameters()))


class _NeedsAMetric:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, metric):  # noqa: ARG002 - the signature is the point
        pass


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda opt: object(),
            TypeError,
            r"^scheduler=object cannot be stepped once per optimizer",
        ),
        (
            _NeedsAMetric,
            TypeError,
            r"^scheduler=_NeedsAMetric cannot be stepped once per optimizer",
        ),
        (
            lambda opt: torch.optim.lr_scheduler.StepLR(
                torch.optim.SGD(mlp(seed=1).parameters(), lr=0.1), 1
            ),
            TypeError,
            r"^the scheduler steps another optimizer than the Accumulator's",
        ),
    ],
    ids=["not-a-scheduler", "step-needs-an-argument", "another-optimizer"],
)
def test_a_scheduler_that_cannot_be_stepped_is_refused_at_construction(make, error, message):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=message):
        bigbatch.Accumulator(model, opt, scheduler=make(opt))


def test_reduce_lr_on_plateau_is_stepped_with_the_windows_loss(gen):
    """mode="max" on a falling loss (one batch, descended): no improvement, so the rate halves
    every step, as it does for the plain loop stepping the scheduler with the full batch's loss."""
    ref, model = mlp(), mlp()
    opt_ref, opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model))
    make = lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(  # noqa: E731
        o, mode="max", factor=0.5, patience=0
    )
    sched_ref, sched = make(opt_ref), make(opt)
    acc = bigbatch.Accumulator(model, opt, micro_batch_size=3, scheduler=sched)
    batch = _batch(gen)
    for _ in range(4):
        loss = full_batch_step(ref, opt_ref, mean_ce, batch)
        sched_ref.step(loss)
        assert acc.train_step(batch, mean_ce).loss == pytest.approx(loss, rel=1e-10)
    assert opt.param_groups[0]["lr"] == opt_ref.param_groups[0]["lr"] == 0.1 * 0.5**3
    assert max_relative_error(ref, model) < 1e-10


# ---------------------------------------------------------------- settings
@pytest.mark.parametrize("value", ["1.0", float("inf"), True])
def test_max_grad_norm_must_be_a_finite_number(value):
    with pytest.raises(
        ValueError, match=rf"^max_grad_norm={re.escape(repr(value))} is not allowed: use a positive"
    ):
        _acc(max_grad_norm=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_memory_budget_must_be_finite(value):
    with pytest.raises(
        ValueError, match=rf"^memory_budget={value!r} is not a positive finite size: e\.g\."
    ):
        _acc(memory_budget=value)


def test_unknown_nonfinite_policy():
    with pytest.raises(
        ValueError, match=r"^nonfinite='ignore' is not allowed: use one of 'raise', 'skip', 'apply'"
    ):
        _acc(nonfinite="ignore")


# ---------------------------------------------------------------- non-finite windows
def _nan_in_second(model, batch, calls=[0]):  # noqa: B006 - a counter across calls
    calls[0] += 1
    loss = mean_ce(model, batch)
    return loss * float("nan") if calls[0] % 3 == 2 else loss


def _inf_gradient(model, batch):
    """A finite loss whose gradient is infinite: d sqrt(w - w0) / dw at w = w0."""
    weight = model[0].weight
    return mean_ce(model, batch) + (weight - weight.detach()).sqrt().sum()


@pytest.mark.parametrize(
    "loss_fn, message",
    [
        (_nan_in_second, r"the window's loss is nan \(count 10\); nothing was changed"),
        (_inf_gradient, r"the window's gradient norm is (inf|nan) \(count 10\); nothing was"),
    ],
    ids=["nan-loss", "inf-gradient"],
)
def test_a_non_finite_window_raises_before_the_optimizer_steps(loss_fn, message, gen):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    acc = bigbatch.Accumulator(model, opt, micro_batch_size=4, scheduler=sched, max_grad_norm=1.0)
    acc.train_step(_batch(gen), mean_ce)
    before = _snapshot(acc)
    with pytest.raises(NonFiniteError, match=message):
        acc.train_step(_batch(gen), loss_fn)
    _assert_unchanged(acc, before)
    assert sched.last_epoch == 1
    assert acc.train_step(_batch(gen), mean_ce).nonfinite is False  # usable afterwards


def test_skip_skips_the_window_and_apply_applies_it(gen):
    skipping = _acc(micro_batch_size=4, nonfinite="skip")
    skipping.train_step(_batch(gen), mean_ce)
    before = _snapshot(skipping)
    result = skipping.train_step(_batch(gen), _inf_gradient)
    assert result.skipped and result.nonfinite
    _assert_unchanged(skipping, before)
    applying = _acc(micro_batch_size=4, nonfinite="apply")
    result = applying.train_step(_batch(gen), _inf_gradient)
    assert result.nonfinite and not result.skipped
    assert not torch.isfinite(applying.model[0].weight).all()  # what "apply" means


# ---- issue 21 item 1: refused calls leave nothing behind; constructors validate like the CLI
def _one_step_reference(gen):
    model = nn.Linear(6, 3).double()
    grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in model.parameters()]
    return model, grads


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ("foreign", ValueError, r"a tensor of shape \(3,\) that the optimizer does not hold"),
        ("loss_sum", ValueError, r"loss_sum has shape \(2,\); it must be a scalar"),
        ("count", ValueError, r"count=-1 is negative"),
        ("not_tensor", TypeError, r"a gradient is list, not a tensor"),
    ],
)
def test_a_refused_accumulate_grads_leaves_no_gradient_behind(bad, error, message, gen):
    model, grads = _one_step_reference(gen)
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    params = list(model.parameters())
    args = {
        "foreign": ({params[0]: grads[0], torch.zeros(3, dtype=torch.float64): grads[1]}, 4),
        "loss_sum": (grads, 4, torch.ones(2)),
        "count": (grads, -1),
        "not_tensor": ({params[0]: [1.0]}, 4),
    }[bad]
    with pytest.raises(error, match=message):
        acc.accumulate_grads(*args)
    assert all(p.grad is None for p in params)
    before = [p.detach().clone() for p in params]
    acc.accumulate_grads(grads, 4)
    acc.step()  # applies the good gradients once, not twice
    for p, b, g in zip(params, before, grads, strict=True):
        assert torch.allclose(p, b - 0.1 * g / 4, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"outer_lr": math.inf}, ValueError, r"outer_lr=inf is not allowed: use a positive finite"),
        ({"outer_lr": True}, TypeError, r"outer_lr=True is not allowed: use a number"),
        ({"outer_momentum": True}, TypeError, r"outer_momentum=True is not allowed"),
        ({"nesterov": "yes", "outer_momentum": 0.9}, TypeError, r"nesterov='yes' is not allowed"),
        ({"local_steps": True}, ValueError, r"local_steps=True is not allowed"),
    ],
)
def test_local_accumulation_validates_like_the_cli(kwargs, error, message):
    from bigbatch.distributed import LocalAccumulation

    model = nn.Linear(2, 2)
    args = {"local_steps": 2, **kwargs}
    with pytest.raises(error, match=message):
        LocalAccumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), **args)


def test_precision_must_be_a_name_or_a_precision_object():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"precision=True is not allowed: use one of 'fp32'"):
        bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=True)


def test_cached_loss_refuses_per_sample_values_that_are_not_tensors(gen):
    model = nn.Linear(4, 3).double()
    ids = [f"doc{i}" for i in range(10)]
    encode = lambda m, mb: {"emb": m(mb[0]), "ids": mb[1]}  # noqa: E731
    loss = bigbatch.cached_loss(encode, lambda reps: (reps["emb"] @ reps["emb"].T).mean())
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    batch = (torch.randn(10, 4, generator=gen, dtype=torch.float64), ids)
    with assert_refused(
        model, TypeError, match=r"per-sample values that are not tensors \(reps\['ids'\]\)"
    ):
        acc.train_step(batch, loss)


def test_terms_other_than_the_counted_ones_are_refused(gen):
    acc = _acc(micro_batch_size=4)
    before = copy.deepcopy(acc.model.state_dict())

    def loss(model, batch):
        x, y = batch
        return {"b": (F.cross_entropy(model(x), y, reduction="sum"), y.shape[0])}

    with assert_refused(
        acc.model,
        ValueError,
        match=r"^loss_fn returned the terms \['b'\], but the counts known before the window are "
        r"for \['a'\]: each term's count is needed before the first backward\. .*count_fn",
    ):
        acc.train_step(_batch(gen), loss, count_fn=lambda batch: {"a": batch[1].shape[0]})
    after = acc.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_count_fn_counting_other_counts_than_the_loss_is_refused(gen):
    acc = _acc(micro_batch_size=4)
    before = copy.deepcopy(acc.model.state_dict())

    def loss(model, batch):
        x, y = batch
        total = F.cross_entropy(model(x), y, reduction="sum")
        return {"a": (total, y.shape[0]), "b": (0.5 * total, y.shape[0])}

    def count_fn(batch):
        return {"a": batch[1].shape[0], "b": batch[1].shape[0] + 1}  # one too many per piece

    with assert_refused(
        acc.model,
        ValueError,
        match=r"^term 'b': count_fn counted 13 before the window, loss_fn's counts add up to 10: "
        r"count_fn must return the counts loss_fn will\. Nothing changed\.$",
    ):
        acc.train_step(_batch(gen), loss, count_fn=count_fn)
    after = acc.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    "second, shown",
    [
        (lambda out: {"logits": out, "hidden": out}, "a dict"),
        (lambda out: out[:, None, :].expand(-1, 3, -1), r"a shape \[4, 3, 3\]"),
    ],
    ids=["(loss, outputs)", "(loss, logits)"],
)
def test_a_compute_loss_style_pair_is_named(second, shown, gen):
    """Issue 37: (loss, outputs) printed the whole model output as the count; (loss, logits)
    called the logits a count."""
    model = mlp()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    loss = lambda m, b: (mean_ce(m, b), second(m(b[0])))  # noqa: E731
    message = rf"^loss_fn returned \(loss, {shown}\): a pair is \(loss_sum, count\), count the "
    with assert_refused(model, TypeError, match=message + r".*return the loss alone \(a mean\)\.$"):
        acc.train_step(_batch(gen), loss)

"""Generated uses of the chunked head (heads.py), each held to the oracle: ``head_cross_entropy``
against the plain head written with ``F.cross_entropy`` (float64 to 1e-10; half-precision
states against the same products in float32), and models whose output layer is deferred
(``deferred_head``) against their float64 full-batch step; or a refusal naming the argument."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("hypothesis")  # the test extra's: pip install -e ".[test]"

import torch  # noqa: E402
from heads import (  # noqa: E402
    DEFERRED_FOCI,
    HALF,
    HEAD_FOCI,
    Deferred,
    HeadCall,
    bigbatch_head,
    deferred_batch,
    deferred_cases,
    deferred_expectation,
    deferred_loss,
    head_calls,
    head_expectation,
    head_inputs,
    leaves,
    make_deferred,
    plain_head,
)
from oracle import (  # noqa: E402
    OPTIMIZERS,
    TOLERANCE,
    RawError,
    RefusedValidInput,
    SilentStepOnBadInput,
    SilentWrongStep,
    UnnamedRefusal,
    judge,
    reference,
    unchanged_on_refusal,
)
from strategies import hold  # noqa: E402

import bigbatch  # noqa: E402
from bigbatch.core.head import with_chunked_head  # noqa: E402


def tiers(foci: tuple[str, ...]) -> list:
    """``(profile, focus)``: everything in the quick tier; each focus in the slow tier."""
    slow = [pytest.param("long", f, marks=pytest.mark.slow, id=f"long-{f}") for f in foci]
    return [pytest.param("quick", "everything", id="quick"), *slow]


HALF_TOLERANCE = (1e-4, 3e-2)  # the loss (float32 sums of the same products), the gradients


def off(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative distance of ``got`` from ``want`` (an absolute one near 0)."""
    pairs = zip(got, want, strict=True)
    return max(float((g - w).norm() / w.norm().clamp_min(1e-6)) for g, w in pairs)


def run_head(call: HeadCall) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``head_cross_entropy``'s three values and the gradients of their sum (by ``backward``)."""
    t = head_inputs(call)
    values = bigbatch_head(call, t)
    total, inputs = values[0] + values[2], leaves(t)
    if call.backward == "create_graph":
        grads = torch.autograd.grad(total, inputs, create_graph=True)
        sum(g.square().sum() for g in grads).backward()  # a gradient penalty
    grads = torch.autograd.grad(total, inputs, retain_graph=call.backward == "twice")
    if call.backward == "twice":
        grads = torch.autograd.grad(total, inputs)
    return [v.detach() for v in values], list(grads)


def check_head(call: HeadCall) -> None:
    expect = head_expectation(call)
    try:
        values, grads = run_head(call)
    except (ValueError, TypeError, RuntimeError) as exc:
        message = f"{type(exc).__name__}: {exc}"
        if not expect.names:
            raise RefusedValidInput(f"refused a call the plain head computes: {message}") from exc
        if not any(name in str(exc) for name in expect.names):
            if isinstance(exc, RuntimeError):
                raise RawError(message) from exc
            raise UnnamedRefusal(f"{message}\n(names none of {sorted(expect.names)})") from exc
        return
    if expect.must_refuse:
        raise SilentStepOnBadInput(f"computed what must be refused, naming {sorted(expect.names)}")
    t = head_inputs(call)
    want = plain_head(call, t)
    if call.z_loss == 0:
        want[2] = want[2] * 0
    want_grads = torch.autograd.grad(want[0] + want[2], leaves(t))
    tolerance = HALF_TOLERANCE if call.precision in HALF else (TOLERANCE, TOLERANCE)
    value_off, grad_off = off(values, [w.detach() for w in want]), off(grads, list(want_grads))
    if not (value_off < tolerance[0] and grad_off < tolerance[1]):
        raise SilentWrongStep(
            f"values {value_off:.3g}, gradients {grad_off:.3g} off the plain head"
        )


def check_deferred(case: Deferred) -> None:
    init, batch = make_deferred(case), deferred_batch(case)
    expected = reference(init, case.optimizer, deferred_loss, [batch])

    def run() -> torch.nn.Module:
        model = copy.deepcopy(init)
        opt = OPTIMIZERS[case.optimizer](model.parameters())
        acc = bigbatch.Accumulator(model, opt, case.micro_batch_size)
        with unchanged_on_refusal(model):
            acc.train_step(batch, with_chunked_head(deferred_loss, model))
        return model

    judge(deferred_expectation(case), expected, run)


@pytest.mark.parametrize("profile, focus", tiers(HEAD_FOCI))
def test_head_cross_entropy_equals_the_plain_head(profile, focus):
    hold(check_head, head_calls(focus), profile, examples=100 if profile == "quick" else 150)


@pytest.mark.parametrize("profile, focus", tiers(DEFERRED_FOCI))
def test_deferred_output_layers_equal_the_full_batch(profile, focus):
    hold(check_deferred, deferred_cases(focus), profile, examples=60 if profile == "quick" else 150)

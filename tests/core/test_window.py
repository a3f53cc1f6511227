"""Redone and failed windows leave no trace in the model's buffers (Note [window buffers]).

A forward that raises ``torch.OutOfMemoryError`` above a number of rows (after the BatchNorm has
moved its running statistics) makes ``micro_batch_size="auto"`` redo the window smaller; the
result, parameters AND buffers, must be bitwise the run at the adopted size. An exception in the
middle of a window must leave the buffers as they were.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigbatch


class OutOfMemoryAbove(nn.Module):
    """Raises a real ``torch.OutOfMemoryError`` for a micro-batch of more than ``rows`` rows."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.rows:
            raise torch.OutOfMemoryError(f"out of memory: {x.shape[0]} rows > {self.rows}")
        return x


class Counter(nn.Module):
    """A registered buffer that forward changes in place (samples seen), as EMAs do."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += x.shape[0]
        return x


def bn_model(rows: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.BatchNorm1d(8),
        Counter(),
        OutOfMemoryAbove(rows),  # after the BatchNorm: a failed attempt has moved its statistics
        nn.ReLU(),
        nn.Linear(8, 3),
    ).double()


def ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _engine_warns(policy: str):
    """The engine warns once about a plain BatchNorm under accumulation, not about a policy."""
    return pytest.warns(bigbatch.BigBatchWarning) if policy == "keep" else contextlib.nullcontext()


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("policy", ["keep", "micro"])
@pytest.mark.parametrize("rows", [5, 3])  # 10 -> 5 fits; 10 -> 5 -> 2 fits (10 = 2+2+2+2+2)
def test_auto_after_out_of_memory_equals_the_adopted_fixed_size(policy, rows, gen):
    auto_model, fixed_model = bn_model(rows), bn_model(rows)
    for model in (auto_model, fixed_model):
        if policy != "keep":
            with pytest.warns(bigbatch.BigBatchWarning):
                bigbatch.batchnorm(model, policy)
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731
    auto = bigbatch.Accumulator(auto_model, make(auto_model), micro_batch_size="auto")
    adopted = 5 if rows == 5 else 2
    fixed = bigbatch.Accumulator(fixed_model, make(fixed_model), micro_batch_size=adopted)
    with _engine_warns(policy):
        for step in range(3):
            batch = (
                torch.randn(10, 6, generator=gen, dtype=torch.float64),
                torch.randint(0, 3, (10,), generator=gen),
            )
            result = auto.train_step(batch, ce)
            fixed.train_step(batch, ce)
            assert result.micro_batch_size == adopted
            assert result.oom_retries == (0 if step else (1 if rows == 5 else 2))
    _assert_same_state(auto_model, fixed_model)
    # one count per micro-batch that ran to the end: the failed attempts left none
    assert int(auto_model[1].num_batches_tracked) == 3 * 10 // adopted
    assert float(auto_model[2].seen) == 30  # each sample counted once, not per attempt


@pytest.mark.parametrize("policy", ["keep", "micro"])
def test_an_exception_mid_window_leaves_the_buffers_unchanged(policy, gen):
    model = bn_model(rows=100)
    if policy != "keep":
        with pytest.warns(bigbatch.BigBatchWarning):
            bigbatch.batchnorm(model, policy)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4
    )
    batch = (
        torch.randn(10, 6, generator=gen, dtype=torch.float64),
        torch.randint(0, 3, (10,), generator=gen),
    )
    with _engine_warns(policy):
        acc.train_step(batch, ce)  # BatchNorm and the counter have been moved once
    before = copy.deepcopy(model.state_dict())
    calls = [0]

    def fails_third(model, mb):
        calls[0] += 1
        loss = ce(model, mb)  # the forward ran: the statistics moved
        if calls[0] == 3:
            raise KeyError("labels")
        return loss

    with pytest.raises(KeyError, match="labels"):
        acc.train_step(batch, fails_third)
    assert calls[0] == 3
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key

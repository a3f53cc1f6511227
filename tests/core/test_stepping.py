"""The step's gradient arithmetic on sparse gradients (``nn.Embedding(sparse=True)``): the norm,
clipping and normalisation work on them, and the step equals a plain full-batch step (float64).

``torch.nn.utils.clip_grad_norm_`` itself refuses sparse gradients, so the reference below clips
by hand, with its arithmetic: ``g * min(1, max_norm / (‖g‖ + 1e-6))``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import max_relative_error

import bigbatch


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids).mean(1)))


def bag() -> nn.Module:
    torch.manual_seed(0)
    return Bag().double()


def ce(model, batch):
    ids, y = batch
    return F.cross_entropy(model(ids), y)


def plain_step(model, optimizer, batch, max_grad_norm):
    """One full-batch step, clipping sparse gradients by hand (clip_grad_norm_ cannot)."""
    optimizer.zero_grad(set_to_none=True)
    ce(model, batch).backward()
    grads = [p.grad for p in model.parameters()]
    norms = [g.coalesce().values().norm() if g.is_sparse else g.norm() for g in grads]
    total = torch.stack(norms).norm()
    if max_grad_norm is not None:
        coef = (max_grad_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef)
    optimizer.step()
    return float(total)


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
@pytest.mark.parametrize("micro", [4, 3])  # 10 = 4+4+2 and 3+3+3+1
def test_sparse_gradients_train_exactly(opt_name, max_grad_norm, micro, gen):
    ref, model = bag(), bag()
    opt_ref, opt = OPTIMIZERS[opt_name](ref.parameters()), OPTIMIZERS[opt_name](model.parameters())
    acc = bigbatch.Accumulator(model, opt, micro_batch_size=micro, max_grad_norm=max_grad_norm)
    for _ in range(3):
        batch = (
            torch.randint(0, 20, (10, 5), generator=gen),
            torch.randint(0, 3, (10,), generator=gen),
        )
        norm = plain_step(ref, opt_ref, batch, max_grad_norm)
        result = acc.train_step(batch, ce)
        assert result.grad_norm == pytest.approx(norm, rel=1e-10)
        if max_grad_norm is not None:
            assert result.grad_norm > max_grad_norm  # clipping really bit
    assert max_relative_error(ref, model) < 1e-10

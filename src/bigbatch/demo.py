"""The Quick start job: the same model trained with the full batch and accumulated, compared."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from bigbatch.engine import Accumulator


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of a ``(inputs, labels)`` batch."""
    return F.cross_entropy(model(batch[0]), batch[1])


def run_demo(steps: int = 20, batch: int = 64, micro_batch_size: int = 12) -> float:
    """Train a small MLP both ways in float64 and return the largest relative parameter gap."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    full = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    ).double()
    accumulated = copy.deepcopy(full)
    opt_full = torch.optim.AdamW(full.parameters(), lr=1e-2)
    acc = Accumulator(
        accumulated, torch.optim.AdamW(accumulated.parameters(), lr=1e-2), micro_batch_size
    )
    for _ in range(steps):
        data = (
            torch.randn(batch, 8, generator=gen, dtype=torch.float64),
            torch.randint(0, 4, (batch,), generator=gen),
        )
        opt_full.zero_grad()
        loss_fn(full, data).backward()
        opt_full.step()
        result = acc.train_step(data, loss_fn)
    gap = max(
        float((a - b).detach().norm() / a.detach().norm())
        for a, b in zip(full.parameters(), accumulated.parameters(), strict=True)
    )
    print(
        f"full batch {batch} vs {result.micro_batches} micro-batches of {micro_batch_size}: "
        f"max relative parameter difference after {steps} AdamW steps = {gap:.1e}"
    )
    print("exact (float64 rounding)" if gap < 1e-10 else "NOT exact")
    return gap

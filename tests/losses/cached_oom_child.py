"""Child process for test_cached_oom.py: ``cached_loss`` with ``micro_batch_size="auto"`` meets a
real allocator failure under ``RLIMIT_DATA``, then prints one JSON line.

Run as ``python cached_oom_child.py '{"n": 48, "margin_mib": 80, "seed": 1}'`` with PYTHONPATH
holding the repository's src, tests and tests/memory. Tower ``a`` of the two-tower model widens
each sample to ``64 x 2048`` float64 values (1 MiB) and narrows it back, so its forward needs
about 2 MiB per sample at its peak without a graph and keeps 1 MiB per sample with one: the whole
batch does not fit under the limit, a micro-batch does. Every failure of an encode is recorded
(size, with or without a graph, recognised as out of memory). The reference -- one plain
full-batch step -- runs before the limit is set; the model has no dropout, so any cut of the
batch must give the full batch's step to rounding.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from limits import limit_data
from reference import max_relative_error

import bigbatch


class Wide(nn.Module):
    """``mean(tanh(x[..., None] * v), -1)``: activations ``expand`` times the input's."""

    def __init__(self, expand: int) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.linspace(-1, 1, expand))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x[:, :, None] * self.v).mean(-1)


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(6, 64), Wide(2048), nn.Linear(64, 8))
        self.b = nn.Sequential(nn.Linear(7, 32), nn.Tanh(), nn.Linear(32, 8))
        self.logit_scale = nn.Parameter(torch.full((1,), 1.0))

    def forward(self, x, y):
        return (
            F.normalize(self.a(x), dim=-1),
            F.normalize(self.b(y), dim=-1),
            self.logit_scale.exp()[0],
        )


def clip(reps, batch):
    q, d, scale = reps
    logits = scale * q @ d.T
    targets = torch.arange(len(q))
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


def main(config: dict) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n, gen = config["n"], torch.Generator().manual_seed(config["seed"])
    batch = {"x": torch.randn(n, 6, generator=gen, dtype=torch.float64)}
    batch["y"] = batch["x"] @ torch.randn(6, 7, generator=gen, dtype=torch.float64)
    model = Towers().double()
    ref = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (model, ref)]
    events: list = []

    def encode(m, mb):
        try:
            return m(mb["x"], mb["y"])
        except BaseException as exc:
            events.append({"size": len(mb["x"]), "graph": torch.is_grad_enabled(),
                           "oom": bigbatch.is_out_of_memory(exc), "type": type(exc).__name__})  # fmt: skip
            raise

    loss_fn = bigbatch.cached_loss(encode, clip)
    warm = {k: v[:2] for k, v in batch.items()}  # optimizer state, autograd, allocator
    for m, opt in zip((model, ref), opts, strict=True):
        bigbatch.Accumulator(m, opt, micro_batch_size=1).train_step(warm, loss_fn)
    opts[1].zero_grad(set_to_none=True)
    clip(encode(ref, batch), batch).backward()  # the reference, before the limit
    opts[1].step()
    acc = bigbatch.Accumulator(model, opts[0], micro_batch_size="auto")
    backward = acc._backward

    def traced_backward(terms):  # wiring only: the engine's own backward runs
        try:
            backward(terms)
        except BaseException as exc:
            events.append({"size": None, "graph": "backward", "oom": bigbatch.is_out_of_memory(exc),
                           "type": type(exc).__name__})  # fmt: skip
            raise

    acc._backward = traced_backward  # type: ignore[method-assign]
    limit_data(config["margin_mib"])
    try:
        result = acc.train_step(batch, loss_fn)
    finally:
        limit_data(None)
    return {
        "oom_retries": result.oom_retries,
        "micro_batch_size": result.micro_batch_size,
        "micro_batches": result.micro_batches,
        "events": events,
        "error_to_full_batch": max_relative_error(ref, model),
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)

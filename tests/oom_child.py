"""Child process for test_oom.py: a real allocator failure under RLIMIT_DATA, then one JSON line.

Run as ``python oom_child.py '[{"model": "forward", "n": 16, ...}, ...]'``: the scenarios run one
after the other in this one process (torch is imported once) and each prints one JSON line. The
parent passes PYTHONPATH (the repository's src and tests). The limit is set after import and warm-up, at the data segment in use
plus ``margin_mib`` (the research note's recipe: reliable with at least 64 MiB of headroom), and
lifted again before the references that need the whole batch at once.

The model has three parts so that each scenario can put the failure where it wants it:

* ``expand``: a broadcast ``tanh(x[..., None] * v)`` whose activations grow with the micro-batch
  and dominate the *forward*;
* ``big``: a 64 MiB ``Linear`` nearest the input; its ``.grad`` exists from the window's second
  micro-batch on, so later micro-batches need 64 MiB more than the first;
* ``PerSampleLinear``: a layer whose *backward* builds per-sample outer products (as DP-SGD code
  does): 16 MiB per sample, in backward only.
"""

from __future__ import annotations

import copy
import gc
import json
import sys

import torch
import torch.nn.functional as F
from limits import limit_data
from reference import full_batch_step, max_relative_error
from torch import nn

import bigbatch

MiB = 2**20


class PerSampleLinear(torch.autograd.Function):
    """``x @ w.T`` whose backward sums per-sample outer products: memory grows with the batch."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        per_sample = g[:, :, None] * x[:, None, :]  # (n, out, in)
        return g @ w, per_sample.sum(0)


class Net(nn.Module):
    def __init__(self, d_in: int, expand: int, d_big: int, d_ps: int) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.linspace(-1, 1, expand)) if expand else None
        self.big = nn.Linear(d_in, d_big)
        self.ps = nn.Parameter(torch.randn(d_ps, d_big) / d_big**0.5)
        self.head = nn.Linear(d_ps, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.v is not None:
            x = torch.tanh(x[:, :, None] * self.v).mean(-1)
        h = torch.tanh(self.big(x))
        return self.head(torch.tanh(PerSampleLinear.apply(h, self.ps)))


SCENARIOS = {  # model sizes; margins chosen from measured peaks (see test_oom.py)
    "forward": {"d_in": 256, "expand": 2048, "d_big": 256, "d_ps": 64},
    "backward": {"d_in": 2048, "expand": 0, "d_big": 2048, "d_ps": 1024},
}


def ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _limit(margin_mib: float | None, device: torch.device) -> None:
    """Allow ``margin_mib`` more than is in use now (``None``: lift the limit)."""
    gc.collect()
    if device.type == "cuda":  # a real torch.OutOfMemoryError from the caching allocator
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        used = torch.cuda.memory_reserved(device)
        fraction = 1.0 if margin_mib is None else (used + margin_mib * MiB) / total
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        return
    limit_data(margin_mib)


def _record_events(acc: bigbatch.Accumulator, events: list) -> None:
    """Note where each failure struck (wiring only: the engine's own path runs unchanged)."""
    backward, train_step = acc._backward_output, acc.train_step  # every micro-batch's backward
    done = [0]  # backwards completed in the current window

    def traced_train_step(*args, **kwargs):
        done[0] = 0
        return train_step(*args, **kwargs)

    def traced_backward(out, piece):
        try:
            backward(out, piece)
        except BaseException as exc:
            events.append(
                {"where": "backward", "accumulated": done[0], "oom": bigbatch.is_out_of_memory(exc)}
            )
            done[0] = 0  # the window is redone from its start
            raise
        done[0] += 1

    def traced_loss(model, batch):
        try:
            return ce(model, batch)
        except BaseException as exc:
            events.append(
                {"where": "forward", "size": len(batch[0]), "oom": bigbatch.is_out_of_memory(exc)}
            )
            done[0] = 0  # the window is redone from its start
            raise

    acc._backward_output = traced_backward  # type: ignore[method-assign]
    acc.train_step = traced_train_step  # type: ignore[method-assign]
    return traced_loss


def _state(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    return params, momentum


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def main(config: dict) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(config.get("device", "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    model = Net(**SCENARIOS[config["model"]]).double().to(device)
    n, gen = config["n"], torch.Generator().manual_seed(config["seed"])
    x = torch.randn(n, model.big.in_features, generator=gen, dtype=torch.float64)
    batch = (x.to(device), torch.randint(0, 3, (n,), generator=gen).to(device))
    # the engine's model, the unsplit reference, the reference cut like the engine's final split
    copies = [model, copy.deepcopy(model), copy.deepcopy(model)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in copies]
    warm = tuple(t[:2] for t in batch)
    for m, opt in zip(copies, opts, strict=True):  # warm-up: optimizer state, autograd, allocator
        bigbatch.Accumulator(m, opt, micro_batch_size=1).train_step(warm, ce)
    full_batch_step(copies[1], opts[1], ce, batch)  # before the limit: needs the whole batch
    micro, budget = config.get("micro_batch_size", "auto"), config.get("budget")
    acc = bigbatch.Accumulator(model, opts[0], micro_batch_size=micro, memory_budget=budget)
    events: list = []
    loss_fn = _record_events(acc, events)
    before = _state(model, opts[0])
    _limit(config.get("margin_mib"), device)
    try:
        result = acc.train_step(batch, loss_fn)
    except BaseException as exc:
        _limit(None, device)
        return {
            "raised": type(exc).__name__,
            "is_oom": bigbatch.is_out_of_memory(exc),
            "unchanged": all(map(_equal, before, _state(model, opts[0]))),
            "grads_none": all(p.grad is None for p in model.parameters()),
            "events": events,
        }
    _limit(None, device)
    split = bigbatch.Accumulator(copies[2], opts[2], micro_batch_size=result.micro_batch_size)
    split.train_step(batch, ce)
    return {
        "raised": None,
        "oom_retries": result.oom_retries,
        "samples": result.samples,
        "count": result.count,
        "micro_batch_size": result.micro_batch_size,
        "micro_batches": result.micro_batches,
        "events": events,
        "equal_to_same_split": _equal(list(model.parameters()), list(copies[2].parameters())),
        "error_to_full_batch": max_relative_error(copies[1], model),
    }


if __name__ == "__main__":
    for scenario in json.loads(sys.argv[1]):
        print(json.dumps(main(scenario)), flush=True)

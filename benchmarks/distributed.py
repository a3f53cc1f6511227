"""Gradient sync once per optimizer step (no_sync) against syncing every micro-batch, 2 gloo ranks.

Both sides run in the same two processes, interleaved, on the same model and data:

* ``no_sync``: ``Accumulator.train_step`` (every micro-batch but the last under DDP's ``no_sync()``);
* ``every``: the same ``Accumulator`` driven through its low-level path with ``last=True`` on
  every micro-batch, i.e. what a plain loop over a DDP model does (one all-reduce per micro-batch).

Gradient all-reduces are counted per optimizer step with a DDP communication hook (one call per
bucket); the time is the median wall time of an optimizer step on rank 0.

Usage:
    python benchmarks/distributed.py [--steps 10] [--width 1024] [--micro 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import bigbatch  # noqa: E402
from bigbatch.core.loss import as_sum_and_count  # noqa: E402
from bigbatch.core.split import batch_size, split  # noqa: E402

KS = (1, 4, 16)


def _hook(state: dict, bucket):
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _step(acc, ddp, batch, micro: int, every: bool) -> None:
    if not every:
        acc.train_step(batch, _loss)
        return
    for piece in split(batch, micro):
        with acc.micro_batch(last=True):
            acc.backward(*as_sum_and_count(_loss(ddp, piece), batch_size(piece)))
    acc.step()


def _rank(rank: int, init: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    torch.manual_seed(0)
    w = args.width
    layers = [torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(w, 10))
    ddp = DDP(model)
    state = {"calls": 0}
    ddp.register_comm_hook(state, _hook)
    acc = bigbatch.Accumulator(
        ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), micro_batch_size=args.micro
    )
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for k in KS:
        n = k * args.micro
        batch = (torch.randn(n, w, generator=gen), torch.randint(0, 10, (n,), generator=gen))
        times: dict = {False: [], True: []}
        calls: dict = {False: [], True: []}
        for i in range(args.steps + 2):
            order = (False, True) if i % 2 else (True, False)
            for every in order:  # interleaved, alternating: drift on a shared machine hits both
                dist.barrier()
                before, t0 = state["calls"], time.perf_counter()
                _step(acc, ddp, batch, args.micro, every)
                if i >= 2:  # warm-up
                    times[every].append(time.perf_counter() - t0)
                    calls[every].append(state["calls"] - before)
        medians = statistics.median(times[False]), statistics.median(times[True])
        rows.append((k, *medians, max(calls[False]), max(calls[True])))
    if rank == 0:
        results.put((rows, sum(p.numel() for p in model.parameters())))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=8)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank, args=(r, init, args, results)) for r in range(2)]
        for p in procs:
            p.start()
        rows, params = results.get(timeout=1800)
        for p in procs:
            p.join()
    print(
        f"2 gloo ranks on CPU ({os.cpu_count()} cores), torch {torch.__version__}, MLP of "
        f"{params / 1e6:.2f} M float32 parameters, micro-batch {args.micro}, "
        f"median of {args.steps} steps"
    )
    print()
    print(
        "| k | ms/step no_sync | ms/step sync every | time ratio (every / no_sync) "
        "| bucket all-reduces/step no_sync | sync every | ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for k, t_ns, t_ev, c_ns, c_ev in rows:
        print(
            f"| {k} | {t_ns * 1e3:.1f} | {t_ev * 1e3:.1f} | {t_ev / t_ns:.2f} "
            f"| {c_ns} | {c_ev} | {c_ev / c_ns:.0f} |"
        )


if __name__ == "__main__":
    main()

"""Local accumulation (LocalAccumulation, λ local steps per all-reduce) against exact data parallel.

W gloo ranks on this machine train the same MLP on scikit-learn's bundled digits (no download),
from the same initialisation, on the same global batches (each dealt out to the ranks: rank r
takes every W-th sample), for the same number of optimizer steps, so every method sees the same
samples. Methods, all with the same inner optimizer (SGD, momentum 0.9) and micro-batch size:

* exact data-parallel (DDP): the ``Accumulator`` on a ``DistributedDataParallel`` model, one
  gradient all-reduce per optimizer step (plus the Accumulator's 16-byte count all-reduce);
* LocalAccumulation, λ = 1 / 4 / 16, plain outer rule with outer_lr = 1 (the paper's
  normalisation: the combined update is on the scale of ONE step per round);
* LocalAccumulation with outer_lr = λ (the weighted average of the ranks' models: local SGD) and
  with an outer Nesterov step (momentum 0.9, outer_lr = λ);
* PyTorch's post-local SGD: ``PostLocalSGDOptimizer`` + ``PeriodicModelAverager(period=λ,
  warmup_steps=λ - 1)`` on the plain model (the warm-up offset makes it average after steps λ,
  2λ, ..., on the same steps as LocalAccumulation; no DDP, so the warm-up steps are local too).

The slow link: every ``torch.distributed.all_reduce`` call is wrapped to sleep
``latency + bytes / bandwidth`` before it runs, on every rank. The DDP model gets PyTorch's own
``default_hooks.allreduce_hook`` as its communication hook so its gradient buckets go through
``torch.distributed.all_reduce`` too: one wrapper delays (and counts) the messages of all
methods alike. Bytes are those of the tensors handed to the all-reduce on one rank.

Columns: all-reduces and bytes per optimizer step on rank 0, wall time per optimizer step (the
whole run between two barriers, divided by the steps; includes the simulated delays), and the
loss on the whole training set and the accuracy on the 397 held-out digits after the run.

Usage:
    python benchmarks/local_accumulation.py [--ranks 2] [--steps 192] [--latency-ms 10]
        [--mbit 100] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

from _measure import print_table  # noqa: E402

from bigbatch import Accumulator  # noqa: E402
from bigbatch.app.demo import Digits, load_digits  # noqa: E402
from bigbatch.distributed import LocalAccumulation  # noqa: E402


@dataclass(frozen=True)
class Method:
    """One row: how to build the trainer, and λ (0: exact data parallel)."""

    name: str
    local_steps: int
    kind: str  # "ddp", "local" or "post_local"
    outer_lr: float = 1.0
    outer_momentum: float = 0.0


def methods(quick: bool) -> list[Method]:
    rows = [Method("exact data-parallel (DDP)", 0, "ddp")]
    for lam in (1, 4) if quick else (1, 4, 16):
        rows.append(Method("local, outer_lr 1 (AGN)", lam, "local"))
    for lam in (4,) if quick else (4, 16):
        rows.append(Method("local, outer_lr λ (average)", lam, "local", outer_lr=lam))
        if not quick:
            rows.append(Method("local, outer Nesterov 0.9, lr 0.7λ", lam, "local", 0.7 * lam, 0.9))
        rows.append(Method("PyTorch post-local SGD", lam, "post_local"))
    return rows


class SlowLink:
    """Wraps ``torch.distributed.all_reduce``: sleep ``latency + bytes/bandwidth``, count, run."""

    def __init__(self, latency_s: float, bytes_per_s: float) -> None:
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s
        self.calls, self.bytes = 0, 0
        self._original = dist.all_reduce
        dist.all_reduce = self._all_reduce  # type: ignore[assignment]

    def _all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n = tensor.numel() * tensor.element_size()
        self.calls, self.bytes = self.calls + 1, self.bytes + n
        delay = self.latency_s + (n / self.bytes_per_s if self.bytes_per_s else 0.0)
        if delay:
            time.sleep(delay)
        return self._original(tensor, *args, **kwargs)


def make_model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    )


Batch = tuple[torch.Tensor, torch.Tensor]
Row = tuple[Method, float, float, float, float, float]


def loss_fn(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def shares(n_train: int, args: argparse.Namespace, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's indices of each global batch: epochs of one permutation each, dealt out."""
    gen = torch.Generator().manual_seed(0)
    order = torch.cat([torch.randperm(n_train, generator=gen) for _ in range(64)])
    batches = order[: args.steps * args.batch].split(args.batch)
    return [b[rank::world] for b in batches]


def build(
    method: Method, args: argparse.Namespace
) -> tuple[torch.nn.Module, Callable[[Batch], Any]]:
    """The model and a ``step(batch)`` for one method."""
    model = make_model(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if method.kind == "ddp":
        ddp = DDP(model)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # via dist.all_reduce
        acc = Accumulator(ddp, opt, args.micro)
        return model, lambda b: acc.train_step(b, loss_fn)
    if method.kind == "post_local":
        lam = method.local_steps
        averager = PeriodicModelAverager(period=lam, warmup_steps=lam - 1)
        acc = Accumulator(model, PostLocalSGDOptimizer(opt, averager), args.micro)  # type: ignore[arg-type]
        return model, lambda b: acc.train_step(b, loss_fn)
    local = LocalAccumulation(
        model,
        opt,
        method.local_steps,
        micro_batch_size=args.micro,
        outer_lr=method.outer_lr,
        outer_momentum=method.outer_momentum,
        nesterov=method.outer_momentum > 0,
    )
    return model, lambda b: local.train_step(b, loss_fn)


def run_method(
    method: Method, args: argparse.Namespace, data: Digits, link: SlowLink, rank: int, world: int
) -> Row:
    model, step = build(method, args)
    mine = shares(len(data.y_train), args, rank, world)
    x, y = data.x_train.float(), data.y_train
    dist.barrier()
    calls, sent, start = link.calls, link.bytes, time.perf_counter()
    for idx in mine:
        step((x[idx], y[idx]))
    dist.barrier()
    seconds = time.perf_counter() - start
    calls, sent = link.calls - calls, link.bytes - sent
    with torch.no_grad():
        loss = float(loss_fn(model, (x, y)))
        acc = float((model(data.x_test.float()).argmax(1) == data.y_test).float().mean())
    return method, calls / args.steps, sent / args.steps, seconds / args.steps, loss, acc


def rank_main(rank: int, world: int, init: str, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    link = SlowLink(args.latency_ms / 1e3, args.mbit * 1e6 / 8)
    data = load_digits()
    rows = [run_method(m, args, data, link, rank, world) for m in methods(args.quick)]
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def table(rows: list[Row], args: argparse.Namespace, params: int) -> None:
    ddp = rows[0]
    body = []
    for m, calls, sent, seconds, loss, acc in rows:
        body.append(
            (
                m.name,
                m.local_steps or "-",
                f"{calls:.3g}",
                f"{sent / 1e3:,.1f} kB",
                f"{ddp[2] / sent:.1f}x" if sent else "-",
                f"{seconds * 1e3:.1f}",
                f"{ddp[3] / seconds:.2f}x",
                f"{loss:.4f}",
                f"{acc:.3f}",
            )
        )
    samples = args.steps * args.batch
    parts = [f"{args.latency_ms:g} ms"] if args.latency_ms else []
    link = " + ".join(parts + ([f"bytes at {args.mbit:g} Mbit/s"] if args.mbit else [])) or "none"
    print_table(
        f"{args.ranks} gloo ranks, {params:,} float32 parameters, global batch {args.batch} "
        f"(micro-batch {args.micro}), {args.steps} optimizer steps = {samples:,} samples; slow "
        f"link: {link} before each all-reduce",
        [
            "method",
            "λ",
            "all-reduces/step",
            "bytes/step",
            "fewer bytes than DDP",
            "ms/step",
            "speed-up vs DDP",
            "train loss",
            "test acc",
        ],
        body,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (2-4)")
    parser.add_argument("--steps", type=int, default=192, help="optimizer steps (multiple of 16)")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--micro", type=int, default=8, help="micro-batch size")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width of the MLP")
    parser.add_argument("--lr", type=float, default=0.05, help="inner SGD learning rate")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="per all-reduce")
    parser.add_argument("--mbit", type=float, default=100.0, help="link bandwidth (0: infinite)")
    parser.add_argument("--quick", action="store_true", help="32 steps, λ in {1, 4}: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 32
    if not 2 <= args.ranks <= 4 or args.steps % 16:
        parser.error("use --ranks 2 to 4 and --steps a multiple of 16")
    return args


def main() -> None:
    args = parse()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=rank_main, args=(r, args.ranks, init, args, results))
            for r in range(args.ranks)
        ]
        for p in procs:
            p.start()
        rows = results.get(timeout=3600)
        for p in procs:
            p.join()
    params = sum(p.numel() for p in make_model(args.hidden).parameters())
    print(f"torch {torch.__version__}, CPU ({os.cpu_count()} cores), 1 thread per rank")
    table(rows, args, params)


if __name__ == "__main__":
    main()

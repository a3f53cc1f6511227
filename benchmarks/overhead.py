"""Time per optimizer step: bigbatch's engine against the hand-written accumulation loop.

Every contender does the same work on the same micro-batches: k forwards and backwards, one
gradient clip, one AdamW step, one ``zero_grad``. The contenders are timed round-robin (each
round times every contender once, in a rotating order) so that machine noise, which drifts
over seconds, lands on all of them alike; the ratio to the hand loop is taken within each round
and its median reported with the 25th-75th percentile spread.

Contenders:
    hand loop         the tutorial's loop: ``(loss_fn(mb) / k).backward()`` per micro-batch
    bigbatch          ``Accumulator.train_step(batch, loss_fn)``
    bigbatch low-level  ``with acc.micro_batch(last): acc.backward(loss * n, n)`` + ``acc.step()``
    accelerate        ``with accelerator.accumulate(model):`` (if ``accelerate`` is installed)
    fabric            ``with fabric.no_backward_sync(model, enabled=...):`` (if ``lightning`` is)

Run:
    PYTHONPATH=src python benchmarks/overhead.py                 # CPU
    PYTHONPATH=src python benchmarks/overhead.py --device cuda
    pip install -e ".[compare]"                                  # adds the Accelerate / Fabric rows
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from _measure import device_name, print_table, synchronize

import bigbatch

MAX_GRAD_NORM = 1.0  # every contender clips: the engine always computes the norm it reports

Step = Callable[[], None]  # one optimizer step over the logical batch


def mlp(width: int, depth: int, features: int, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(features, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def mean_ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def pieces_of(batch: tuple[torch.Tensor, torch.Tensor], micro: int) -> list[tuple[Any, Any]]:
    return list(zip(batch[0].split(micro), batch[1].split(micro), strict=True))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def hand_loop(model: nn.Module, batch: Any, micro: int) -> Step:
    """The loop every tutorial shows (the baseline)."""
    opt = _adamw(model)

    def step() -> None:
        pieces = pieces_of(batch, micro)
        for mb in pieces:
            loss = mean_ce(model, mb) / len(pieces)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def engine(model: nn.Module, batch: Any, micro: int) -> Step:
    acc = bigbatch.Accumulator(
        model, _adamw(model), micro_batch_size=micro, max_grad_norm=MAX_GRAD_NORM
    )
    return lambda: acc.train_step(batch, mean_ce) and None


def engine_low_level(model: nn.Module, batch: Any, micro: int) -> Step:
    acc = bigbatch.Accumulator(
        model, _adamw(model), micro_batch_size=micro, max_grad_norm=MAX_GRAD_NORM
    )

    def step() -> None:
        pieces = pieces_of(batch, micro)
        for i, mb in enumerate(pieces):
            with acc.micro_batch(last=i == len(pieces) - 1):
                n = mb[1].shape[0]
                acc.backward(mean_ce(model, mb) * n, n)
        acc.step()

    return step


def accelerate_loop(model: nn.Module, batch: Any, micro: int) -> Step:
    from accelerate import Accelerator

    k = len(pieces_of(batch, micro))
    device = next(model.parameters()).device
    accelerator = Accelerator(gradient_accumulation_steps=k, cpu=device.type == "cpu")
    model, opt = accelerator.prepare(model, _adamw(model))

    def step() -> None:
        for mb in pieces_of(batch, micro):
            with accelerator.accumulate(model):
                accelerator.backward(mean_ce(model, mb))  # divides by k itself
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                opt.step()  # a no-op until the window's last micro-batch
                opt.zero_grad(set_to_none=True)

    return step


def fabric_loop(model: nn.Module, batch: Any, micro: int) -> Step:
    from lightning.fabric import Fabric

    device = next(model.parameters()).device
    fabric = Fabric(accelerator=device.type, devices=1)
    model, opt = fabric.setup(model, _adamw(model))

    def step() -> None:
        pieces = pieces_of(batch, micro)
        for i, mb in enumerate(pieces):
            with fabric.no_backward_sync(model, enabled=i < len(pieces) - 1):
                fabric.backward(mean_ce(model, mb) / len(pieces))
        fabric.clip_gradients(model, opt, max_norm=MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


CONTENDERS: dict[str, tuple[Callable[..., Step], str | None]] = {
    "hand loop": (hand_loop, None),
    "bigbatch train_step": (engine, None),
    "bigbatch low-level": (engine_low_level, None),
    "accelerate accumulate": (accelerate_loop, "accelerate"),
    "fabric no_backward_sync": (fabric_loop, "lightning"),
}


def installed(module: str | None) -> bool:
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def alternate(
    steps: dict[str, Step],
    device: torch.device,
    rounds: int,
    per_round: int,
    clock: Callable[[], float],
) -> dict[str, list[float]]:
    """Seconds per step of each contender, one sample per round, the order rotating every round."""
    names = list(steps)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            synchronize(device)
            start = clock()
            for _ in range(per_round):
                steps[name]()
            synchronize(device)
            seconds[name].append((clock() - start) / per_round)
    return seconds


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def timed(model: nn.Module, features: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per step of each contender (``args.k`` micro-batches of ``args.micro``), one
    sample per alternated round, after a warm-up."""
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    n = args.micro * args.k
    batch = (
        torch.randn(n, features, generator=gen).to(device),
        torch.randint(0, 10, (n,), generator=gen).to(device),
    )
    steps = {}
    for name, (make, module) in CONTENDERS.items():
        if (args.only is None or name in args.only or name == "hand loop") and installed(module):
            steps[name] = make(copy.deepcopy(model).to(device), batch, args.micro)
    for step in steps.values():  # warm-up: allocator, optimizer state, lazy inits
        for _ in range(args.warmup):
            step()
    per_round = max(1, round(args.round_ms / 1e3 / _one_step_s(steps["hand loop"], device)))
    return alternate(steps, device, args.rounds, per_round, CLOCKS[_clock(args)])


def bench_model(
    label: str, model: nn.Module, features: int, args: argparse.Namespace
) -> list[list[str]]:
    seconds = timed(model, features, args)
    hand = seconds["hand loop"]
    rows = []
    for name, times in seconds.items():
        ratios = [t / h for t, h in zip(times, hand, strict=True)]
        r1, r2, r3 = quartiles(ratios)
        t1, t2, t3 = quartiles(times)
        rows.append(
            [
                label,
                name,
                f"{t2 * 1e3:.2f}",
                f"{t1 * 1e3:.2f}-{t3 * 1e3:.2f}",
                f"{r2:.3f}",
                f"{r1:.3f}-{r3:.3f}",
            ]
        )
    return rows


def _one_step_s(step: Step, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / 3


# CPU time of this process: on a shared machine it leaves out the time other processes held the
# cores (wall time would charge it to whichever contender was running). CUDA work is asynchronous
# and not charged to the process, so the GPU is timed by the wall clock after a synchronize.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _clock(args: argparse.Namespace) -> str:
    return args.clock or ("wall" if torch.device(args.device).type == "cuda" else "cpu")


def costs(args: argparse.Namespace) -> None:
    """Where the extra time goes: each contender's time minus the hand loop's, at k = 1, 2, 4, 8
    micro-batches of the tiny model (whose work is so small that what is left is the loop's own
    Python), fitted as ``fixed + k * per_micro_batch`` (least squares). Less noisy than a ratio:
    the differences are taken within each round, and the tiny model's rounds are short."""
    model, rows, ks = mlp(32, 1, 16), [], (1, 2, 4, 8)
    extra: dict[str, dict[int, float]] = {}
    for k in ks:
        seconds = timed(model, 16, argparse.Namespace(**{**vars(args), "k": k, "device": "cpu"}))
        for name, times in seconds.items():
            diffs = [t - h for t, h in zip(times, seconds["hand loop"], strict=True)]
            extra.setdefault(name, {})[k] = statistics.median(diffs) * 1e6
    for name, by_k in list(extra.items())[1:]:
        mean_k, mean_us = statistics.mean(ks), statistics.mean(by_k.values())
        slope = sum((k - mean_k) * (by_k[k] - mean_us) for k in ks)
        slope /= sum((k - mean_k) ** 2 for k in ks)
        fixed = mean_us - slope * mean_k
        bounds = [f"{(fixed + slope * k) / (k * 4e3):.2%}" for k in (1, 4, 8)]
        rows.append(
            [name, *(f"{by_k[k]:.0f}" for k in ks), f"{fixed:.0f}", f"{slope:.1f}", *bounds]
        )
    print_table(
        f"Extra CPU time per optimizer step over the hand loop (us), tiny model, micro-batches "
        f"of {args.micro}, {args.rounds} alternated rounds; the last columns bound the overhead at "
        "micro-batches of 4 ms (the optimizer step's time left out of the denominator)",
        ["loop", *(f"k={k}" for k in ks), "fixed", "per micro-batch", "k=1 @4ms", "k=4 @4ms",
         "k=8 @4ms"],
        rows,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--micro", type=int, default=32, help="micro-batch size (default: 32)")
    parser.add_argument("--k", type=int, default=4, help="micro-batches per step (default: 4)")
    parser.add_argument("--rounds", type=int, default=40, help="round-robin rounds (default: 40)")
    parser.add_argument(
        "--round-ms", type=float, default=100.0, help="time per contender per round"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed steps per contender (default: 5)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    parser.add_argument(
        "--clock", choices=list(CLOCKS), default=None, help="default: cpu on CPU, wall on CUDA"
    )
    parser.add_argument(
        "--only", nargs="*", default=None, help="contenders to run (the hand loop always)"
    )
    parser.add_argument(
        "--costs",
        action="store_true",
        help="split the extra time into a fixed part and a part per micro-batch (CPU, tiny model)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Fabric / Accelerate notes about single-device accumulation
    torch.manual_seed(0)
    if args.costs:
        return costs(args)
    models = [
        ("MLP 256-512x3 (0.66M)", mlp(512, 3, 256), 256),
        ("MLP 16-32 (tiny)", mlp(32, 1, 16), 16),
    ]
    rows = []
    for label, model, features in models:
        rows += bench_model(label, model, features, args)
    title = (
        f"Overhead per optimizer step, {args.k} micro-batches of {args.micro}, AdamW + clipping, "
        f"{args.rounds} alternated rounds, {_clock(args)} clock, on {device_name(args.device)} "
        f"(torch {torch.__version__})"
    )
    headers = [
        "model",
        "loop",
        "ms/step (median)",
        "ms/step p25-p75",
        "ratio to hand loop",
        "ratio p25-p75",
    ]
    print_table(title, headers, rows)


if __name__ == "__main__":
    main()

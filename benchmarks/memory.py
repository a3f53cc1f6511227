"""The classic memory trade-off, reproduced on real models: full batch vs accumulation vs checkpointing.

For a GPT-2-like transformer (built from a transformers config, random weights) and a ResNet-like
CNN, one process measures side by side:

* full batch B, a hand-written plain loop (zero_grad, forward, backward, step);
* micro-batch m = B/k with k accumulation steps (``bigbatch.Accumulator``);
* the same with every repeated block checkpointed (``bigbatch.enable_checkpointing``);
* the planner's choice (``bigbatch.plan``) under a budget the full batch exceeds;
* one plain step of m samples (the memory reference for accumulation at micro-batch m).

"Peak" is the training memory of a step: a fresh copy of the model, its optimizer (AdamW) state,
gradients and activations: ``measure_peak`` around building them and two steps. Time is the
median of ``--steps`` optimizer steps of the effective batch after those two. Ratios are to the
full batch, beside a published reference (8.86 samples/s at 14,949 MB with batch 4; 7.75 at
8,681 MB with 1 x 4 accumulated; 5.99 at 6,775 MB adding checkpointing).

Run:
    PYTHONPATH=src python benchmarks/memory.py                       # CPU, small models (~2 min)
    PYTHONPATH=src python benchmarks/memory.py --device cuda --layers 12 --dim 768 --seq 1024 \\
        --batch 16 --cnn-width 128 --cnn-blocks 8 --image 128 --cnn-batch 64
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import device_name, median_seconds, print_table, synchronize  # noqa: E402

import bigbatch  # noqa: E402
from bigbatch.memory.planner import Plan, _fix_mmap_threshold, print_plan  # noqa: E402
from bigbatch.split import batch_size as count_samples  # noqa: E402

# samples/s, MB: batch 4; 1 x 4 accumulated; the same plus checkpointing.
REFERENCE = {"full": (8.86, 14949), "accumulated": (7.75, 8681), "checkpointed": (5.99, 6775)}


def gpt2(args: argparse.Namespace, device: str) -> tuple[nn.Module, Any, Callable]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.dim,
        n_head=args.dim // 64,
        n_positions=args.seq,
        vocab_size=args.vocab,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(device).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    return model, ids, lm_loss


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


class ResBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = (
            nn.Conv2d(width, width, 3, padding=1),
            nn.Conv2d(width, width, 3, padding=1),
        )
        self.norm1, self.norm2 = nn.GroupNorm(8, width), nn.GroupNorm(8, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))


def cnn(args: argparse.Namespace, device: str) -> tuple[nn.Module, Any, Callable]:
    torch.manual_seed(0)
    w = args.cnn_width
    model = nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1),
        nn.ReLU(),
        nn.Sequential(*[ResBlock(w) for _ in range(args.cnn_blocks)]),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(w, 10),
    ).to(device)
    images = torch.randn(args.cnn_batch, 3, args.image, args.image, device=device)
    labels = torch.randint(0, 10, (args.cnn_batch,), device=device)
    return model, (images, labels), cnn_loss


def cnn_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def measure(
    template: nn.Module,
    batch: Any,
    loss_fn: Callable,
    micro: int | None,
    fraction: float,
    device: str,
    steps: int,
    keep_grads: bool = False,
) -> dict[str, float]:
    """Peak and median step time of one configuration; ``micro=None`` is the hand-written loop."""
    n = count_samples(batch)
    with bigbatch.measure_peak(device) as peak:
        model = copy.deepcopy(template)
        if fraction > 0:
            bigbatch.enable_checkpointing(model, fraction=fraction)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if micro is None:

            def step() -> None:
                opt.zero_grad(set_to_none=not keep_grads)
                loss_fn(model, batch).backward()
                opt.step()
        else:
            acc = bigbatch.Accumulator(model, opt, micro_batch_size=micro)

            def step() -> None:
                acc.train_step(batch, loss_fn)

        step()
        step()
        synchronize(device)
    seconds = median_seconds(step, device, warmup=0, repeats=steps)
    return {"peak": peak.peak_bytes, "seconds": seconds, "samples_per_s": n / seconds}


def run_model(
    name: str, model: nn.Module, batch: Any, loss_fn: Callable, args: argparse.Namespace
) -> None:
    dev, steps = args.device, args.steps
    B = count_samples(batch)
    m = max(1, B // args.k)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\n## {name}: {params / 1e6:.1f}M parameters, batch {B}, micro-batch {m} x {args.k}, on {device_name(dev)}"
    )
    rows: dict[str, dict[str, float]] = {}
    rows["full"] = measure(model, batch, loss_fn, None, 0.0, dev, steps)
    rows["accumulated"] = measure(model, batch, loss_fn, m, 0.0, dev, steps)
    rows["checkpointed"] = measure(model, batch, loss_fn, m, 1.0, dev, steps)
    small = bigbatch.split(batch, m)[0]
    rows["plain_m"] = measure(model, small, loss_fn, None, 0.0, dev, steps)
    rows["plain_m_kept"] = measure(model, small, loss_fn, None, 0.0, dev, steps, keep_grads=True)
    budget = int(args.budget_fraction * rows["full"]["peak"])
    result = bigbatch.plan(model, batch, loss_fn, memory_budget=budget, steps=steps)
    print_plan(result)
    choice = result.choice
    rows["planner"] = measure(
        model, batch, loss_fn, choice.micro_batch_size, choice.checkpointing, dev, steps
    )
    print_rows(name, rows, B, m, args.k, choice, budget)
    print_targets(rows, result, budget)


def print_rows(name: str, rows: dict, B: int, m: int, k: int, choice: Any, budget: int) -> None:
    full = rows["full"]
    labels = {
        "full": f"full batch {B} (plain loop)",
        "accumulated": f"{m} x {k} accumulated (bigbatch)",
        "checkpointed": f"{m} x {k} accumulated + checkpointing",
        "planner": f"planner, budget {budget / 2**20:,.0f} MiB: {choice.micro_batch_size} x "
        f"{choice.gradient_accumulation_steps}, {choice.checkpointing:.0%} ckpt",
        "plain_m": f"one plain step of {m} samples (reference)",
        "plain_m_kept": "the same, gradients kept (zero_grad(set_to_none=False))",
    }
    table = []
    for key, label in labels.items():
        r = rows[key]
        ref = REFERENCE.get(key)
        ref_cells = [f"{ref[0] / 8.86:.2f}", f"{ref[1] / 14949:.2f}"] if ref else ["-", "-"]
        table.append(
            [
                label,
                f"{r['seconds'] * 1000:,.0f}",
                f"{r['samples_per_s']:,.1f}",
                f"{r['peak'] / 2**20:,.0f}",
                f"{r['samples_per_s'] / full['samples_per_s']:.2f}",
                f"{r['peak'] / full['peak']:.2f}",
                *ref_cells,
            ]
        )
    print_table(
        f"{name}: time, speed and peak memory, ratios to the full batch (reference: the published run)",
        [
            "configuration",
            "ms/step",
            "samples/s",
            "peak MiB",
            "speed",
            "memory",
            "ref. speed",
            "ref. memory",
        ],
        table,
    )


def print_targets(rows: dict, result: Plan, budget: int) -> None:
    acc, ckpt = rows["accumulated"], rows["checkpointed"]
    print()
    for key, how in (("plain_m", "gradients freed"), ("plain_m_kept", "gradients kept")):
        same = acc["peak"] / rows[key]["peak"]
        verdict = "within" if abs(same - 1) <= 0.05 else "NOT within"
        print(
            f"- accumulation peak at micro-batch m / one plain step of m ({how}): {same:.3f} ({verdict} 5%)"
        )
    fits = {f.checkpointing: f for f in result.fits}
    cost = ckpt["seconds"] / acc["seconds"] - 1
    if 0.0 in fits and 1.0 in fits:
        saving = 1 - fits[1.0].bytes_per_sample / fits[0.0].bytes_per_sample
        half = (
            1 - fits[0.5].bytes_per_sample / fits[0.0].bytes_per_sample
            if 0.5 in fits
            else float("nan")
        )
        print(
            f"- checkpointing every block: {cost:+.0%} time per step; activation memory per sample "
            f"(slope of the planner's fit) {saving:.0%} lower (half the blocks: {half:.0%} lower); "
            f"target <= +25% time where >= 50% saved: {'met' if cost <= 0.25 and saving >= 0.5 else 'NOT met'}"
        )
        print(
            "- largest micro-batch within the budget, by checkpointed fraction: "
            + ", ".join(
                f"{f:.0%}: {fit.largest_fitting(budget)}" for f, fit in sorted(fits.items())
            )
        )
    else:
        print(
            f"- checkpointing every block: {cost:+.0%} time per step (too few sizes fitted for a slope)"
        )
    fitting = [c for c in result.candidates if c.fits and c.seconds_per_step]
    fastest = all(result.choice.seconds_per_step <= c.seconds_per_step for c in fitting)
    others = [rows[k] for k in ("full", "accumulated", "checkpointed") if rows[k]["peak"] <= budget]
    best_other = min((r["seconds"] for r in others), default=float("inf"))
    ratio = rows["planner"]["seconds"] / best_other if others else float("nan")
    print(f"- planner: {result.reason}")
    print(
        f"- planner's choice is the fastest of its {len(fitting)} measured configurations that fit: "
        f"{'yes' if fastest else 'NO'}; re-measured, its time / the fastest fitting row above: "
        f"{ratio:.2f} ({len(others)} rows fit the budget)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="both", choices=["both", "transformer", "cnn"])
    parser.add_argument(
        "--k", type=int, default=4, help="accumulation steps of the micro-batch rows"
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per configuration (median)"
    )
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.6,
        help="planner's memory budget as a fraction of the full batch's peak",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cnn-width", type=int, default=64)
    parser.add_argument("--cnn-blocks", type=int, default=4)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--cnn-batch", type=int, default=16)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(2)
        _fix_mmap_threshold()  # Note [honest CPU peaks] in bigbatch.memory.planner, for every row
    print(f"# bigbatch memory benchmark on {device_name(args.device)} (torch {torch.__version__})")
    print("command: python benchmarks/memory.py " + " ".join(sys.argv[1:]))
    if args.model in ("both", "transformer"):
        run_model("GPT-2-like transformer", *gpt2(args, args.device), args)
    if args.model in ("both", "cnn"):
        run_model("ResNet-like CNN", *cnn(args, args.device), args)


if __name__ == "__main__":
    main()

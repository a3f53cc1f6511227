"""The classic memory trade-off, reproduced on real models: full batch vs accumulation vs checkpointing.

For a GPT-2-like transformer (built from a transformers config, random weights) and a ResNet-like
CNN, one process measures side by side:

* full batch B, a hand-written plain loop (zero_grad, forward, backward, step);
* micro-batch m = B/k with k accumulation steps (``bigbatch.Accumulator``);
* the same with every repeated block checkpointed (``bigbatch.enable_checkpointing``);
* the planner's choice (``bigbatch.plan``, default options: none / selective / 50% / full, and
  offload on CUDA; 10% safety margin) under a budget the full batch exceeds, with its table, its
  runner-up and why it lost; ``--plans N`` plans N times and says whether the choice held;
* one plain step of m samples (the memory reference for accumulation at micro-batch m).

Then, on the GPT-2-like model, the checkpointing frontier: time per step against activation
memory for no checkpointing, ``policy="selective"``, whole-block recompute of 25 / 50 / 75 / 100%
of the blocks (``policy="full"``) and, on CUDA, ``policy="offload"``. All configurations are built
first and timed in interleaved rounds (one step of each per round, median over the rounds), so a
load that comes and goes on a shared machine touches them alike. "Activation memory" is the peak
of forward + backward above what was in use before it (parameters, gradients kept allocated,
optimizer state). The table gives ratios to no checkpointing and marks the configuration that
meets the target (>= 50% of the activation memory saved at <= 1.15x the time) or, failing that,
comes closest: the fastest of those saving >= 50%, else the one saving most.

"Peak" is the training memory of a step: a fresh copy of the model, its optimizer (AdamW) state,
gradients and activations: ``measure_peak`` around building them and two steps. Time is the
median of ``--steps`` optimizer steps of the effective batch after those two. Ratios are to the
full batch, beside a published reference (8.86 samples/s at 14,949 MB with batch 4; 7.75 at
8,681 MB with 1 x 4 accumulated; 5.99 at 6,775 MB adding checkpointing).

Run:
    PYTHONPATH=src python benchmarks/memory.py                       # CPU, small models (~3 min)
    PYTHONPATH=src python benchmarks/memory.py --frontier-only --plot docs/frontier.png
    PYTHONPATH=src python benchmarks/memory.py --quick               # smoke test (seconds)
    PYTHONPATH=src python benchmarks/memory.py --no-frontier --plans 3   # the planner's part
    PYTHONPATH=src python benchmarks/memory.py --device cuda --layers 12 --dim 768 --seq 1024 \\
        --batch 16 --cnn-width 128 --cnn-blocks 8 --image 128 --cnn-batch 64
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import device_name, median_seconds, print_table, synchronize  # noqa: E402

import bigbatch  # noqa: E402
from bigbatch.app.report import print_plan  # noqa: E402
from bigbatch.core.peak import small_mmap_threshold  # noqa: E402
from bigbatch.core.split import batch_size as count_samples  # noqa: E402
from bigbatch.memory._candidates import ranked, ties  # noqa: E402
from bigbatch.memory.planner import Plan  # noqa: E402

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
    policy: str = "full",
) -> dict[str, float]:
    """Peak and median step time of one configuration; ``micro=None`` is the hand-written loop."""
    n = count_samples(batch)
    with bigbatch.measure_peak(device) as peak:
        model = copy.deepcopy(template)
        if fraction > 0:
            bigbatch.enable_checkpointing(model, fraction=fraction, policy=policy)
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
    plans = [
        bigbatch.plan(model, batch, loss_fn, memory_budget=budget, steps=steps)
        for _ in range(args.plans)
    ]
    if dev == "cpu":  # plan leaves training's malloc thresholds (Note [timing under load])
        small_mmap_threshold().__enter__()  # Note [honest CPU peaks], for the rows that follow
    result = plans[0]
    print_plan(result)
    choice = result.choice
    rows["planner"] = measure(
        model, batch, loss_fn, choice.micro_batch_size, choice.checkpointing, dev, steps,
        policy=choice.policy,
    )  # fmt: skip
    print_rows(name, rows, B, m, args.k, choice, budget)
    print_targets(rows, result, budget)
    print_stability(plans)


def print_rows(name: str, rows: dict, B: int, m: int, k: int, choice: Any, budget: int) -> None:
    full = rows["full"]
    labels = {
        "full": f"full batch {B} (plain loop)",
        "accumulated": f"{m} x {k} accumulated (bigbatch)",
        "checkpointed": f"{m} x {k} accumulated + checkpointing",
        "planner": f"planner, budget {budget / 2**20:,.0f} MiB: {choice.micro_batch_size} x "
        f"{choice.gradient_accumulation_steps}, checkpointing {choice.label}",
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
    fits = {f.label: f for f in result.fits}
    cost = ckpt["seconds"] / acc["seconds"] - 1
    if "none" in fits and "full" in fits:
        base = fits["none"].bytes_per_sample
        saved = {k: 1 - f.bytes_per_sample / base for k, f in fits.items() if k != "none"}
        print(
            f"- checkpointing every block: {cost:+.0%} time per step; activation memory per sample "
            "(slope of the planner's fit) lower by: "
            + ", ".join(f"{k} {v:.0%}" for k, v in saved.items())
            + f"; target <= +25% time where >= 50% saved: "
            f"{'met' if cost <= 0.25 and saved['full'] >= 0.5 else 'NOT met'}"
        )
        print(
            f"- largest micro-batch within the budget less the {result.margin:.0%} margin, by "
            "option: "
            + ", ".join(f"{k}: {f.largest_fitting(result.usable_bytes)}" for k, f in fits.items())
        )
    else:
        print(
            f"- checkpointing every block: {cost:+.0%} time per step (too few sizes fitted for a slope)"
        )
    print_planner_check(rows, result, budget)


def print_planner_check(rows: dict, result: Plan, budget: int) -> None:
    """The choice against the plan's own measurements and against the table's rows."""
    fitting = ranked(result.candidates)
    fastest = fitting[0]
    tied = ties(result.choice, fastest)
    others = [rows[k] for k in ("full", "accumulated", "checkpointed") if rows[k]["peak"] <= budget]
    best_other = min((r["seconds"] for r in others), default=float("inf"))
    ratio = rows["planner"]["seconds"] / best_other if others else float("nan")
    print(f"- planner: {result.reason}")
    print(
        f"- planner's choice among its {len(fitting)} measured configurations that fit the budget "
        f"less the margin: {'the fastest' if fastest is result.choice else 'tied with the fastest' if tied else 'NOT tied with the fastest'}"
        f" ({result.choice.seconds_per_step / fastest.seconds_per_step:.2f}x its time); peak "
        f"{result.choice.peak_bytes / 2**20:,.1f} MiB of {result.usable_bytes / 2**20:,.1f} usable; "
        f"re-measured, its time / the fastest fitting row above: {ratio:.2f} ({len(others)} rows "
        "fit the budget)"
    )


def print_stability(plans: list[Plan]) -> None:
    """Whether repeated plans of the same model chose the same configuration."""
    if len(plans) < 2:
        return
    choices = [p.choice.describe() for p in plans]
    same = len(set(choices)) == 1
    print(f"- {len(plans)} plans, same choice: {'yes' if same else 'NO'} ({'; '.join(choices)})")


# --------------------------------------------------------------------------- the frontier

TARGET_SAVED, TARGET_TIME = 0.5, 1.15  # >= 50% activation memory saved at <= 1.15x the time


def frontier_configs(device: str) -> list[tuple[str, float, str | None]]:
    """``(label, fraction, policy)`` of every point on the frontier; offload on CUDA only."""
    configs: list[tuple[str, float, str | None]] = [
        ("none", 0.0, None),
        ("selective", 1.0, "selective"),
        *[(f"full {f:.0%} of blocks", f, "full") for f in (0.25, 0.5, 0.75)],
        ("full", 1.0, "full"),
    ]
    if device == "cuda":
        configs.append(("offload", 1.0, "offload"))
    return configs


class FrontierPoint:
    """One configuration: its own model copy and optimizer, and what its steps measured."""

    def __init__(
        self, template: nn.Module, fraction: float, policy: str | None, loss_fn: Callable
    ) -> None:
        self.model = copy.deepcopy(template)
        if policy is not None:
            bigbatch.enable_checkpointing(self.model, fraction=fraction, policy=policy)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.loss_fn = loss_fn
        self.seconds: list[float] = []
        self.activation_bytes: list[int] = []

    def step(self, batch: Any, device: str) -> None:
        """One optimizer step; forward + backward inside ``measure_peak`` (gradients kept)."""
        self.opt.zero_grad(set_to_none=False)  # gradients stay allocated: not activations
        with bigbatch.measure_peak(device) as peak:
            start = time.perf_counter()
            self.loss_fn(self.model, batch).backward()
            synchronize(device)
            forward_backward = time.perf_counter() - start
        start = time.perf_counter()
        self.opt.step()
        synchronize(device)
        self.seconds.append(forward_backward + time.perf_counter() - start)
        self.activation_bytes.append(peak.peak_bytes)


def measure_frontier(
    template: nn.Module, batch: Any, loss_fn: Callable, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """Median seconds per step and activation bytes per configuration, interleaved rounds."""
    points = {
        label: FrontierPoint(template, fraction, policy, loss_fn)
        for label, fraction, policy in frontier_configs(args.device)
    }
    for _ in range(2):  # warm-up: allocator, thread pools, optimizer state
        for point in points.values():
            point.step(batch, args.device)
    for point in points.values():
        point.seconds.clear()
        point.activation_bytes.clear()
    for _ in range(args.rounds):
        for point in points.values():
            point.step(batch, args.device)
    return {
        label: {
            "seconds": statistics.median(p.seconds),
            "activation": statistics.median(p.activation_bytes),
        }
        for label, p in points.items()
    }


def target_choice(rows: dict[str, dict[str, float]]) -> tuple[str, bool]:
    """The configuration that meets the target, or the closest: ``(label, meets)``."""
    base = rows["none"]
    ratios = {
        k: (r["seconds"] / base["seconds"], 1 - r["activation"] / base["activation"])
        for k, r in rows.items()
        if k != "none"
    }
    saving = [k for k, (_, saved) in ratios.items() if saved >= TARGET_SAVED]
    if saving:
        best = min(saving, key=lambda k: ratios[k][0])
        return best, ratios[best][0] <= TARGET_TIME
    return max(ratios, key=lambda k: ratios[k][1]), False


def print_frontier(rows: dict[str, dict[str, float]], title: str) -> None:
    base = rows["none"]
    choice, meets = target_choice(rows)
    table = []
    for label, r in rows.items():
        time_ratio = r["seconds"] / base["seconds"]
        memory_ratio = r["activation"] / base["activation"]
        mark = ("meets the target" if meets else "closest to the target") if label == choice else ""
        table.append(
            [
                label,
                f"{r['seconds'] * 1000:,.0f}",
                f"{r['activation'] / 2**20:,.1f}",
                f"{time_ratio:.2f}",
                f"{memory_ratio:.2f}",
                f"{1 - memory_ratio:.0%}",
                mark,
            ]
        )
    print_table(
        title,
        ["checkpointing", "ms/step", "activation MiB", "time", "memory", "saved", "target"],
        table,
    )
    t, saved = (rows[choice]["seconds"] / base["seconds"],
                1 - rows[choice]["activation"] / base["activation"])  # fmt: skip
    print(
        f"\n- target: >= {TARGET_SAVED:.0%} of the activation memory saved at <= "
        f"{TARGET_TIME:.2f}x the time of no checkpointing: "
        + (f"met by {choice}" if meets else f"NOT met; closest: {choice}")
        + f" ({saved:.0%} saved at {t:.2f}x)"
    )


def plot_frontier(rows: dict[str, dict[str, float]], path: str, title: str) -> None:
    """Time ratio against activation memory ratio, one labelled point per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows["none"]
    choice, _ = target_choice(rows)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.axvspan(0, TARGET_TIME, ymax=0.5 / 1.1, color="tab:green", alpha=0.12, label="target")
    for label, r in rows.items():
        x, y = r["seconds"] / base["seconds"], r["activation"] / base["activation"]
        ax.scatter([x], [y], color="tab:red" if label == choice else "tab:blue", zorder=3)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    times = [r["seconds"] / base["seconds"] for r in rows.values()]
    ax.set_xlim(min(0.9, min(times) - 0.05), max(1.6, max(times) + 0.15))
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("time per step / no checkpointing")
    ax.set_ylabel("activation memory / no checkpointing")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_frontier(model: nn.Module, batch: Any, loss_fn: Callable, args: argparse.Namespace) -> None:
    n = count_samples(batch)
    title = (
        f"Checkpointing frontier, GPT-2-like transformer, batch {n}, on {device_name(args.device)}"
        f" (median of {args.rounds} interleaved rounds)"
    )
    rows = measure_frontier(model, batch, loss_fn, args)
    print_frontier(rows, title)
    if args.plot:
        plot_frontier(rows, args.plot, title.replace(", on", "\non"))
        print(f"- plot: {args.plot}")


QUICK = {  # --quick: the frontier of a small model, a smoke test in seconds
    "layers": 2, "dim": 128, "seq": 32, "vocab": 512, "batch": 4, "rounds": 2,
    "frontier_only": True,
}  # fmt: skip


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
    parser.add_argument(
        "--rounds", type=int, default=7, help="interleaved timed rounds of the frontier (median)"
    )
    parser.add_argument(
        "--frontier-only", action="store_true", help="only the GPT-2-like checkpointing frontier"
    )
    parser.add_argument("--plot", default=None, help="write the frontier plot to this PNG path")
    parser.add_argument(
        "--no-frontier", action="store_true", help="only the tables: rows, planner, no frontier"
    )
    parser.add_argument(
        "--plans", type=int, default=1, help="plans per model (more than 1: is the choice stable?)"
    )
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch)")
    parser.add_argument(
        "--quick", action="store_true", help="the frontier of a small model: a smoke test"
    )
    args = parser.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(args.threads)
        small_mmap_threshold().__enter__()  # Note [honest CPU peaks], for every row of this process
    print(f"# bigbatch memory benchmark on {device_name(args.device)} (torch {torch.__version__})")
    print("command: python benchmarks/memory.py " + " ".join(sys.argv[1:]))
    if args.model in ("both", "transformer"):
        if not args.frontier_only:
            run_model("GPT-2-like transformer", *gpt2(args, args.device), args)
        if not args.no_frontier:
            run_frontier(*gpt2(args, args.device), args)
    if args.model in ("both", "cnn") and not args.frontier_only:
        run_model("ResNet-like CNN", *cnn(args, args.device), args)


if __name__ == "__main__":
    main()

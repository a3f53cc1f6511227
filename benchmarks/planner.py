"""Does ``bigbatch plan`` choose well on a noisy CPU? Three plans per task, each choice timed
against the fastest configuration that fits.

Two tasks:

* **demo**: the ``bigbatch demo`` model (a 64 -> 8192 -> 10 MLP in float64) on scikit-learn's
  digits, batch 512, the planner's default options (no repeated blocks: micro-batch sizes 16 to
  512 without checkpointing) and its default budget (the machine's available memory);
* **gpt2**: a GPT-2 built from ``transformers.GPT2Config`` (random weights, no download; 4
  layers, width 128, 64 tokens, vocabulary 4,096, the config's dropout), batch 16, the default
  options (none, selective, 50% and 100% of the blocks recomputed), under a budget of
  ``--gpt2-budget`` (60%) of the whole batch's peak without checkpointing, so the fastest
  configurations compete with checkpointed ones.

A third, **lm** (``--task lm``), times the plan itself: ``bigbatch plan
examples/causal_lm.py:task --batch-size 32 --micro-batch-tokens auto`` (a 2-layer GPT-2 on the
standard library's docstrings, default options and budget), in a fresh process: the plan's
seconds, the configurations it measured and timed, the timed steps, its choice. Run it against
another checkout's ``src`` (``PYTHONPATH=../old/src``) for a before/after.

Each plan runs in a fresh process, as ``bigbatch plan`` does. Then a reference pass, in a fresh
process of its own that never touches malloc's settings (as a training script), builds every
configuration that fits (by the first plan's peaks) with its own model copy and AdamW, and times
them in ``--rounds`` interleaved rounds (each visit: one untimed step, then two timed steps;
alternating order), median. "Fastest fitting" is the fastest of those; each plan's choice is
reported as its reference time over the fastest's, and is within the target when at most 1.10.

Run (11 minutes on 2 idle cores, 18 with four other jobs on them):
    PYTHONPATH=src python benchmarks/planner.py
    PYTHONPATH=src python benchmarks/planner.py --task gpt2 --plans 3 --rounds 9
    PYTHONPATH=src python benchmarks/planner.py --task lm
"""

from __future__ import annotations

import argparse
import copy
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import device_name, print_table  # noqa: E402

import bigbatch  # noqa: E402
from bigbatch.core.split import batch_size  # noqa: E402
from bigbatch.memory._candidates import option_label  # noqa: E402
from bigbatch.memory.planner import Plan  # noqa: E402

TARGET = 1.10  # every choice within 10% of the fastest fitting configuration


def build(task: str, tiny: bool) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, batch, loss_fn)`` of a task; ``tiny``: small sizes for a smoke test."""
    torch.manual_seed(0)
    if task == "demo":
        from bigbatch.app import demo

        data = demo.load_digits()
        n = 64 if tiny else 512
        model = demo.make_model(256 if tiny else 8192)
        return model, (data.x_train[:n], data.y_train[:n]), demo.loss_fn
    if task == "lm":  # examples/causal_lm.py:task, as `bigbatch plan` reads it
        from bigbatch.app.task import first_batch, load_task

        lm = load_task(str(Path(__file__).resolve().parents[1] / "examples/causal_lm.py:task"))
        return lm.model, first_batch(lm, 8 if tiny else 32), lm.loss_fn
    from transformers import GPT2Config, GPT2LMHeadModel

    dim, layers, seq, vocab, n = (32, 2, 16, 256, 4) if tiny else (128, 4, 64, 4096, 16)
    config = GPT2Config(n_embd=dim, n_layer=layers, n_head=2, n_positions=seq, vocab_size=vocab)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))
    return model, ids, lm_loss


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def child(args: argparse.Namespace) -> Any:
    """What one fresh process does: a probe of the whole batch's peak, a plan, or the reference."""
    torch.set_num_threads(args.threads)
    model, batch, loss_fn = build(args.task, args.tiny)
    if args.child == "probe":
        sizes, options = [batch_size(batch)], ("none",)
        whole = bigbatch.plan(model, batch, loss_fn, micro_batch_sizes=sizes, checkpointing=options)
        return whole.candidates[0].peak_bytes
    if args.child == "plan" and args.task == "lm":  # the plan's own time
        start = time.perf_counter()
        lm = bigbatch.plan(model, batch, loss_fn, steps=args.steps, micro_batch_tokens="auto")
        return lm, time.perf_counter() - start
    if args.child == "plan":
        return bigbatch.plan(model, batch, loss_fn, memory_budget=args.budget, steps=args.steps)
    return reference(model, batch, loss_fn, args.configs, args.rounds)


def reference(model: torch.nn.Module, batch: Any, loss_fn: Any, configs: list, rounds: int) -> dict:
    """Median seconds per step of each ``(micro_batch_size, policy, fraction)`` as a training
    loop runs it: its own copy and optimizer, interleaved rounds, default malloc settings."""
    runs = {}
    for m, policy, fraction in configs:
        net = copy.deepcopy(model)
        if policy != "none":
            bigbatch.enable_checkpointing(net, fraction=fraction, policy=policy)
        acc = bigbatch.Accumulator(net, torch.optim.AdamW(net.parameters()), micro_batch_size=m)
        runs[(m, policy, fraction)] = (acc, [])
    for r in range(rounds):
        for acc, seconds in list(runs.values())[:: 1 if r % 2 == 0 else -1]:
            acc.train_step(batch, loss_fn)  # untimed
            for _ in range(2):
                start = time.perf_counter()
                acc.train_step(batch, loss_fn)
                seconds.append(time.perf_counter() - start)
    return {key: statistics.median(seconds) for key, (_, seconds) in runs.items()}


def in_fresh_process(args: argparse.Namespace, **changes: Any) -> Any:
    """Run ``child`` with ``changes`` in a new Python process and return what it returned."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.pkl"
        settings = {**vars(args), **changes, "out": str(out)}
        code = (
            "import pickle, argparse, sys; sys.path.insert(0, sys.argv[1]); import planner; "
            "args = argparse.Namespace(**pickle.loads(bytes.fromhex(sys.argv[2]))); "
            "pickle.dump(planner.child(args), open(args.out, 'wb'))"
        )
        command = [
            sys.executable,
            "-c",
            code,
            str(Path(__file__).parent),
            pickle.dumps(settings).hex(),
        ]
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
        if done.returncode:
            raise RuntimeError(done.stderr[-3000:])
        with open(out, "rb") as f:
            return pickle.load(f)


def run_task(task: str, args: argparse.Namespace) -> list[float]:
    """Three (``--plans``) plans, the reference pass, and the table; returns each choice's ratio."""
    budget = None
    if task == "gpt2" and not args.tiny:  # a tiny model's peak is its weights: nothing would fit
        whole = in_fresh_process(args, task=task, child="probe")
        budget = int(args.gpt2_budget * whole)
    plans: list[Plan] = [
        in_fresh_process(args, task=task, child="plan", budget=budget) for _ in range(args.plans)
    ]
    first = plans[0]
    configs = [(c.micro_batch_size, c.policy, c.checkpointing) for c in first.candidates if c.fits]
    ref = in_fresh_process(args, task=task, child="reference", configs=configs)
    fastest = min(ref, key=ref.get)
    print(f"\n## {task}: batch {first.batch_size}, budget {first.memory_budget / 2**20:,.1f} MiB "
          f"({first.usable_bytes / 2**20:,.1f} usable), {len(configs)} configurations fit")  # fmt: skip
    print(f"fastest fitting (reference pass): {describe(fastest)}, {ref[fastest] * 1000:,.1f} ms")
    rows, ratios = [], []
    for i, p in enumerate(plans, 1):
        c = p.choice
        key = (c.micro_batch_size, c.policy, c.checkpointing)
        ratio = ref[key] / ref[fastest] if key in ref else float("nan")
        ratios.append(ratio)
        q1, q3 = c.spread_seconds or (0.0, 0.0)
        rows.append([
            f"run {i}", describe(key), f"{c.seconds_per_step * 1000:,.1f}",
            f"{q1 * 1000:,.1f}-{q3 * 1000:,.1f}", f"{ref.get(key, float('nan')) * 1000:,.1f}",
            f"{ratio:.2f}", "yes" if ratio <= TARGET else "NO",
            "-" if p.runner_up is None else describe(
                (p.runner_up.micro_batch_size, p.runner_up.policy, p.runner_up.checkpointing)),
        ])  # fmt: skip
    print_table(
        f"{task}: {args.plans} plan{'s' * (args.plans > 1)} side by side (each in a fresh process)",
        ["plan", "choice", "plan ms", "plan spread", "reference ms", "/ fastest", "within 10%",
         "runner-up"],
        rows,
    )  # fmt: skip
    print_reference(ref, fastest)
    return ratios


def run_lm(args: argparse.Namespace) -> None:
    """One plan of the language model with token budgets: how long, and what it ran."""
    p, seconds = in_fresh_process(args, task="lm", child="plan", budget=None)
    timed = [c for c in p.candidates if c.seconds_per_step]
    print_table(
        f"lm: bigbatch plan examples/causal_lm.py:task --batch-size {p.batch_size} "
        "--micro-batch-tokens auto (default options and budget)",
        ["plan s", "measured", "timed", "timed steps", "choice"],
        [[f"{seconds:,.1f}", str(sum(c.measured for c in p.candidates)), str(len(timed)),
          str(sum(len(c.step_seconds) for c in timed)), p.choice.describe()]],
    )  # fmt: skip


def describe(key: tuple) -> str:
    m, policy, fraction = key
    return f"{m} {option_label((policy, fraction))}"


def print_reference(ref: dict, fastest: tuple) -> None:
    table = [[describe(k), f"{t * 1000:,.1f}", f"{t / ref[fastest]:.2f}"] for k, t in ref.items()]
    print_table(
        "reference pass: every fitting configuration", ["configuration", "ms", "ratio"], table
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["both", "demo", "gpt2", "lm"], default="both")
    parser.add_argument("--plans", type=int, default=3, help="plans per task (fresh processes)")
    parser.add_argument("--steps", type=int, default=5, help="plan(steps=): timed rounds")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the reference pass")
    parser.add_argument("--gpt2-budget", type=float, default=0.6,
                        help="GPT-2's budget, a fraction of the whole batch's peak")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--tiny", action="store_true", help="tiny models: a smoke test")
    args = parser.parse_args()
    args.child, args.budget, args.configs = None, None, []
    torch.set_num_threads(args.threads)
    print(f"# bigbatch planner benchmark on {device_name('cpu')} (torch {torch.__version__})")
    print("command: python benchmarks/planner.py " + " ".join(sys.argv[1:]))
    if args.task == "lm":
        return run_lm(args)
    ratios = []
    for task in ("demo", "gpt2") if args.task == "both" else (args.task,):
        ratios += run_task(task, args)
    worst = max(ratios)
    verdict = "met" if worst <= TARGET else "NOT met"
    print(f"\n- every choice within 10% of the fastest fitting configuration: {verdict} "
          f"(worst {worst:.2f}; {', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip


if __name__ == "__main__":
    main()

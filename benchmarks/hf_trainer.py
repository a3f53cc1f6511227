"""bigbatch.hf.Trainer beside transformers.Trainer at equal settings: time per optimizer step,
and each one's distance from the full-batch step (float64, right-padded text of varied lengths).

Run: python benchmarks/hf_trainer.py [--steps 12] [--repeats 7]

A step's time is the gap between two optimizer steps' ends (a callback's clock), the median
over the run; the repeats alternate the two trainers, so a shared machine's changing load falls
on both, and the median of the repeats is reported.
"""

import argparse
import copy
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from integrations.hf_models import Wrapper, arguments, collate, distance, sgd, texts  # noqa: E402

import bigbatch.hf  # noqa: E402


def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(torch.float64)


class Clock(transformers.TrainerCallback):
    """The time of each optimizer step's end: a step's time is the gap between two ends (the
    train loop's start-up and accelerate's end-of-training cleanup are not steps)."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def run(cls, net, batch, steps, max_steps, n):
    """Train ``net`` for ``max_steps`` steps; the median seconds per step after the first."""
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = cls(
            model=net, args=arguments(tmp, batch, steps, max_steps=max_steps),
            train_dataset=texts(n, high=60), data_collator=collate, optimizers=sgd(net),
            callbacks=[clock],
        )  # fmt: skip
        trainer.train()
    gaps = [b - a for a, b in itertools.pairwise(clock.ends)]
    return statistics.median(gaps) if gaps else float("nan")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=7)
    a = parser.parse_args()
    torch.set_num_threads(2)
    n, batch, k = 32, 8, 4
    print(f"device: cpu ({torch.get_num_threads()} threads); Llama 2x64, float64; {n} samples, "
          f"{batch} x {k} per step, {a.steps} steps")  # fmt: skip
    print(f"{'model':<22}{'trainer':<14}{'s/step':>9}{'ratio':>8}{'distance from full batch':>28}")
    trainers = (transformers.Trainer, bigbatch.hf.Trainer)
    for name, wrap in (("stock", lambda m: m), ("wrapper (no kwargs)", Wrapper)):
        base = model()
        full = wrap(copy.deepcopy(base))
        run(transformers.Trainer, full, n, 1, 2, n)  # two one-batch steps: the reference
        times, far = {cls: [] for cls in trainers}, {}
        for cls in trainers:  # warm-up, and each one's distance after two steps
            net = wrap(copy.deepcopy(base))
            run(cls, net, batch, k, 2, n)
            far[cls] = distance(net, full, wrap(base))
        for _ in range(a.repeats):  # interleaved: the machine's load falls on both alike
            for cls in trainers:
                times[cls].append(run(cls, wrap(copy.deepcopy(base)), batch, k, a.steps, n))
        median = {cls: statistics.median(times[cls]) for cls in trainers}
        for cls in trainers:
            ratio = median[cls] / median[transformers.Trainer]
            label = "transformers" if cls is transformers.Trainer else "bigbatch"
            print(f"{name:<22}{label:<14}{median[cls]:>9.3f}{ratio:>8.3f}{far[cls]:>28.1e}")


if __name__ == "__main__":
    main()

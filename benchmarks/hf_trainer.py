"""bigbatch.hf.Trainer beside transformers.Trainer at equal settings: time per optimizer step,
and each one's distance from the full-batch step (float64, right-padded text of varied lengths).

Run: python benchmarks/hf_trainer.py [--steps 6] [--repeats 3]
"""

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import bigbatch.hf  # noqa: E402
from integrations.hf_models import Wrapper, arguments, collate, distance, sgd, texts  # noqa: E402


def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def run(cls, net, batch, steps, max_steps, n):
    with tempfile.TemporaryDirectory() as tmp:
        trainer = cls(
            model=net, args=arguments(tmp, batch, steps, max_steps=max_steps),
            train_dataset=texts(n, high=60), data_collator=collate, optimizers=sgd(net),
        )  # fmt: skip
        start = time.perf_counter()
        trainer.train()
        return (time.perf_counter() - start) / max_steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    torch.set_num_threads(2)
    n, batch, k = 32, 8, 4
    print(f"device: cpu ({torch.get_num_threads()} threads); Llama 2x64, float64; {n} samples, "
          f"{batch} x {k} per step, {a.steps} steps")  # fmt: skip
    print(f"{'model':<22}{'trainer':<14}{'s/step':>9}{'ratio':>8}{'distance from full batch':>28}")
    for name, wrap in (("stock", lambda m: m), ("wrapper (no kwargs)", Wrapper)):
        base = model()
        full = wrap(copy.deepcopy(base))
        run(transformers.Trainer, full, n, 1, 2, n)  # two one-batch steps: the reference
        times = {}
        for cls in (transformers.Trainer, bigbatch.hf.Trainer):
            runs = [run(cls, wrap(copy.deepcopy(base)), batch, k, a.steps, n) for _ in range(a.repeats)]
            times[cls] = statistics.median(runs)
            net = wrap(copy.deepcopy(base))
            run(cls, net, batch, k, 2, n)
            times[cls, "d"] = distance(net, full, wrap(base))
        for cls in (transformers.Trainer, bigbatch.hf.Trainer):
            ratio = times[cls] / times[transformers.Trainer]
            label = "transformers" if cls is transformers.Trainer else "bigbatch"
            print(f"{name:<22}{label:<14}{times[cls]:>9.3f}{ratio:>8.3f}{times[cls, 'd']:>28.1e}")


if __name__ == "__main__":
    main()

"""Keras 3 on PyTorch: full-batch fit vs bigbatch.keras.accumulate vs gradient_accumulation_steps.

Keras' own option (``optimizer=SGD(..., gradient_accumulation_steps=k)``) accumulates over k
consecutive *fit steps*: the data pipeline yields batches of B/k, each micro-batch's loss is a
mean, the update divides the summed means by k, and the optimizer's counter, the learning-rate
schedule and the callbacks run per micro-batch. ``bigbatch.keras.accumulate(model, B/k)`` keeps
fit's batch at B and cuts each step into micro-batches of B/k itself. The same model, data and
optimizer run three ways, side by side in one process:

* **full batch**: ``fit(batch_size=B)``, Keras' own step (the reference);
* **bigbatch**: ``accumulate(model, B // k)`` then ``fit(batch_size=B)``;
* **Keras GA**: ``gradient_accumulation_steps=k`` and ``fit(batch_size=B // k)``.

Table 1 (what each one computes) runs four scenarios for two epochs: equal micro-batches with a
constant learning rate (Keras' option is exact there), the same with a learning-rate schedule, a
data set whose last batch is short, and padded token sequences whose loss is masked (uneven real
tokens per micro-batch). It reports what callbacks see (``on_train_batch_end`` calls), the
optimizer's ``iterations`` (Keras GA reports updates) and the counter its schedule reads
(``_iterations``), the learning rate reached, and the largest relative parameter difference to
the full batch. It runs in float64 with Keras' 64-to-32-bit type promotion lifted (Keras on torch
computes float64 matmuls in float32 otherwise), so that exact means ~1e-16.

Table 2 (what each one costs) fits a model whose activations dominate memory (a broadcast
``tanh(x[..., None] * v)`` layer) in float32 for one epoch: seconds per epoch (median of
``--repeats`` epochs, the three methods taking turns) and the peak memory of the epoch (CPU resident-set high-water mark, or the CUDA
allocator's peak; on the CPU with glibc's mmap threshold fixed at 64 KiB, as the planner does, so
that freed tensors leave the resident set), as ratios to the full batch.

Run:
    PYTHONPATH=src python benchmarks/keras_peer.py             # CPU, about a minute (quiet machine)
    PYTHONPATH=src python benchmarks/keras_peer.py --batch 1024 --k 8   # on a GPU
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import device_name, median_seconds, mib, peak_bytes, print_table  # noqa: E402

import bigbatch.keras  # noqa: E402

METHODS = ("full batch", "bigbatch", "Keras GA")


class Calls(keras.callbacks.Callback):
    """Counts ``on_train_batch_end`` calls (what a logging or LR-printing callback sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.calls += 1


def dense_model(seed: int) -> tuple[keras.Model, keras.losses.Loss]:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4)]
    )
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def masked_model(seed: int, vocab: int = 32, steps: int = 16) -> tuple[keras.Model, Any]:
    keras.utils.set_random_seed(seed)
    ids = keras.Input((steps,), dtype="int32")
    h = keras.layers.Embedding(vocab, 16, mask_zero=True)(ids)
    h = keras.layers.Dense(32, activation="tanh")(h)
    model = keras.Model(ids, keras.layers.Dense(vocab)(h))
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dense_data(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.normal(size=(n, 8)), rng.integers(0, 4, n)


def token_data(n: int, rng: np.random.Generator, vocab: int = 32, steps: int = 16) -> tuple:
    """Padded sequences from 1 to ``steps`` real tokens (0 pads); labels per position."""
    ids = rng.integers(1, vocab, (n, steps))
    lengths = rng.integers(1, steps + 1, n)
    ids[np.arange(steps)[None, :] >= lengths[:, None]] = 0
    return ids, rng.integers(0, vocab, (n, steps))


def run(method: str, build: Callable, data: tuple, batch: int, k: int, lr: Any) -> dict:
    """Two epochs of ``method``; what it computed."""
    model, loss = build(0)
    steps = k if method == "Keras GA" else None
    model.compile(
        optimizer=keras.optimizers.SGD(lr, momentum=0.9, gradient_accumulation_steps=steps),
        loss=loss,
    )
    if method == "bigbatch":
        bigbatch.keras.accumulate(model, batch // k)
    calls = Calls()
    fit_batch = batch // k if method == "Keras GA" else batch
    model.fit(*data, batch_size=fit_batch, epochs=2, shuffle=False, verbose=0, callbacks=[calls])
    opt = model.optimizer
    return {
        "weights": model.get_weights(),
        "calls": calls.calls,
        "iterations": int(opt.iterations),
        "counter": int(opt._iterations),  # what the learning-rate schedule is evaluated at
        "lr": float(opt.learning_rate),
    }


def relative_error(want: list[np.ndarray], got: list[np.ndarray]) -> float:
    return max(
        float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
        for a, b in zip(want, got, strict=True)
    )


def exactness_table(k: int) -> None:
    from keras.src.backend.common import dtypes

    dtypes.BIT64_TO_BIT32_DTYPE["float64"] = "float64"  # float64 throughout (see the docstring)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy(
        "float64"
    )  # Keras pins its policy: set_floatx alone is not enough
    rng = np.random.default_rng(0)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.8)
    scenarios = [  # name, model, data, batch B, learning rate
        ("equal micro-batches, constant LR", dense_model, dense_data(64, rng), 16, 0.1),
        ("equal micro-batches, LR schedule", dense_model, dense_data(64, rng), 16, schedule),
        ("short last batch (56 = 16+16+16+8)", dense_model, dense_data(56, rng), 16, 0.1),
        ("masked tokens (1-16 per sequence)", masked_model, token_data(64, rng), 16, 0.1),
    ]
    rows = []
    for name, build, data, batch, lr in scenarios:
        results = {m: run(m, build, data, batch, k, lr) for m in METHODS}
        reference = results["full batch"]["weights"]
        for method, r in results.items():
            error = relative_error(reference, r["weights"])
            rows.append(
                [name if method == "full batch" else "", method, r["calls"], r["iterations"]]
                + [
                    r["counter"],
                    f"{r['lr']:.4g}",
                    "-" if method == "full batch" else f"{error:.1e}",
                ]
            )
    print_table(
        f"What each computes: fit batch B=16, k={k} (micro-batch 4), SGD momentum 0.9, 2 epochs, "
        "float64",
        ["scenario", "method", "callback steps", "iterations", "schedule counter", "final LR",
         "param error vs full batch"],
        rows,
    )  # fmt: skip
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")
    dtypes.BIT64_TO_BIT32_DTYPE["float64"] = "float32"


class Expand(keras.layers.Layer):
    """``mean(tanh(x[..., None] * v), -1)``: activations ``width`` times the input's size."""

    def __init__(self, width: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.width = width

    def build(self, input_shape: Any) -> None:
        self.v = self.add_weight(shape=(self.width,), initializer="random_normal", name="v")

    def call(self, x: Any) -> Any:
        return keras.ops.mean(keras.ops.tanh(x[:, :, None] * self.v), axis=-1)


def cost_table(batch: int, k: int, repeats: int, device: str) -> None:
    if device == "cpu":  # as Note [honest CPU peaks] in bigbatch/memory/planner.py: freed tensors
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 65536)  # leave the resident set
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(4 * batch, 256)).astype("float32"), rng.integers(0, 4, 4 * batch)

    def build(seed: int) -> tuple[keras.Model, Any]:
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((256,)), Expand(256), keras.layers.Dense(4)])
        return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    epochs = {}
    for method in METHODS:
        model, loss = build(0)
        steps = k if method == "Keras GA" else None
        model.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=steps),
                      loss=loss)  # fmt: skip
        if method == "bigbatch":
            bigbatch.keras.accumulate(model, batch // k)
        fit_batch = batch // k if method == "Keras GA" else batch

        def epoch(model: keras.Model = model, fit_batch: int = fit_batch) -> None:
            model.fit(x, y, batch_size=fit_batch, shuffle=False, verbose=0)

        epoch()  # builds the optimizer before anything is measured
        epochs[method] = epoch
    peaks = {}
    for method, epoch in epochs.items():
        gc.collect()
        peaks[method] = peak_bytes(epoch, device)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(repeats):  # round robin: a change in the machine's load hits all three
        for method, epoch in epochs.items():
            times[method].append(median_seconds(epoch, device, warmup=0, repeats=1))
    seconds = {m: statistics.median(t) for m, t in times.items()}
    rows = [
        [m, f"{seconds[m]:.2f}", f"{seconds[m] / seconds['full batch']:.2f}x", mib(peaks[m]),
         f"{peaks[m] / peaks['full batch']:.2f}x"]
        for m in METHODS
    ]  # fmt: skip
    print_table(
        f"What each costs: {4 * batch} samples, B={batch}, k={k}, float32, {device_name(device)}",
        ["method", "s / epoch", "time vs full", "peak memory", "memory vs full"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="accumulation steps (micro = B / k)")
    parser.add_argument("--batch", type=int, default=256, help="fit batch B of the cost table")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per method")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"keras {keras.__version__}, torch {torch.__version__}, {device_name(device)}")
    exactness_table(args.k)
    cost_table(args.batch, args.k, args.repeats, device)


if __name__ == "__main__":
    main()

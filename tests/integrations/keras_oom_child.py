"""Child process for test_keras.py: Keras ``fit`` under RLIMIT_DATA, accumulate("auto"), one JSON line.

Run as ``python keras_oom_child.py MARGIN_MIB`` with PYTHONPATH holding the repository's src and
tests. The model's first layer broadcasts ``tanh(x[..., None] * v)``: its activations grow with
the micro-batch (about 12 MiB per sample in float64) and dominate the step. A full-batch ``fit``
of a copy runs first, with no limit; then the data segment is limited to what is in use plus
``MARGIN_MIB`` and the accumulated ``fit`` runs, so that the whole batch really fails to
allocate on the CPU and "auto" has to shrink. Prints whether it ran out of memory, the sizes it
used and the largest relative difference to the full-batch run.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import torch  # noqa: E402
from keras.src.backend.common import dtypes  # noqa: E402
from limits import limit_data  # noqa: E402 (tests/ is on the path)

import bigbatch.keras  # noqa: E402

MiB = 2**20
N, BATCH, D, E = 32, 16, 256, 2048  # two fit steps of 16 samples


class Expand(keras.layers.Layer):
    """``mean(tanh(x[..., None] * v), -1)``: E times the input's size in activations."""

    def build(self, input_shape: tuple[int, ...]) -> None:
        self.v = self.add_weight(shape=(E,), initializer="random_normal", name="v")

    def call(self, x: torch.Tensor) -> torch.Tensor:
        return keras.ops.mean(keras.ops.tanh(x[:, :, None] * self.v), axis=-1)


def model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    net = keras.Sequential([keras.Input((D,)), Expand(), keras.layers.Dense(3)])
    net.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return net


class Steps(keras.callbacks.Callback):
    """Counts on_train_batch_end calls. Overriding it also keeps Keras from dispatching callbacks
    on a thread pool: a thread started under the limit can abort in glibc, uncatchably."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.calls += 1


def main(margin_mib: float) -> dict:
    torch.set_num_threads(1)
    dtypes.BIT64_TO_BIT32_DTYPE["float64"] = "float64"  # float64 throughout (see test_keras.py)
    keras.config.set_floatx("float64")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=gen, dtype=torch.float64).numpy()
    y = torch.randint(0, 3, (N,), generator=gen).numpy()
    full, acc = model(0), model(0)
    full.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[Steps()])  # no limit
    handle = bigbatch.keras.accumulate(acc, "auto")
    steps = Steps()
    limit_data(margin_mib)
    try:
        acc.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[steps])
    except BaseException as exc:
        limit_data(None)
        return {"raised": f"{type(exc).__name__}: {exc}"[:300]}
    limit_data(None)
    state = handle.auto_state
    worst = max(
        float(abs(a - b).max() / max(abs(a).max(), 1e-30))
        for a, b in zip(full.get_weights(), acc.get_weights(), strict=True)
    )
    return {
        "raised": None,
        "ceiling": state.ceiling,
        "micro_batch_size": handle.last.micro_batch_size,
        "iterations": int(acc.optimizer.iterations),
        "callback_steps": steps.calls,
        "error_to_full_batch": worst,
    }


if __name__ == "__main__":
    print(json.dumps(main(float(sys.argv[1]))), flush=True)

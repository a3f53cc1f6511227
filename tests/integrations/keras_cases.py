"""Keras models, data and a recording callback shared by the Keras tests and the OOM child.

Import it after KERAS_BACKEND=torch is set (tests/integrations/test_keras.py does).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import torch

VOCAB, STEPS = 11, 7  # token ids 1..10 (0 is padding), 7 positions


Built = tuple[keras.Model, dict[str, Any]]
"""A model and the keyword arguments of its ``compile`` (less the optimizer)."""


def dense(seed: int, reduction: str = "sum_over_batch_size", limit: int = 0) -> Built:
    """A small MLP; ``limit``: it runs out of memory above that many samples (``NeedsMemory``)."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,)), keras.layers.Dense(16, activation="tanh")]
    layers += [NeedsMemory(limit)] if limit else []
    model = keras.Sequential([*layers, keras.layers.Dense(3)])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    return model, {"loss": ce, "metrics": ["accuracy"]}


def conv(seed: int) -> Built:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((7, 7, 2)),
            keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(4, 3, strides=2, activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, {"loss": ce, "metrics": ["accuracy"]}


def masked(seed: int, regularized: bool = False, two_outputs: bool = False, **loss: Any) -> Built:
    """Per-token classification of padded sequences: Embedding(mask_zero=True) masks the loss."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((STEPS,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(ids)
    reg = keras.regularizers.L2(0.01) if regularized else None
    h = keras.layers.Dense(8, activation="tanh", kernel_regularizer=reg)(h)
    tokens = keras.layers.Dense(VOCAB, name="tokens")(h)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, **loss)
    if not two_outputs:
        return keras.Model(ids, tokens), {"loss": ce}
    value = keras.layers.Dense(1, name="value")(h)
    losses = [ce, keras.losses.MeanSquaredError()]
    return keras.Model(ids, [tokens, value]), {"loss": losses, "loss_weights": [1.0, 0.3]}


def data(kind: str, n: int, gen: torch.Generator, two_outputs: bool = False) -> dict[str, Any]:
    """Fresh inputs and labels for ``kind`` ("dense", "conv" or "masked") as numpy arrays."""
    if kind == "masked":
        ids = torch.randint(1, VOCAB, (n, STEPS), generator=gen)
        lengths = torch.randint(1, STEPS + 1, (n,), generator=gen)
        lengths[0] = lengths[-5] = STEPS  # full sequences, others as short as one token
        lengths[-2:] = 1  # the last batch of 5 ends short: its micro-batches hold uneven tokens
        ids[torch.arange(STEPS)[None, :] >= lengths[:, None]] = 0
        y: Any = torch.randint(0, VOCAB, (n, STEPS), generator=gen).numpy()
        if two_outputs:
            y = [y, torch.randn(n, STEPS, 1, generator=gen, dtype=torch.float64).numpy()]
        return {"x": ids.numpy(), "y": y}
    shape = (n, 7, 7, 2) if kind == "conv" else (n, 6)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).numpy()
    return {"x": x, "y": torch.randint(0, 3, (n,), generator=gen).numpy()}


class Recorder(keras.callbacks.Callback):
    """What callbacks see at each on_train_batch_end: step, iterations, learning rate, loss."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, float, float]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        optimizer = self.model.optimizer
        lr = float(optimizer.learning_rate)
        self.seen.append((batch, int(optimizer.iterations), lr, float(logs["loss"])))


class NeedsMemory(keras.layers.Layer):
    """Identity whose forward runs out of memory above ``limit`` samples (torch's own error)."""

    def __init__(self, limit: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.limit = limit

    def compute_output_shape(self, input_shape: Any) -> Any:  # Keras traces without calling
        return input_shape

    def call(self, x: Any) -> Any:
        if not x.is_meta and x.shape[0] > self.limit:  # Keras builds the model on meta tensors
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate the activations of {x.shape[0]} samples "
                f"(this layer fits {self.limit})."
            )
        return x


def weights_error(a: keras.Model, b: keras.Model) -> float:
    """Largest ``‖a - b‖ / ‖a‖`` over the weights and the optimizer's variables (2-norms)."""
    pairs = list(zip(a.get_weights(), b.get_weights(), strict=True))
    numpy = keras.ops.convert_to_numpy
    pairs += [
        (numpy(u), numpy(v))
        for u, v in zip(a.optimizer.variables, b.optimizer.variables, strict=True)
    ]
    worst = 0.0
    for u, v in pairs:
        u, v = u.astype(np.float64), v.astype(np.float64)
        worst = max(worst, float(np.linalg.norm(u - v) / max(np.linalg.norm(u), 1e-30)))
    return worst

"""Keras 3 ``model.fit`` with the batch you want: one line, and the step is exactly the full batch's.

Run: PYTHONPATH=src python examples/keras_fit.py      (needs: pip install "bigbatch[keras]")

A per-token classifier on padded sequences (Embedding(mask_zero=True) masks the padding out of
the loss, so micro-batches hold very different numbers of real tokens). The same model is fit
twice from the same weights: once with the whole batch of 64 in one piece, once with
``bigbatch.keras.accumulate(model, micro_batch_size=8)``, which cuts every fit step into 8
micro-batches and still takes one optimizer step over the 64 sequences. The weights end up
equal to float32 rounding (about 3e-5 relative per weight after 12 AdamW steps), and fit's
logs, learning-rate schedule and callbacks see the same steps.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # bigbatch.keras needs Keras on PyTorch

import keras  # noqa: E402
import numpy as np  # noqa: E402

import bigbatch.keras  # noqa: E402

VOCAB, STEPS, N = 32, 16, 256
rng = np.random.default_rng(0)
tokens = rng.integers(1, VOCAB, (N, STEPS))
lengths = rng.integers(2, STEPS + 1, N)
tokens[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0  # 0 = padding
labels = (tokens * 7 + 3) % VOCAB  # a learnable per-token rule


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    ids = keras.Input((STEPS,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 16, mask_zero=True)(ids)
    h = keras.layers.Dense(32, activation="gelu")(h)
    model = keras.Model(ids, keras.layers.Dense(VOCAB)(h))
    schedule = keras.optimizers.schedules.CosineDecay(3e-2, decay_steps=3 * N // 64)
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


full, accumulated = build(), build()
bigbatch.keras.accumulate(accumulated, micro_batch_size=8)  # the one line

fit = {"batch_size": 64, "epochs": 3, "shuffle": False, "verbose": 0}
logs_full = full.fit(tokens, labels, **fit).history
logs_acc = accumulated.fit(tokens, labels, **fit).history

for epoch in range(fit["epochs"]):
    print(
        f"epoch {epoch}: loss {logs_acc['loss'][epoch]:.4f} (full batch {logs_full['loss'][epoch]:.4f})"
        f", accuracy {logs_acc['accuracy'][epoch]:.3f} (full batch {logs_full['accuracy'][epoch]:.3f})"
    )
# Each weight's relative difference, ||a - b|| / ||a||: float32 rounding differs between the
# two runs (sums in another order), and AdamW's normalised updates carry it on from step to step.
difference = max(
    float(np.linalg.norm(a - b) / np.linalg.norm(a))
    for a, b in zip(full.get_weights(), accumulated.get_weights(), strict=True)
)
steps = int(accumulated.optimizer.iterations), int(full.optimizer.iterations)
print(f"optimizer steps: {steps[0]} (full batch {steps[1]})")
print(f"weights equal to the full batch: largest ||a - b|| / ||a|| {difference:.1e} (float32)")
assert difference < 1e-4 and steps[0] == steps[1]

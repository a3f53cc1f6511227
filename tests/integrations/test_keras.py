"""bigbatch.keras: ``fit`` with ``accumulate`` equals ``fit`` with the whole batch in one piece.

The reference is Keras' own ``fit`` on the full batch (its own train step), run on a second copy
of the same model; both see the same data, the same schedule and the same callbacks. The tests
run in float64 with Keras' 64-to-32-bit type promotion lifted (see the ``float64`` fixture), so
that agreement to 1e-10 can be asserted; one test runs plain float32 Keras at 1e-5.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import forks
import pytest

os.environ["KERAS_BACKEND"] = "torch"  # before keras is first imported: bigbatch.keras needs it
keras = pytest.importorskip("keras", reason='Keras 3 is not installed: pip install -e ".[keras]"')

import numpy as np  # noqa: E402
import torch  # noqa: E402
from keras_cases import (  # noqa: E402
    Recorder,
    conv,
    data,
    dense,
    masked,
    weights_error,
)
from reference import full_batch_step, max_relative_error  # noqa: E402

import bigbatch  # noqa: E402
import bigbatch.keras  # noqa: E402
from bigbatch.core._sizing import AutoState  # noqa: E402

# Keras' own np.array(tensor) calls warn under numpy 2 (keras/src/backend/torch/core.py).
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
TESTS = Path(__file__).resolve().parent
N, BATCH = 25, 10  # one epoch: fit steps of 10, 10 and a short last 5 samples
OPTIMIZERS = {
    "plain-sgd": lambda: keras.optimizers.SGD(learning_rate=0.1),  # no momentum, no schedule
    "sgd": lambda: keras.optimizers.SGD(
        learning_rate=keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5),
        momentum=0.9,
        clipnorm=1.0,  # per variable
    ),
    "adamw": lambda: keras.optimizers.AdamW(
        learning_rate=keras.optimizers.schedules.CosineDecay(
            0.0, decay_steps=6, warmup_target=0.01, warmup_steps=2
        ),
        weight_decay=0.01,
        global_clipnorm=1.0,
        use_ema=True,  # the averages are optimizer variables: compared with the weights
        ema_momentum=0.5,
    ),
}


@pytest.fixture(autouse=True)
def _keras_defaults():
    """Every test starts from Keras' defaults: float32 weights and a float32 dtype policy.

    Keras pins its global dtype policy the first time a layer asks for it, and
    ``set_floatx`` alone does not move it: both are set, and put back after the test.
    """
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def float64(monkeypatch, _keras_defaults):
    """Keras in float64 end to end.

    ``set_floatx("float64")`` makes float64 weights, but Keras aligns its type promotion with
    JAX's default and computes float64 matmuls in float32 (``BIT64_TO_BIT32_DTYPE`` in
    keras/src/backend/common/dtypes.py). Lifting that for the test's duration makes both runs
    float64 throughout, so that a difference of 1e-10 means a real difference.
    """
    from keras.src.backend.common import dtypes

    monkeypatch.setitem(dtypes.BIT64_TO_BIT32_DTYPE, "float64", "float64")
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


def _fit(built: Any, optimizer: str, micro: int | str | None, **fit: Any) -> dict[str, Any]:
    model, compile_kwargs = built
    model.compile(optimizer=OPTIMIZERS[optimizer](), **compile_kwargs)
    handle = bigbatch.keras.accumulate(model, micro) if micro is not None else None
    recorder = Recorder()
    history = model.fit(batch_size=BATCH, shuffle=False, verbose=0, callbacks=[recorder], **fit)
    return {"model": model, "history": history.history, "seen": recorder.seen, "handle": handle}


def _assert_same_training(full: dict[str, Any], acc: dict[str, Any], rtol: float) -> None:
    assert weights_error(full["model"], acc["model"]) < rtol
    for name in ("iterations", "learning_rate"):
        want = float(getattr(full["model"].optimizer, name))
        assert float(getattr(acc["model"].optimizer, name)) == pytest.approx(want, rel=1e-12)
    assert int(acc["model"].optimizer.iterations) == 3  # one per fit step
    assert len(acc["seen"]) == len(full["seen"]) == 3  # callbacks saw one call per fit step
    for got, want in zip(acc["seen"], full["seen"], strict=True):
        assert got[:3] == pytest.approx(want[:3], rel=1e-12)  # step, iterations, learning rate
        assert got[3] == pytest.approx(want[3], rel=rtol)  # the loss fit reported
    assert acc["history"].keys() == full["history"].keys()
    for key, values in full["history"].items():
        assert acc["history"][key] == pytest.approx(values, rel=rtol), key


def _numpy(variable: Any) -> np.ndarray:
    return keras.ops.convert_to_numpy(variable)


def _weights(fit: dict[str, Any], gen: torch.Generator, per_token: bool, scale: float) -> None:
    n = len(fit["x"])
    shape = (n, fit["x"].shape[1]) if per_token else (n,)
    fit["sample_weight"] = torch.rand(shape, generator=gen, dtype=torch.float64).numpy() * scale


# builder, its options, data kind, optimizer, micro_batch_size, fit options, and whether the
# engine counts a divisor before each window (a masked divisor beside another loss term; Note
# [keras loss terms]). The masked data's micro-batches hold very uneven real tokens
# (keras_cases.data): a masked term alone is exact only if the engine divides by the window's
# total count.
CASES = {
    "masked-adamw": (masked, {}, "masked", "adamw", 4, {}, 0),  # one term: no count pass
    "masked-l2-sgd": (masked, {"regularized": True}, "masked", "sgd", 3, {}, 1),
    "conv-adamw": (conv, {}, "conv", "adamw", 4, {}, 0),
    "conv-sgd-micro-3": (conv, {}, "conv", "sgd", 3, {}, 0),
    "dense-adamw-micro-1": (dense, {}, "dense", "adamw", 1, {}, 0),
    "two-outputs-adamw": (masked, {"two_outputs": True}, "masked", "adamw", 4, {}, 1),
    "masked-mean-with-sample-weight": (
        masked,
        {"reduction": "mean_with_sample_weight"},
        "masked",
        "sgd",
        4,
        {"sample_weight": "per-token"},
        0,
    ),
    "masked-l2-sample-weights-below-1": (  # each window's divisor, a sum of weights, is < 1
        masked,
        {"regularized": True, "reduction": "mean_with_sample_weight"},
        "masked",
        "sgd",
        4,
        {"sample_weight": "per-token", "scale": 1e-3},
        1,
    ),
    "dense-sum-class-weight": (
        dense,
        {"reduction": "sum"},
        "dense",
        "sgd",
        4,
        {"class_weight": {0: 0.5, 1: 2.0, 2: 1.0}},
        0,
    ),
}
# Issue 21, 4b: the fit steps of 10 cut as 10, 5+5, 4+4+2 and 2x5, with and without sample
# weights, SGD with and without momentum.
for _split, _micro in {"10": 10, "5+5": 5, "4+4+2": 4, "2x5": 2}.items():
    for _sgd in ("sgd", "plain-sgd"):
        CASES[f"dense-{_sgd}-{_split}"] = (dense, {}, "dense", _sgd, _micro, {}, 0)
        CASES[f"dense-{_sgd}-{_split}-sample-weight"] = (
            dense, {}, "dense", _sgd, _micro, {"sample_weight": "per-sample"}, 0
        )  # fmt: skip
QUICK = {"dense-sgd-4+4+2-sample-weight", "dense-plain-sgd-2x5", "masked-adamw", "masked-l2-sgd"}


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize(
    "case",
    [c if c in QUICK else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
)
def test_fit_with_accumulate_equals_fit_with_the_full_batch(case: str, gen) -> None:
    builder, options, kind, optimizer, micro, extra, counted = CASES[case]
    fit = data(kind, N, gen, two_outputs=options.get("two_outputs", False))
    if "sample_weight" in extra:
        per_token = extra["sample_weight"] == "per-token"
        _weights(fit, gen, per_token, extra.get("scale", 1.0))
    if "class_weight" in extra:
        fit["class_weight"] = extra["class_weight"]
    seed = int(torch.randint(0, 2**16, (1,), generator=gen))
    full = _fit(builder(seed, **options), optimizer, None, **fit)
    acc = _fit(builder(seed, **options), optimizer, micro, **fit)
    assert {w.dtype for w in acc["model"].weights} == {"float64"}
    _assert_same_training(full, acc, rtol=1e-10)
    last = acc["handle"].last
    assert (last.samples, last.micro_batch_size) == (5, min(micro, 5))  # the short last batch
    assert last.micro_batches == -(-5 // micro)
    assert last.counted is bool(counted)


@pytest.mark.slow
def test_float32_keras_agrees_to_float32_rounding(gen) -> None:
    """Plain float32 Keras (its default): the two runs agree to 1e-5."""
    fit = data("masked", N, gen)
    full = _fit(masked(1), "adamw", None, **fit)
    acc = _fit(masked(1), "adamw", 4, **fit)
    assert {w.dtype for w in acc["model"].weights} == {"float32"}
    _assert_same_training(full, acc, rtol=1e-5)


@pytest.mark.slow
def test_mixed_precision_steps_once_per_fit_step(gen) -> None:
    """mixed_float16: the LossScaleOptimizer scales each share and unscales the sum once."""
    fit = data("dense", N, gen)
    keras.config.set_dtype_policy("mixed_float16")  # put back by _keras_defaults
    full = _fit(dense(8), "adamw", None, **fit)
    acc = _fit(dense(8), "adamw", 4, **fit)
    assert type(acc["model"].optimizer).__name__ == "LossScaleOptimizer"
    _assert_same_training(full, acc, rtol=1e-2)  # float16 forward: rounding of ~1e-3


@pytest.mark.usefixtures("float64")
def test_auto_survives_out_of_memory_and_stays_exact(gen) -> None:
    """The layer runs out of memory above 3 samples: auto shrinks 10 -> 5 -> 2 and stays exact."""
    fit = data("dense", N, gen)
    full = _fit(dense(2), "adamw", None, **fit)
    acc = _fit(dense(2, limit=3), "adamw", "auto", **fit)
    _assert_same_training(full, acc, rtol=1e-10)
    handle = acc["handle"]
    assert handle.auto_state.ceiling is not None and handle.last.micro_batch_size <= 3
    assert handle.last.oom_retries == 0  # found in the first step, kept afterwards


def test_auto_grows_after_ten_clean_steps_not_after_the_batch_size(gen) -> None:
    """Issue 21, 4b: fit steps of 12; 12 and 6 run out of memory, 3 fits. After 10 clean steps
    "auto" probes half-way to the ceiling (4, which fits); waiting for 12 would stay at 3."""
    fit = data("dense", 11 * 12, gen)
    sizes: list[int] = []
    model, kwargs = dense(5, limit=4)
    model.compile(optimizer="sgd", **kwargs)
    handle = bigbatch.keras.accumulate(model, "auto")
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: sizes.append(handle.last.micro_batch_size)
    )
    model.fit(batch_size=12, shuffle=False, verbose=0, callbacks=[record], **fit)
    assert sizes == [3] * 10 + [4]
    assert handle.auto_state == AutoState(size=4, ceiling=6, clean_windows=1, fits=4)


def test_plain_float64_keras_is_float32_accurate_and_says_so(gen, monkeypatch) -> None:
    """Issue 21, 4b: under ``set_floatx("float64")`` alone Keras computes float64 layers in
    float32 (``float64`` fixture), its own full-batch step included: the accumulated run is as
    close to float64 arithmetic as the full batch is, and a warning says why both are ~1e-7."""
    from keras.src.backend.common import dtypes

    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    fit = data("dense", N, gen)
    full = _fit(dense(3), "sgd", None, **fit)
    match = r"weights are float64, but Keras computes float64 layers in float32"
    with pytest.warns(bigbatch.BigBatchWarning, match=match):
        acc = _fit(dense(3), "sgd", 4, **fit)
    monkeypatch.setitem(dtypes.BIT64_TO_BIT32_DTYPE, "float64", "float64")
    exact = _fit(dense(3), "sgd", None, **fit)  # float64 arithmetic: the judge of both
    full_error = weights_error(exact["model"], full["model"])
    assert full_error > 1e-10  # Keras' own full batch is float32-accurate ...
    assert weights_error(exact["model"], acc["model"]) < 10 * full_error  # ... and so is this


def _dropout_tagger(seed: int, regularized: bool) -> tuple[keras.Model, dict[str, Any]]:
    keras.utils.set_random_seed(seed)
    ids = keras.Input((7,), dtype="int32")
    h = keras.layers.Dropout(0.3, seed=1)(keras.layers.Embedding(11, 8, mask_zero=True)(ids))
    reg = keras.regularizers.L2(0.01) if regularized else None
    tokens = keras.layers.Dense(11, kernel_regularizer=reg)(h)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return keras.Model(ids, tokens), {"loss": ce, "metrics": ["accuracy"]}


def test_the_count_pass_moves_no_keras_state(gen) -> None:
    """A masked loss beside a regulariser is counted in a pass without gradients before each
    window: its forwards must not move the seed generators or the metrics (the unregularised
    twin, which needs no count pass, draws as many dropout masks)."""
    fit = data("masked", N, gen)
    seeds, counts = [], []
    for regularized in (False, True):
        model, kwargs = _dropout_tagger(0, regularized)
        model.compile(optimizer="sgd", **kwargs)
        handle = bigbatch.keras.accumulate(model, 4)
        model.fit(batch_size=BATCH, shuffle=False, verbose=0, **fit)
        assert handle.last.counted is regularized
        dropout = next(layer for layer in model.layers if isinstance(layer, keras.layers.Dropout))
        seeds.append(_numpy(dropout.seed_generator.state))
        counts.append([_numpy(v) for v in model.metrics_variables if v.path.endswith("count")])
    np.testing.assert_array_equal(seeds[0], seeds[1])
    assert len(counts[1]) == 2 and counts[0] == counts[1]  # loss and accuracy: every sample once


@pytest.mark.slow
def test_auto_survives_a_real_allocator_failure() -> None:
    """A child under RLIMIT_DATA: the whole batch cannot be allocated (keras_oom_child.py)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(TESTS.parents[1] / "src"), str(TESTS.parent), str(TESTS)]
        ),
    }
    done = subprocess.run(
        [sys.executable, str(TESTS / "keras_oom_child.py"), "56"],  # MiB above what is in use
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["raised"] is None, result
    assert result["ceiling"] is not None and result["micro_batch_size"] < 16  # it did run out
    assert result["iterations"] == result["callback_steps"] == 2  # two fit steps, as without
    assert result["error_to_full_batch"] < 1e-10


@pytest.mark.usefixtures("float64")
def test_a_failed_step_leaves_model_optimizer_and_metrics_as_they_were(gen) -> None:
    fit = data("dense", N, gen)
    model, kwargs = dense(3, limit=3)
    model.compile(optimizer=OPTIMIZERS["adamw"](), **kwargs)
    bigbatch.keras.accumulate(model, 8)
    model.fit(fit["x"][:3], fit["y"][:3], batch_size=3, verbose=0)  # fits: builds everything
    before = [_numpy(v) for v in [*model.weights, *model.optimizer.variables]]
    metrics = [_numpy(v) for v in model.metrics_variables]
    batch = (torch.as_tensor(fit["x"][:10]), torch.as_tensor(fit["y"][:10]))
    with pytest.raises(torch.OutOfMemoryError, match="fits 3"):
        model.train_step(batch)  # what fit calls (fit itself resets the metrics first)
    after = [_numpy(v) for v in [*model.weights, *model.optimizer.variables]]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(
        np.array_equal(a, _numpy(b)) for a, b in zip(metrics, model.metrics_variables, strict=True)
    )
    assert all(v.value.grad is None for v in model.trainable_weights)


@pytest.mark.usefixtures("float64")
def test_accumulate_none_gives_back_keras_own_step(gen, tmp_path) -> None:
    fit = data("dense", N, gen)
    full = _fit(dense(4), "sgd", None, **fit)
    model, kwargs = dense(4)
    handle = bigbatch.keras.accumulate(model, 4)
    assert model.train_step is handle
    model.save(tmp_path / "model.keras")  # saving is unaffected; a loaded model is plain Keras
    assert "train_step" not in vars(keras.models.load_model(tmp_path / "model.keras"))
    assert bigbatch.keras.accumulate(model, None) is None
    assert "train_step" not in vars(model)
    assert bigbatch.keras.accumulate(model, None) is None  # undoing twice is harmless
    plain = _fit((model, kwargs), "sgd", None, **fit)
    assert weights_error(full["model"], plain["model"]) == 0.0


def test_batch_normalization_is_named_once(gen) -> None:
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.Input((8,)), keras.layers.BatchNormalization(name="bn")])
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), inner])
    model.compile(optimizer="sgd", loss="mse")
    bigbatch.keras.accumulate(model, 4)
    x, y = torch.randn(10, 6, generator=gen), torch.randn(10, 8, generator=gen)
    with pytest.warns(bigbatch.BigBatchWarning, match=r"BatchNormalization layers \['bn'\]"):
        model.fit(x, y, batch_size=10, epochs=2, verbose=0)
    inner.layers[0].trainable = False  # frozen: inference statistics, exact
    model.compile(optimizer="sgd", loss="mse")
    handle = bigbatch.keras.accumulate(model, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", bigbatch.BigBatchWarning)
        model.fit(x, y, batch_size=10, verbose=0)
    assert handle.last.micro_batches == 3


def test_bad_arguments_are_named() -> None:
    model, kwargs = dense(0)
    with pytest.raises(ValueError, match=r"micro_batch_size=0 is not allowed: use a positive"):
        bigbatch.keras.accumulate(model, 0)
    with pytest.raises(TypeError, match=r"micro_batch_size='big' is not allowed.*None to undo"):
        bigbatch.keras.accumulate(model, "big")
    with pytest.raises(TypeError, match=r"micro_batch_size=True is not allowed"):
        bigbatch.keras.accumulate(model, True)
    with pytest.raises(TypeError, match=r"model is a Linear; accumulate needs a keras.Model"):
        bigbatch.keras.accumulate(torch.nn.Linear(2, 2), 4)

    class Custom(keras.Sequential):
        def train_step(self, data: Any) -> Any:
            return super().train_step(data)

    with pytest.raises(ValueError, match=r"Custom defines its own train_step, which accumulate"):
        bigbatch.keras.accumulate(Custom([keras.layers.Dense(2)]), 4)
    model.compile(optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2), **kwargs)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2; bigbatch.keras"):
        bigbatch.keras.accumulate(model, 4)
    model.compile(optimizer="sgd", jit_compile=True, **kwargs)
    with pytest.raises(ValueError, match=r"jit_compile=True is not supported"):
        bigbatch.keras.accumulate(model, 4)


class _DirectLoss(keras.losses.Loss):
    """A loss that skips Loss.call: bigbatch.keras cannot count what it divides by."""

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        return keras.ops.mean(keras.ops.square(y_pred - keras.ops.cast(y_true, y_pred.dtype)))


def test_losses_bigbatch_cannot_read_are_refused(gen) -> None:
    fit = data("dense", 4, gen)
    batch = (torch.as_tensor(fit["x"]).float(), torch.as_tensor(fit["y"])[:, None].float())
    for loss, error, message in [
        (keras.losses.MeanSquaredError(reduction=None), ValueError, r"reduction=None; fit needs"),
        (_DirectLoss(name="direct"), TypeError, r"'direct' \(_DirectLoss\) did not compute"),
    ]:
        model, _ = dense(0)
        model.compile(optimizer="sgd", loss=loss)
        bigbatch.keras.accumulate(model, 2)
        with pytest.raises(error, match=message):
            model.train_step(batch)
    del model._compile_loss._flat_losses  # as a Keras version without it would be
    with pytest.raises(RuntimeError, match=r"this Keras version is not supported"):
        model.train_step(batch)


def test_fit_without_compile_says_so(gen) -> None:
    model, _ = dense(0)
    bigbatch.keras.accumulate(model, 4)  # before compile is allowed
    fit = data("dense", 4, gen)
    with pytest.raises(RuntimeError, match=r"no optimizer: call model.compile"):
        model.train_step((torch.as_tensor(fit["x"]), torch.as_tensor(fit["y"])))


def test_import_without_keras_names_the_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "keras", None)  # `import keras` now fails as if absent
    monkeypatch.delitem(sys.modules, "bigbatch.keras")
    monkeypatch.delitem(sys.modules, "bigbatch.integrations.keras")
    with pytest.raises(ImportError, match=r'needs Keras 3: pip install "bigbatch\[keras\]"'):
        importlib.import_module("bigbatch.keras")


def test_import_with_another_backend_names_the_setting(monkeypatch) -> None:
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")  # wiring: which backend runs
    monkeypatch.delitem(sys.modules, "bigbatch.keras")
    monkeypatch.delitem(sys.modules, "bigbatch.integrations.keras")
    with pytest.raises(ImportError, match=r"runs on 'jax'.*set KERAS_BACKEND=torch"):
        importlib.import_module("bigbatch.keras")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", None])  # None: Keras' default, TensorFlow
def test_import_under_another_backend_says_what_to_set(backend: str | None, tmp_path) -> None:
    """A real other backend, in a fresh process (whether or not jax / tensorflow is installed)."""
    env = {**os.environ, "PYTHONPATH": str(TESTS.parents[1] / "src"), "KERAS_HOME": str(tmp_path)}
    env.pop("KERAS_BACKEND")
    env.update({"KERAS_BACKEND": backend} if backend else {})
    done = subprocess.run(
        [sys.executable, "-c", "import bigbatch.keras"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: bigbatch.keras needs Keras' torch backend")
    assert "set KERAS_BACKEND=torch" in last
    if backend:  # "runs on 'numpy'" or "failed to start its 'numpy' backend (no jax)"
        assert f"'{backend}'" in last


# ---------------------------------------------------------------- the plain PyTorch path


def _keras_ce(model: Any, batch: Any) -> tuple[torch.Tensor, int]:
    x, y = batch
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    return ce(y, model(x, training=True)), len(y)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_accumulator_trains_a_keras_model_exactly(optimizer: str, gen) -> None:
    """``bigbatch.Accumulator(keras_model, torch_optimizer)`` with a loss from keras.losses."""
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01),
    }[optimizer]
    models = [dense(5)[0], dense(5)[0]]
    opts = [make(m.parameters()) for m in models]
    acc = bigbatch.Accumulator(models[1], opts[1], micro_batch_size=4)
    for _ in range(3):
        fit = data("dense", 10, gen)
        batch = (torch.as_tensor(fit["x"]), torch.as_tensor(fit["y"]))
        full_batch_step(models[0], opts[0], _keras_ce, batch)
        assert acc.train_step(batch, _keras_ce).micro_batches == 3  # 4 + 4 + 2
    assert max_relative_error(models[0], models[1]) < 1e-10


@pytest.mark.usefixtures("float64")
def test_check_on_keras_models(gen) -> None:
    fit = data("dense", 10, gen)
    batch = (torch.as_tensor(fit["x"]), torch.as_tensor(fit["y"]))
    assert bigbatch.check(dense(6)[0], batch, _keras_ce, micro_batch_size=4).exact
    keras.utils.set_random_seed(6)
    with_bn = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization()]
        + [keras.layers.Dense(3)]
    )
    report = bigbatch.check(with_bn, batch, _keras_ce, micro_batch_size=4)
    assert not report.exact
    assert "batch-statistics" in [d.kind for d in report.diagnoses]


KERAS_TASK = """
import keras, torch
import bigbatch

def task():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    loss = lambda m, b: (ce(b[1], m(b[0], training=True)), len(b[1]))
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(12, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (12,)))
    return bigbatch.Task(model=model, train_data=data, loss_fn=loss)
"""


@pytest.mark.usefixtures("float64")
def test_cli_check_on_a_keras_task(tmp_path, capsys) -> None:
    """`bigbatch check module:task` with a Keras model (float64 throughout: see the fixture)."""
    from bigbatch.app.cli import main

    path = tmp_path / "keras_task.py"
    path.write_text(KERAS_TASK)
    assert main(["check", f"{path}:task", "--batch-size", "10"]) == 0
    assert "exact: max relative difference" in capsys.readouterr().out


def test_check_on_a_float32_keras_model_needs_a_float32_tolerance(gen) -> None:
    """Keras computes float32 matmuls even on float64 copies: ~1e-7 apart, exact at 1e-5."""
    fit = data("dense", 10, gen)
    batch = (torch.as_tensor(fit["x"]).float(), torch.as_tensor(fit["y"]))
    report = bigbatch.check(dense(7)[0], batch, _keras_ce, micro_batch_size=4, tolerance=1e-5)
    assert report.exact, report.summary()


@pytest.mark.slow
def test_the_example_runs() -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS.parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    done = forks.run([str(TESTS.parents[1] / "examples" / "keras_fit.py")], env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal to the full batch" in done.stdout

"""Keras 3 ``model.fit`` with one exact optimizer step per fit batch, cut into micro-batches.

Needs Keras 3 running on PyTorch (``pip install "bigbatch[keras]"``, ``KERAS_BACKEND=torch``)::

    import bigbatch.keras
    bigbatch.keras.accumulate(model, micro_batch_size=64)   # or "auto"
    model.fit(x, y, batch_size=1024)   # each step: one exact optimizer step over 1,024 samples
    bigbatch.keras.accumulate(model, None)                   # undo

Note [keras train step]
    Keras' torch backend runs every ``fit`` step as ``model.train_step(data)``, looked up on the
    model at each step (``TorchTrainer.make_train_function``). ``accumulate`` sets that
    attribute on the model *instance* (the class is untouched; ``accumulate(model, None)``
    deletes it), so ``fit``, its data adapters, callbacks, progress bar and history run as
    they always do. The step is ``bigbatch.Accumulator.train_step`` over the Keras model (a
    ``torch.nn.Module`` on this backend): the engine's window runner cuts and sizes the batch,
    redoes it smaller after running out of memory, and puts back what a failed window changed,
    here also the Keras state a forward moves (BatchNorm statistics, seed generators, metric
    totals: ``Accumulator.track``). Each micro-batch's loss is Keras' own, handed over as named
    terms (Note [keras loss terms]), and updates the compiled metrics. The optimizer the engine
    steps stands for ``model.optimizer``: its ``step`` is one ``model.optimizer.apply``, so the
    iteration counter, learning-rate schedule, clipping and EMA act once per fit step and
    callbacks see one step; the backward goes through ``model.optimizer.scale_loss``
    (``LossScaleOptimizer``), and non-finite gradients are left to the Keras optimizer, as in
    Keras' own step.

Note [keras loss terms]
    Keras reduces each compiled loss term k to ``v_k = S_k / D_k``: the weighted sum of its
    per-item losses over the batch divided by a divisor that its ``reduction`` chooses: the
    number of items (``"sum_over_batch_size"``, ``"mean"``; the number of *unmasked* items when
    ``y_pred`` or the loss's values carry a Keras mask), the sum of the sample weights
    (``"mean_with_sample_weight"``), or 1 (``"sum"``). The full-batch loss is
    ``L = Σ_k w_k S_k / D_k + R``, ``w_k`` its ``loss_weights`` and ``R`` the model's own losses
    (weight and activity regularisers, ``add_loss``, a ``compute_loss`` of the user's), which
    Keras keeps as per-sample means or constants.

    Micro-batch ``i`` (``n_i`` of the window's ``N`` samples) gives the engine named terms
    (Note [named terms] in ``bigbatch.core.loss``), which it totals over the window before dividing:

    * a term whose divisor grows with the samples (no mask, and no ``"mean_with_sample_weight"``
      with sample weights: ``D_{k,i} = q_k n_i``, ``q_k`` the items per sample, the same in every
      micro-batch cut from one batch) stays in Keras' total ``T_i``, and so does a ``"sum"``
      term, multiplied by ``N / n_i``. ``T_i`` (with ``R_i``) is the per-sample term
      ``"loss": (T_i n_i, n_i)``: ``Σ_i T_i n_i / N = Σ_k w_k S_k / D_k + R``;
    * a term whose divisor depends on the data (a mask, or sample weights it divides by) is a
      term of its own, ``(v_{k,i} D_{k,i}, D_{k,i}, w_k)``, and adds 0 to ``T_i``.

    One term needs nothing before the window. A data-dependent divisor beside other terms needs
    its total before the first backward, which the engine counts in a pass without gradients
    (``bigbatch.keras`` puts back what that pass's forwards move). ``D_{k,i}`` is counted by
    Keras' own code: the term is reduced again, without gradients, with every per-item loss
    replaced by 1 and the reduction set to ``"sum"`` (``divisor``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from bigbatch.core._precision import Precision
from bigbatch.core._sizing import AutoState, Sizing
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.engine import Accumulator
from bigbatch.core.loss import Term
from bigbatch.core.split import batch_size

__all__ = ["Accumulation", "StepInfo", "accumulate"]


def _import_keras() -> Any:
    """Keras 3 on the torch backend, or an ImportError saying in one line what to do."""
    setting = (
        f"KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}: set KERAS_BACKEND=torch before "
        "keras is first imported"
    )
    try:
        import keras
    except ModuleNotFoundError as exc:
        if exc.name == "keras":
            raise ImportError(
                'bigbatch.keras needs Keras 3: pip install "bigbatch[keras]" and set '
                "KERAS_BACKEND=torch."
            ) from None
        raise ImportError(  # Keras is there; the backend it was asked for is not
            f"bigbatch.keras needs Keras' torch backend, which failed to start ({exc}; {setting})."
        ) from exc
    for wrong, needs in (
        (
            not keras.__version__.startswith("3."),
            f'Keras 3, found {keras.__version__}: pip install "bigbatch[keras]".',
        ),
        (
            keras.backend.backend() != "torch",
            f"Keras' torch backend, but Keras runs on {keras.backend.backend()!r} ({setting}).",
        ),
    ):
        if wrong:
            raise ImportError(f"bigbatch.keras needs {needs}")
    return keras


_keras = _import_keras()


@dataclass(frozen=True)
class StepInfo:
    """How the last ``fit`` step was computed.

    Attributes:
        samples: samples in the fit batch.
        micro_batches: micro-batches it was cut into.
        micro_batch_size: samples per micro-batch (the last may be smaller).
        oom_retries: windows redone at a smaller micro-batch after running out of memory.
        counted: ``True`` when a pass without gradients counted a data-dependent loss divisor
            before the window (a mask beside another loss term: Note [keras loss terms]).
    """

    samples: int
    micro_batches: int
    micro_batch_size: int
    oom_retries: int = 0
    counted: bool = False


class _Optimizer:
    """``model.optimizer`` as the engine steps it (Note [keras train step])."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [{"params": [v.value for v in self.model.trainable_variables]}]

    def step(self) -> None:
        variables = self.model.trainable_variables
        with torch.no_grad():
            self.model.optimizer.apply([v.value.grad for v in variables], variables)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=True)


class Accumulation:
    """The ``train_step`` that ``accumulate`` puts on a Keras model (Note [keras train step]).

    Attributes:
        model: the Keras model.
        micro_batch_size: samples per micro-batch, or ``"auto"``.
        accumulator: the ``bigbatch.Accumulator`` running the steps (built at the first step).
        last: the last step's ``StepInfo`` (``None`` before the first step).
    """

    def __init__(self, model: Any, micro_batch_size: int | str) -> None:
        self.model, self.micro_batch_size = model, micro_batch_size
        self.accumulator: Accumulator | None = None
        self.last: StepInfo | None = None
        # N: samples in the fit step being computed; the engine ran a count pass in this step;
        # warned about BatchNormalization (once)
        self._samples, self._counted, self._warned = 0, False, False

    @property
    def auto_state(self) -> AutoState | None:
        """Where ``"auto"``'s search stands (``None`` for a fixed size or before the first step)."""
        if self.accumulator is None or self.micro_batch_size != "auto":
            return None
        sizing = self.accumulator.state_dict()["sizing"]
        return AutoState(**{k: v for k, v in sizing.items() if k not in ("policy", "name")})

    def __call__(self, data: Any) -> dict[str, Any]:
        """One ``fit`` step over the whole batch ``data`` (Note [keras train step])."""
        model = self.model
        _check_compiled(model)
        if not model.trainable_weights:  # nothing to accumulate: Keras' own step (it warns)
            return type(model).train_step(model, data)
        batch = tuple(_keras.utils.unpack_x_y_sample_weight(data))  # (x, y, sample_weight)
        self._samples, self._counted = batch_size(batch), False
        if self.accumulator is None:
            self.accumulator = self._build()
        model.zero_grad(set_to_none=True)  # as Keras' own step: leftovers are not this step's
        result = self.accumulator.train_step(batch, self._loss)
        # Keras updated its per-output loss trackers on every micro-batch with what each term
        # returned, weighted by its samples: right for the terms left in its total, 0 for the
        # data-dependent ones, whose value Σ S / Σ D is known only after the window
        # (Note [keras loss terms]): those get their window values here.
        trackers = model._compile_loss.metrics  # one per compiled term when there are several
        for name, value in result.terms.items():
            if name != "loss" and len(trackers) > (k := int(name[len("loss_") :])):
                trackers[k].total.assign_add(value * self._samples)
        model._loss_tracker.update_state(result.loss, sample_weight=self._samples)
        self.last = StepInfo(
            self._samples,
            result.micro_batches,
            int(result.micro_batch_size or 0),
            result.oom_retries,
            self._counted,
        )
        return model.get_metrics_result()  # type: ignore[no-any-return]

    def _build(self) -> Accumulator:
        model = self.model
        _warn_float32_matmuls(model)
        # Keras casts inside its layers, and a LossScaleOptimizer scales the loss and unscales
        # and checks the gradients in apply: the engine only back-propagates through scale_loss.
        precision: Any = Precision("fp32", "cpu")  # no autocast, no scaler: the device is moot
        precision.name = "keras"
        precision.backward = lambda loss: model.optimizer.scale_loss(loss).backward()
        opt: Any = _Optimizer(model)  # duck-typed
        acc = Accumulator(model, opt, self.micro_batch_size, precision=precision, nonfinite="apply")
        acc.track(self._state)
        return acc

    def _state(self) -> list[torch.Tensor]:
        """What a forward moves besides the weights: BatchNorm statistics, seeds, metric totals."""
        return [v.value for v in self.model.non_trainable_variables + self.model.metrics_variables]

    def _loss(self, model: Any, batch: Any) -> dict[str, Any]:
        """``loss_fn`` for the engine: one micro-batch's terms (Note [keras loss terms])."""
        (x, y, sample_weight), n, counting = batch, batch_size(batch), not torch.is_grad_enabled()
        self._counted |= counting  # the engine's count pass (it puts the state back)
        if n < self._samples and not self._warned:  # cut in several pieces: see BatchNorm
            _warn_batch_norm(model)
            self._warned = True
        y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
        record = Recording(n, self._samples)
        with recording(model, record, y, y_pred, sample_weight):
            total = model._compute_loss(x, y, y_pred, sample_weight, training=True)
        if not counting:
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        overrides = type(model).compute_loss is not _keras.Model.compute_loss  # its own terms
        own = record.folded or model.losses or overrides or not record.data
        terms: dict[str, Any] = {"loss": (total * n, n)} if own else {}
        return terms | {f"loss_{k}": term for k, term in record.data.items()}


def accumulate(model: Any, micro_batch_size: int | str | None = 64) -> Accumulation | None:
    """Make each ``model.fit`` step one exact optimizer step over the whole fit batch.

    Inside every ``fit`` step ``bigbatch.Accumulator`` cuts the batch into micro-batches of
    ``micro_batch_size`` and back-propagates each one's part of the full-batch loss (Keras' own
    loss, with ``sample_weight``, ``class_weight``, Keras masks, each loss's reduction and the
    model's own losses: Note [keras loss terms]); the compiled metrics are updated on every
    sample, and the Keras optimizer applies the gradient once. The parameters after ``fit`` equal
    those of ``fit`` with the whole batch in one piece, up to rounding.

    Args:
        model: a Keras 3 ``Model`` (torch backend), compiled before or after this call.
        micro_batch_size: samples per micro-batch; ``"auto"`` for the largest that fits (the
            first step runs whole, an out-of-memory error halves it and redoes the step, and
            after 10 clean steps it probes a larger one: Note [auto micro-batch]); ``None`` to
            undo a previous ``accumulate``.

    Returns:
        The ``Accumulation`` now acting as ``model.train_step`` (its ``last`` attribute tells
        how the last step was cut), or ``None`` after undoing.

    Raises:
        TypeError: ``model`` is not a Keras model, or ``micro_batch_size`` is not an int,
            ``"auto"`` or ``None``.
        ValueError: ``micro_batch_size`` is not positive; the model's class defines its own
            ``train_step``; the model compiles with ``jit_compile=True`` or an optimizer with
            ``gradient_accumulation_steps``.

    Example:
        >>> model.compile(optimizer="adamw", loss="sparse_categorical_crossentropy")  # doctest: +SKIP
        >>> bigbatch.keras.accumulate(model, micro_batch_size=64)  # doctest: +SKIP
        >>> model.fit(x, y, batch_size=1024)  # one optimizer step per 1,024 samples  # doctest: +SKIP
    """
    if not isinstance(model, _keras.Model):
        raise TypeError(
            f"model is a {type(model).__name__}; accumulate needs a keras.Model (for a plain "
            "torch.nn.Module use bigbatch.Accumulator)."
        )
    if micro_batch_size is None:
        if isinstance(vars(model).get("train_step"), Accumulation):
            del model.train_step
        return None
    try:
        Sizing(micro_batch_size)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} Or None to undo accumulate.") from None
    owner = next(c for c in type(model).__mro__ if "train_step" in vars(c))
    if not owner.__module__.startswith("keras."):  # accumulate would silently replace it
        raise ValueError(
            f"{owner.__name__} defines its own train_step, which accumulate would replace: put "
            "custom loss terms in compute_loss (honoured), or use bigbatch.Accumulator instead."
        )
    if getattr(model, "optimizer", None) is not None:
        _check_compiled(model)
    model.train_step = step = Accumulation(model, micro_batch_size)  # Note [keras train step]
    model.train_function = None  # built again on the next fit
    return step


def _check_compiled(model: Any) -> None:
    optimizer = getattr(model, "optimizer", None)
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    for wrong, error, message in (
        (
            optimizer is None,
            RuntimeError,
            "the model has no optimizer: call model.compile(optimizer=..., loss=...) before fit.",
        ),
        (
            bool(steps),
            ValueError,
            f"the optimizer has gradient_accumulation_steps={steps}; "
            "bigbatch.keras.accumulate already makes each fit step one step over the whole batch: "
            "compile without gradient_accumulation_steps; pass the whole batch as fit's batch_size.",
        ),
        (
            getattr(model, "jit_compile", False) is True,
            ValueError,
            "jit_compile=True is not "
            "supported with bigbatch.keras.accumulate (the step loops over micro-batches in Python): "
            "model.compile(..., jit_compile=False).",
        ),
    ):
        if wrong:
            raise error(message)


def _warn_batch_norm(model: Any) -> None:
    """One BigBatchWarning naming the trainable BatchNormalization layers, if there are any."""
    norms = _keras.layers.BatchNormalization
    layers = model._flatten_layers(include_self=False)  # nested models too
    found = [layer.name for layer in layers if isinstance(layer, norms) and layer.trainable]
    if found:
        _warn(
            f"BatchNormalization layers {found} normalise each micro-batch with its own batch "
            "statistics, so a step is not exactly the full batch's: freeze them (layer.trainable "
            "= False) or use keras.layers.GroupNormalization / LayerNormalization."
        )


def _warn_float32_matmuls(model: Any) -> None:
    """Say that float64 weights do not make Keras compute in float64 (issue 21, 4b)."""
    wide = any(w.dtype == "float64" for w in model.weights)
    if wide and _keras.backend.result_type("float64", "float64") != "float64":
        _warn(
            "the model's weights are float64, but Keras computes float64 layers in float32 "
            "(keras.backend.result_type('float64', 'float64') is 'float32'), its own full-batch "
            "fit too: fit with accumulate agrees with it to ~1e-7, not 1e-16 (docs/keras.md)."
        )


def _warn(message: str) -> None:
    warnings.warn(message, BigBatchWarning, stacklevel=3)  # where the step asked for it


MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


@dataclass
class Recording:
    """One micro-batch's compiled terms, as seen while Keras computes its loss.

    Attributes:
        samples: ``n_i``, samples in the micro-batch.
        window_samples: ``N``, samples in the window.
        data: the terms whose divisor depends on the data, by their index in the compiled loss.
        folded: how many compiled terms stayed in Keras' total.
    """

    samples: int
    window_samples: int
    data: dict[int, Term] = field(default_factory=dict)
    folded: int = 0


class _Term:
    """Stands in for one compiled loss term while a micro-batch's loss is computed."""

    def __init__(self, loss: Any, index: int, weight: float | None, record: Recording) -> None:
        self.loss, self.index, self.record = loss, index, record
        self.weight = 1.0 if weight is None else float(weight)

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        seen, real_call = list[Any](), self.loss.call

        def recording_call(y_t: Any, y_p: Any) -> Any:
            seen.append(real_call(y_t, y_p))
            return seen[-1]

        with _calling(self.loss, recording_call):
            value = self.loss(y_true, y_pred, sample_weight)
        if len(seen) != 1:
            raise TypeError(
                f"loss {getattr(self.loss, 'name', self.loss)!r} ({type(self.loss).__name__}) did "
                "not compute its per-item losses through Loss.call, so bigbatch.keras cannot tell "
                "what Keras divides them by: implement call(y_true, y_pred) instead of __call__."
            )
        record, kind = self.record, _kind(self.loss, seen[0], y_pred, sample_weight)
        if kind == "data":
            d = divisor(self.loss, seen[0], y_true, y_pred, sample_weight)
            record.data[self.index] = Term(value * d, d, self.weight)
            return value * 0.0
        record.folded += 1
        return value * (record.window_samples / record.samples) if kind == "sum" else value

    def __getattr__(self, name: str) -> Any:  # name, reduction, ... as the loss it stands for
        return getattr(self.loss, name)


def _kind(loss: Any, values: Any, y_pred: Any, sample_weight: Any) -> str:
    """``"sum"``, ``"sample"`` (divisor proportional to the samples) or ``"data"``."""
    reduction = getattr(loss, "reduction", None)
    if reduction == "sum":
        return "sum"
    if reduction not in MEAN_REDUCTIONS:
        raise ValueError(
            f"loss {getattr(loss, 'name', loss)!r} has reduction={reduction!r}; fit needs a "
            'scalar loss: compile with reduction="sum_over_batch_size" (the default), "mean", '
            '"mean_with_sample_weight" or "sum".'
        )
    masked = _mask(y_pred) is not None or _mask(values) is not None
    weighted = reduction == "mean_with_sample_weight" and sample_weight is not None
    return "data" if masked or weighted else "sample"


def divisor(loss: Any, values: Any, y_true: Any, y_pred: Any, sample_weight: Any) -> torch.Tensor:
    """What Keras divided ``loss``'s weighted sum by, as a float64 0-dim tensor (no host sync).

    ``values`` are the per-item losses that ``loss.call`` returned for this batch. Keras' own
    ``loss.__call__`` runs again with them replaced by ones and ``reduction="sum"``, without
    gradients: it applies the same masks (``y_pred``'s and the values' own) and, for
    ``"mean_with_sample_weight"``, the same sample weights, and so counts its divisor. ``y_pred``
    is passed as a one-element stand-in carrying its mask (no copy of the logits is made).
    """
    ones, stand_in = torch.ones_like(values), values.new_zeros(1)
    for source, target in ((values, ones), (y_pred, stand_in)):  # a loss may mask its own values
        if _mask(source) is not None:
            target._keras_mask = _mask(source)  # type: ignore[union-attr]
    weight = sample_weight if loss.reduction == "mean_with_sample_weight" else None
    if isinstance(weight, torch.Tensor):  # Keras multiplies the mask into it in place
        weight = weight.clone()
    with _calling(loss, lambda y_t, y_p: ones, "sum"), torch.no_grad():
        return torch.as_tensor(loss(y_true, stand_in, weight)).to(torch.float64)


def _mask(tensor: Any) -> Any:
    return getattr(tensor, "_keras_mask", None)  # where Keras keeps a tensor's mask on torch


@contextlib.contextmanager
def _calling(loss: Any, call: Any, reduction: Any = None) -> Iterator[None]:
    """``loss.call`` (and ``loss.reduction`` when given) replaced on the instance for the block."""
    own_call, own_reduction = vars(loss).get("call"), loss.reduction
    loss.call, loss.reduction = call, reduction or own_reduction
    try:
        yield
    finally:
        loss.reduction = own_reduction
        del loss.call  # ours; then the instance's own, if it had one
        if own_call is not None:
            loss.call = own_call


@contextlib.contextmanager
def recording(model: Any, record: Recording, y: Any, y_pred: Any, weight: Any) -> Iterator[None]:
    """Within the block the model's compiled loss fills ``record`` (Note [keras loss terms]).

    The compiled loss is built first if it is not (Keras builds it on its first call), without
    recording anything; a model compiled without a loss is left as it is.
    """
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None:
        yield
        return
    if not compiled.built:
        with torch.no_grad():
            compiled(y, y_pred, weight)
        for metric in compiled.metrics:  # per-output loss trackers created just now by build
            metric.reset_state()
    entries = getattr(compiled, "_flat_losses", None)
    if entries is None:
        raise RuntimeError(
            "bigbatch.keras found no model._compile_loss._flat_losses: this Keras version is "
            'not supported; pip install "bigbatch[keras]" for a tested one.'
        )
    original = list(entries)
    entries[:] = [
        e._replace(loss=_Term(e.loss, k, e.loss_weights, record)) for k, e in enumerate(original)
    ]
    try:
        yield
    finally:
        entries[:] = original

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
    they always do. The step cuts the batch with ``bigbatch.core.split``, back-propagates each
    micro-batch's share of the full-batch loss (Note [keras loss shares] in
    ``bigbatch.integrations._keras_loss``), updates the compiled metrics on every micro-batch, and calls
    ``model.optimizer.apply`` once: its iteration counter, learning-rate schedule, clipping
    and EMA act once per fit step, and callbacks see one step.

    Before each window the model's changing state (BatchNorm statistics, seed generators,
    metrics) and the RNG are saved, and put back when the window fails or is redone: a failed
    step leaves the model and the optimizer as they were, and with ``"auto"`` an out-of-memory
    error redoes the window at a smaller micro-batch (Note [auto micro-batch] in
    ``bigbatch.core._auto``).
"""

from __future__ import annotations

import inspect
import os
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.core import _auto as auto
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.oom import is_out_of_memory, release_memory
from bigbatch.core.split import batch_size, split
from bigbatch.integrations._keras_loss import Divisors, ensure_built, shares

__all__ = ["Accumulation", "StepInfo", "accumulate"]


def _import_keras() -> Any:
    """Keras 3 on the torch backend, or an ImportError saying in one line what to do."""
    try:
        import keras
    except ModuleNotFoundError as exc:
        if exc.name != "keras":  # Keras is there; the backend it was asked for is not
            backend = os.environ.get("KERAS_BACKEND", "default")
            raise ImportError(
                f"bigbatch.keras needs Keras' torch backend, but Keras failed to start its "
                f"{backend!r} backend ({exc}): set KERAS_BACKEND=torch before keras is first "
                "imported."
            ) from exc
        raise ImportError(
            'bigbatch.keras needs Keras 3: pip install "bigbatch[keras]" and set '
            "KERAS_BACKEND=torch."
        ) from None
    version = getattr(keras, "__version__", "0")
    if int(version.split(".")[0]) < 3:
        raise ImportError(
            f'bigbatch.keras needs Keras 3, found Keras {version}: pip install "bigbatch[keras]".'
        )
    backend = keras.backend.backend()
    if backend != "torch":
        raise ImportError(
            f"bigbatch.keras needs Keras' torch backend, but Keras runs on {backend!r} "
            f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}): set KERAS_BACKEND=torch "
            "before keras is first imported."
        )
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
        redone: ``True`` when the window was computed twice because a loss divisor depended
            on the data in a way one pass could not settle (Note [keras loss shares]).
    """

    samples: int
    micro_batches: int
    micro_batch_size: int
    oom_retries: int = 0
    redone: bool = False


@dataclass
class _Window:
    loss: torch.Tensor
    logs: dict[str, Any]
    micro_batches: int
    divisors: dict[int, float]  # each term's measured divisor D_k (Note [keras loss shares])
    missed: dict[int, tuple[float, float]]
    rescalable: bool


class Accumulation:
    """The ``train_step`` that ``accumulate`` puts on a Keras model; holds the sizing state.

    Attributes:
        model: the Keras model.
        micro_batch_size: samples per micro-batch, or ``"auto"``.
        auto_state: the automatic sizing search (``None`` for a fixed size).
        last: the last step's ``StepInfo`` (``None`` before the first step).
    """

    def __init__(self, model: Any, micro_batch_size: int | str) -> None:
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.auto_state = auto.AutoState() if micro_batch_size == "auto" else None
        self.last: StepInfo | None = None
        self._changing: set[int] | None = None  # ids of state seen changing; None: not known
        self._layers_checked = False  # warn once about BatchNormalization

    def __call__(self, data: Any) -> dict[str, Any]:
        """One ``fit`` step over the whole batch ``data`` (Note [keras train step])."""
        model = self.model
        _check_compiled(model)
        x, y, sample_weight = _keras.utils.unpack_x_y_sample_weight(data)
        batch = (x, y, sample_weight)
        n = batch_size(batch)
        saved = _Saved(model, self._changing)
        window, size, retries, redone = self._settle(batch, n, saved)
        self._changing = (self._changing or set()) | saved.changed()
        try:
            logs = self._apply(window, n)
        except BaseException:
            saved.restore()
            raise
        if self.auto_state is not None:
            self.auto_state = auto.after_success(self.auto_state, size, n)
        self.last = StepInfo(n, window.micro_batches, size, retries, redone)
        return logs

    def _settle(self, batch: Any, n: int, saved: _Saved) -> tuple[_Window, int, int, bool]:
        """Run the window until it completes: ``(window, size, oom_retries, redone)``.

        An out-of-memory error with ``"auto"`` redoes it smaller; a mispredicted divisor that
        rescaling cannot fix redoes it once with the measured divisors (Note [keras loss
        shares]); each redo starts from the state ``saved`` holds.
        """
        retries, known = 0, None
        while True:
            size, failed = self._size_for(n), None
            try:
                window = self._window(batch, n, size, known)
            except BaseException as exc:
                saved.restore()
                if self.auto_state is None or not is_out_of_memory(exc):
                    raise
                traceback.clear_frames(exc.__traceback__)  # unpin the failed window's tensors
                failed = size
            if failed is not None:  # retried outside the except: the exception pins tensors
                release_memory(_device_of(self.model))
                self.auto_state = auto.after_oom(self.auto_state, failed)  # type: ignore[arg-type]
                retries += 1
            elif not window.missed or window.rescalable or known is not None:
                # (a redone window used measured divisors: a second miss could only come from
                # masks that change between passes, and is not redone again)
                return window, size, retries, known is not None
            else:
                saved.restore()
                known = window.divisors

    def _size_for(self, n: int) -> int:
        if self.auto_state is not None:
            return auto.size_for(self.auto_state, n)
        return min(int(self.micro_batch_size), n)

    def _window(self, batch: Any, n: int, size: int, known: dict[int, float] | None) -> _Window:
        """Back-propagate every micro-batch's share of the full-batch loss; update metrics."""
        model, divisors = self.model, Divisors(samples=n, known=known)
        model.zero_grad(set_to_none=True)
        pieces = split(batch, size)
        if len(pieces) > 1 and not self._layers_checked:  # one piece is the full batch: exact
            _warn_batch_norm(model)
            self._layers_checked = True
        loss_sum: Any = 0.0
        logs: dict[str, Any] = {}
        terms, extra = 0, _overrides_compute_loss(model)
        for x, y, sample_weight in pieces:
            divisors.micro_samples = n_i = batch_size((x, y, sample_weight))
            y_pred = model(x, training=True) if _has_training_arg(model) else model(x)
            ensure_built(model, y, y_pred, sample_weight)
            extra = extra or bool(model.losses)
            with shares(model, divisors) as count:
                terms = count
                share = _compute_loss(model, x, y, y_pred, sample_weight) * (n_i / n)
            if model.trainable_weights:
                model.optimizer.scale_loss(share).backward()
            loss_sum = loss_sum + share.detach()
            logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        missed = divisors.missed()
        rescalable = terms == 1 and not extra and all(p > 0 for p, _ in missed.values())
        return _Window(loss_sum, logs, len(pieces), dict(divisors.seen), missed, rescalable)

    def _apply(self, window: _Window, n: int) -> dict[str, Any]:
        """Fix a mispredicted single divisor, step the Keras optimizer once, record the loss."""
        model, loss = self.model, window.loss
        trainable = model.trainable_weights[:]
        grads = [v.value.grad for v in trainable]
        for predicted, seen in window.missed.values():  # one term at most (rescalable)
            with torch.no_grad():
                for g in grads:
                    if g is not None:
                        g.mul_(predicted / seen)
            loss = loss * (predicted / seen)
        if trainable:
            with torch.no_grad():
                model.optimizer.apply(grads, trainable)
        else:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        model.zero_grad(set_to_none=True)
        tracker = getattr(model, "_loss_tracker", None)  # the "loss" that fit reports
        if tracker is not None:
            tracker.update_state(loss, sample_weight=n)
        return {**window.logs, **model.get_metrics_result()}


def accumulate(model: Any, micro_batch_size: int | str | None = 64) -> Accumulation | None:
    """Make each ``model.fit`` step one exact optimizer step over the whole fit batch.

    Inside every ``fit`` step the batch is cut into micro-batches of ``micro_batch_size``; each
    back-propagates its share of the full-batch loss (honouring ``sample_weight``,
    ``class_weight``, Keras masks, each loss's reduction and the model's own losses), the
    compiled metrics are updated on every sample, and the Keras optimizer applies the summed
    gradient once. The parameters after ``fit`` equal those of ``fit`` with the whole batch in
    one piece, up to rounding (see Note [keras loss shares] in ``bigbatch.integrations._keras_loss``).

    Args:
        model: a Keras 3 ``Model`` (torch backend), compiled before or after this call.
        micro_batch_size: samples per micro-batch; ``"auto"`` for the largest that fits (the
            first step runs whole, an out-of-memory error halves it and redoes the step);
            ``None`` to undo a previous ``accumulate``.

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
    _check_micro_batch_size(micro_batch_size)
    _check_own_train_step(model)
    if getattr(model, "optimizer", None) is not None:
        _check_compiled(model)
    step = Accumulation(model, micro_batch_size)
    model.train_step = step  # Note [keras train step]
    model.train_function = None  # built again on the next fit
    return step


def _check_micro_batch_size(value: object) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f'micro_batch_size={value!r} is not allowed: use a positive integer, "auto", or '
            "None to undo (e.g. micro_batch_size=64)."
        )
    if value <= 0:
        raise ValueError(
            f'micro_batch_size={value} is not allowed: use a positive integer, "auto", or None '
            "to undo (e.g. micro_batch_size=64)."
        )


def _check_own_train_step(model: Any) -> None:
    """Refuse a model class with its own ``train_step``: accumulate would silently replace it."""
    owner = next(c for c in type(model).__mro__ if "train_step" in vars(c))
    if not owner.__module__.startswith("keras."):
        raise ValueError(
            f"{owner.__name__} defines its own train_step, which accumulate would replace: keep "
            "Keras' train_step and put custom loss terms in compute_loss (bigbatch.keras honours "
            "it), or accumulate in your own loop with bigbatch.Accumulator."
        )


def _check_compiled(model: Any) -> None:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise RuntimeError(
            "the model has no optimizer: call model.compile(optimizer=..., loss=...) before fit."
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            f"the optimizer has gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}; bigbatch.keras.accumulate already makes "
            "each fit step one step over the whole batch: compile without "
            "gradient_accumulation_steps and pass the whole batch as fit's batch_size."
        )
    if getattr(model, "jit_compile", False) is True:
        raise ValueError(
            "jit_compile=True is not supported with bigbatch.keras.accumulate (the step loops "
            "over micro-batches in Python): model.compile(..., jit_compile=False)."
        )


def _warn_batch_norm(model: Any) -> None:
    """One BigBatchWarning naming the trainable BatchNormalization layers, if there are any."""
    found, todo = [], list(model.layers)
    while todo:
        layer = todo.pop(0)
        todo += list(getattr(layer, "layers", []))  # nested models
        if isinstance(layer, _keras.layers.BatchNormalization) and layer.trainable:
            found.append(layer.name)
    if found:
        warnings.warn(
            f"BatchNormalization layers {found} normalise each micro-batch with its own batch "
            "statistics, so a step is not exactly the full batch's: freeze them "
            "(layer.trainable = False) or use keras.layers.GroupNormalization / "
            "LayerNormalization for exact accumulation.",
            BigBatchWarning,
            stacklevel=4,
        )


def _has_training_arg(model: Any) -> bool:
    return bool(getattr(model, "_call_has_training_arg", True))


def _overrides_compute_loss(model: Any) -> bool:
    """A ``compute_loss`` of the user's may add terms bigbatch cannot see (no rescaling then)."""
    return type(model).compute_loss is not _keras.Model.compute_loss


def _compute_loss(model: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """``model.compute_loss`` with ``training=True`` where its signature takes it (as Keras)."""
    if "training" in inspect.signature(model.compute_loss).parameters:
        return model.compute_loss(x, y, y_pred, sample_weight, training=True)
    return model.compute_loss(x, y, y_pred, sample_weight)


def _device_of(model: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class _Saved:
    """The model state a window changes: put back when it fails or is redone.

    Saves the non-trainable variables (BatchNorm statistics, seed generators, metric totals)
    and the torch RNG. ``changing`` narrows the copies to the variables seen changing in an
    earlier step (a frozen backbone is not copied at every step).
    """

    def __init__(self, model: Any, changing: set[int] | None) -> None:
        self.model = model
        variables = {id(v): v for v in [*model.non_trainable_variables, *model.metrics_variables]}
        self.versions = {i: v.value._version for i, v in variables.items()}
        self.variables = variables
        self.values = {
            i: v.value.detach().clone()
            for i, v in variables.items()
            if changing is None or i in changing
        }
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for i, value in self.values.items():
                self.variables[i].value.copy_(value)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def changed(self) -> set[int]:
        """Ids of the saved variables whose value was written since they were saved."""
        return {i for i, v in self.variables.items() if v.value._version != self.versions[i]}

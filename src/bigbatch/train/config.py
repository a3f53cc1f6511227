"""``TrainConfig``: the trainer's settings, one frozen dataclass = CLI flags = TOML keys.

Every field is a ``bigbatch train`` flag (``micro_batch_size`` -> ``--micro-batch-size``) and a
key of a ``--config`` TOML file; the CLI overrides the file, the file overrides the defaults.

Note [batch arithmetic]
    ``batch_size`` is the effective batch, the samples one optimizer step averages over.
    ``micro_batch_size`` (m) and ``gradient_accumulation_steps`` (k) say how it is cut. Any two
    of the three determine the third: ``batch_size = m * k``; ``m = ceil(batch_size / k)``;
    ``k = ceil(batch_size / m)`` (the last micro-batch may be smaller, which stays exact). When
    all three are given they must agree. With ``micro_batch_size="auto"`` bigbatch picks m
    (and so k) itself, so ``gradient_accumulation_steps`` must not be given. Nothing given:
    ``batch_size=32`` in one piece.

Note [learning-rate scaling]
    ``lr`` is the learning rate at ``reference_batch_size``. With ``lr_scaling="linear"`` the
    rate used is ``lr * batch_size / reference_batch_size`` (Goyal et al., 2017: SGD);
    ``"sqrt"`` uses ``lr * sqrt(batch_size / reference_batch_size)`` (often better for Adam);
    ``"none"`` (the default) uses ``lr`` as given. Accumulation itself never changes the rate:
    the step at batch 256 cut 8 x 32 is the step at batch 256.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, fields
from typing import Any

from bigbatch.batchnorm import POLICIES as BATCHNORM_POLICIES

PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCALINGS = ("none", "linear", "sqrt")
LR_SCHEDULES = ("constant", "cosine")
BATCHNORMS = ("keep", *BATCHNORM_POLICIES)
DEFAULT_BATCH_SIZE = 32

# Fields that may change between a run and its resume (they do not change the result).
RESUMABLE_CHANGES = frozenset({"resume", "out", "save_every", "eval_every", "quiet"})


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``bigbatch train`` / ``bigbatch.fit`` can be told (see the module notes).

    Args:
        task: ``module:function`` (or ``file.py:function``) returning a ``bigbatch.Task``; used
            by the CLI and a TOML file, recorded in the run folder.
        batch_size: effective batch: samples per optimizer step (Note [batch arithmetic]).
        micro_batch_size: samples per forward/backward, or ``"auto"`` for the largest that fits.
        gradient_accumulation_steps: micro-batches per optimizer step.
        gradient_checkpointing: recompute the model's repeated blocks in backward.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        batchnorm: what the model's BatchNorm layers do, since a micro-batch's statistics are
            not the full batch's: ``"keep"`` (or ``None``; the default) leaves the model as it
            is and the engine warns; ``"micro"`` keeps per-micro-batch statistics (ghost
            batches) with the running statistics moved once per optimizer step; ``"freeze"``
            normalises with the running statistics (exact; for fine-tuning); ``"groupnorm"``
            replaces each BatchNorm with a GroupNorm (exact; per-sample). Applied before
            training by ``bigbatch.batchnorm(model, policy)``.
        max_grad_norm: clip the gradient's 2-norm to this; ``None`` to not clip.
        lr: learning rate at ``reference_batch_size`` (Note [learning-rate scaling]).
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"``.
        reference_batch_size: the batch size ``lr`` was tuned for (needed by a scaling).
        lr_schedule: ``"constant"`` or ``"cosine"`` (to 0 at the last step), after
            ``warmup_steps`` steps of linear warm-up. Ignored when the task brings a scheduler.
        warmup_steps: optimizer steps of linear warm-up from 0 to the rate.
        steps: optimizer steps to run (or give ``epochs``).
        epochs: passes over the training data (default 1 when ``steps`` is not given).
        memory_budget: cap on what a step may use, e.g. ``"6GiB"`` (with ``"auto"`` the
            micro-batch shrinks to stay under it).
        seed: seeds the model's randomness (dropout) and the data order.
        out: the run folder: ``metrics.csv``, ``snapshot.pt``, ``model.pt``, ``summary.json``.
        save_every: write a resume snapshot every N optimizer steps (0: only at the end of each
            epoch and of the run).
        resume: continue the run in ``out`` from its last snapshot.
        eval_every: evaluate on the task's eval data every N steps (0: only at the end).
        device: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available).
        shuffle: reshuffle the training data every epoch (seeded by ``seed`` and the epoch).
        quiet: no progress bar and no end-of-run table.
    """

    task: str | None = None
    batch_size: int | None = None
    micro_batch_size: int | str | None = None
    gradient_accumulation_steps: int | None = None
    gradient_checkpointing: bool = False
    precision: str = "fp32"
    batchnorm: str | None = "keep"
    max_grad_norm: float | None = None
    lr: float = 1e-3
    lr_scaling: str = "none"
    reference_batch_size: int | None = None
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    steps: int | None = None
    epochs: int | None = None
    memory_budget: str | int | None = None
    seed: int = 0
    out: str = "runs/bigbatch"
    save_every: int = 0
    resume: bool = False
    eval_every: int = 0
    device: str | None = None
    shuffle: bool = True
    quiet: bool = False

    def __post_init__(self) -> None:
        _check_choice("precision", self.precision, PRECISIONS)
        if self.batchnorm is None:  # the same run as "keep" (the resume identity compares these)
            object.__setattr__(self, "batchnorm", "keep")
        _check_choice("batchnorm", self.batchnorm, BATCHNORMS)
        _check_choice("lr_scaling", self.lr_scaling, LR_SCALINGS)
        _check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        for name in ("batch_size", "gradient_accumulation_steps", "steps", "epochs"):
            _check_positive_int(name, getattr(self, name))
        for name in ("save_every", "eval_every", "warmup_steps"):
            _check_positive_int(name, getattr(self, name), zero=True)
        if self.micro_batch_size != "auto":
            _check_positive_int("micro_batch_size", self.micro_batch_size, auto=True)
        if self.steps is not None and self.epochs is not None:
            raise ValueError(
                f"steps={self.steps} and epochs={self.epochs} are both given: choose one "
                "(--steps N runs N optimizer steps; --epochs N runs N passes over the data)."
            )
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr={self.lr!r} is not allowed: use a positive number, e.g. lr=3e-4.")
        if self.lr_scaling != "none" and self.reference_batch_size is None:
            raise ValueError(
                f"lr_scaling={self.lr_scaling!r} needs reference_batch_size, the batch size lr "
                "was tuned for: e.g. --reference-batch-size 256."
            )
        resolve_batch(self)  # contradictions are reported when the config is made

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what a TOML file holds)."""
        return dataclasses.asdict(self)


def resolve_batch(config: TrainConfig) -> tuple[int, int | str, int | None]:
    """``(batch_size, micro_batch_size, gradient_accumulation_steps)`` (Note [batch arithmetic]).

    ``gradient_accumulation_steps`` is ``None`` with ``micro_batch_size="auto"``.

    Raises:
        ValueError: the given values contradict each other.

    Example:
        >>> resolve_batch(TrainConfig(batch_size=10, micro_batch_size=4))
        (10, 4, 3)
    """
    k = config.gradient_accumulation_steps
    if config.micro_batch_size == "auto":
        if k is not None:
            raise ValueError(
                f"micro_batch_size='auto' chooses the accumulation steps itself: drop "
                f"gradient_accumulation_steps={k}, or give an integer micro_batch_size."
            )
        return (config.batch_size or DEFAULT_BATCH_SIZE), "auto", None
    given_m = int(config.micro_batch_size) if config.micro_batch_size is not None else None
    b = config.batch_size or (given_m or DEFAULT_BATCH_SIZE) * (k or 1)
    m = min(given_m or math.ceil(b / (k or 1)), b)
    if k is not None and math.ceil(b / m) != k:
        raise ValueError(
            f"batch_size={b}, micro_batch_size={config.micro_batch_size} and "
            f"gradient_accumulation_steps={k} contradict each other: {b} samples at {m} per "
            f"micro-batch take {math.ceil(b / m)} micro-batches. Give only two of the three."
        )
    return b, m, math.ceil(b / m)


def scaled_lr(config: TrainConfig, batch_size: int) -> float:
    """The learning rate used at ``batch_size`` (Note [learning-rate scaling]).

    Example:
        >>> scaled_lr(TrainConfig(lr=0.1, lr_scaling="linear", reference_batch_size=256), 1024)
        0.4
    """
    if config.lr_scaling == "none":
        return float(config.lr)
    ratio = batch_size / int(config.reference_batch_size or batch_size)
    return float(config.lr) * (ratio if config.lr_scaling == "linear" else math.sqrt(ratio))


def field_names() -> list[str]:
    """The settings' names, in order (TOML keys; CLI flags with ``-`` for ``_``)."""
    return [f.name for f in fields(TrainConfig)]


def make_config(
    config: TrainConfig | dict[str, Any] | None = None, **overrides: Any
) -> TrainConfig:
    """A ``TrainConfig`` from a config, a dict of settings and/or keyword arguments.

    Raises:
        ValueError: a key is not a setting (the message lists the allowed ones), or a value is bad.
    """
    base = config.to_dict() if isinstance(config, TrainConfig) else dict(config or {})
    settings = {**base, **overrides}
    unknown = sorted(set(settings) - set(field_names()))
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(field_names())}."
        )
    return TrainConfig(**settings)


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file into a dict of settings (keys checked by ``make_config``).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not valid TOML (the message names the file and the line).
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r} does not exist.") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {path!r} is not valid TOML: {exc}.") from None
    except OSError as exc:
        raise ValueError(f"config file {path!r} cannot be read: {exc.strerror}.") from None
    return data


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"{name}={value!r} is not allowed: use one of {', '.join(map(repr, allowed))}."
        )


def _check_positive_int(name: str, value: Any, zero: bool = False, auto: bool = False) -> None:
    if value is None and not zero:
        return
    low = 0 if zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a non-negative integer" if zero else "a positive integer"
        what += ' or "auto"' if auto else ""
        raise ValueError(f"{name}={value!r} is not allowed: use {what}.")

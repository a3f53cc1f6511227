"""``TrainConfig``: the trainer's settings, one frozen dataclass = CLI flags = TOML keys.

Every field is a ``bigbatch train`` flag (``micro_batch_size`` -> ``--micro-batch-size``) and a
key of a ``--config`` TOML file; the CLI overrides the file, the file overrides the defaults.
Each field carries its help text, its allowed values (imported from the module that owns them),
the least value of an integer and the other names users type for it (``setting(...)``): the
command line, its reference (docs/cli.md), the TOML reader and the checks are all made from this
one list, so adding a setting is one field here (docs/design-settings.md). Below the settings:
what ``fit`` builds from them before the first step, one function each (the batch a step trains
on, the learning rate, the model, the default schedule, the run's identity).

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

The task: what a user hands to the trainer: a ``Task``, and how one is found from ``module:function``.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import inspect
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

import torch

from bigbatch.core import batchnorm as bn
from bigbatch.core._precision import PRECISIONS
from bigbatch.core._stepping import NONFINITE
from bigbatch.core._units import parse_bytes
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.loss import LossFn
from bigbatch.distributed import launch as distributed

BATCHNORMS = ("keep", *(p for p in bn.POLICIES if p != "keep"))  # the default first
DEFAULT_BATCH_SIZE = 32


def setting(
    default: Any,
    *,
    choices: tuple[Any, ...] | None = None,
    low: int | None = None,
    allowed: str | None = None,
    aliases: tuple[str, ...] = (),
    resumable: bool = False,
) -> Any:
    """A ``TrainConfig`` field with what the command line and the checks need to know about it
    (its help is its entry in ``TrainConfig``'s Attributes).

    Args:
        default: the default value.
        choices: the allowed values, when there is a list (matched without regard to case).
        low: for an integer, the least value allowed.
        allowed: what the error says is allowed, when "a positive integer" does not say it.
        aliases: other flags for it, as users of other tools type them: ``"--learning-rate"``
            takes a value like ``--lr``; ``"--fp16=fp16"`` is a switch that sets the value.
        resumable: may differ between a run and its resume (it does not change the result).
    """
    meta = dict(choices=choices, low=low, allowed=allowed, aliases=aliases, resumable=resumable)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``bigbatch train`` / ``bigbatch.fit`` can be told (see the module notes).

    Each attribute is a setting: its entry here is its line in ``bigbatch train --help`` and
    docs/cli.md (``helps()``); its ``setting(...)`` says the rest (see the module docstring).

    Attributes:
        task: module:function (or file.py:function) returning a bigbatch.Task
        batch_size: effective batch: samples per optimizer step, over all ranks (default 32)
        micro_batch_size: samples per forward/backward on each rank, or auto: the largest
            that fits
        gradient_accumulation_steps: micro-batches per optimizer step
        micro_batch_tokens: token windows: cut each batch by padded tokens per micro-batch,
            sorted by length, each trimmed to its longest (a batch with attention_mask, or
            the task's lengths); or auto; --micro-batch-size is then an optional row cap
        pad_to_multiple_of: with --micro-batch-tokens: pad lengths to a multiple (one shape
            per bucket)
        trim_padding: cut by samples, trim each micro-batch of right-padded text (a batch
            with attention_mask) to its longest sample; false keeps the batch's padded
            width, for a model or loss that reads the padding (mean pooling without the mask)
        compile: torch.compile the model (give --pad-to-multiple-of with tokens)
        gradient_checkpointing: recompute the model's repeated blocks in backward (less
            memory, ~1 more forward)
        chunked_head: compute the language-model loss from the hidden states in chunks,
            never holding the logits (tokens x vocabulary): a larger micro-batch fits; the
            model needs get_output_embeddings() and the loss bigbatch.token_cross_entropy
        precision: autocast precision
        batchnorm: BatchNorm under accumulation (a micro-batch's statistics are not the full
            batch's): keep: leave the model, warn; micro: per-micro-batch statistics,
            running stats moved once per step; freeze: use the running stats (exact, for
            fine-tuning); groupnorm: swap in GroupNorm (exact)
        max_grad_norm: clip the gradient's 2-norm (default: no clipping)
        nonfinite: a step whose loss or gradient is NaN/inf: raise (stop, keeping the last
            good snapshot), skip it, or apply it
        lr: learning rate at --reference-batch-size, for the task's optimizer or AdamW
        lr_scaling: scale --lr with batch/reference
        reference_batch_size: the batch size --lr was tuned for
        lr_schedule: after warm-up: constant or cosine to 0
        warmup_steps: optimizer steps of linear warm-up
        steps: optimizer steps to run (or give --epochs)
        epochs: passes over the data (default 1 when --steps is not given)
        memory_budget: cap on memory a step may use, e.g. 6GiB (with --micro-batch-size
            auto)
        seed: seeds the model, dropout and the data order
        out: run folder
        save_every: resume snapshot every N steps (0: each epoch's end and the run's)
        keep_snapshots: snapshots kept in the run folder (the newest N; at least 1)
        resume: continue the run in --out from its last snapshot; auto: resume if there is
            one, else start
        eval_every: evaluate every N steps (0: only at the end)
        log_every: a progress line every N steps in DIR/train.log, and on stderr when it is
            not a terminal (0: about 20 lines per run)
        device: default: cuda when available
        local_steps: under torchrun: optimizer steps (λ) each rank takes on its own share
            between two exchanges. 1: the exact data-parallel step (DDP, one all-reduce per
            step). λ > 1: local accumulation (Hermans et al. 2017), λ exact local steps per
            rank, then ONE all-reduce of the ranks' updates normalised by λ: λ times fewer
            bytes and messages, not the exact big-batch step; each rank keeps its own
            optimizer state; the log's loss is rank 0's share, round_loss the round's over
            all ranks; snapshots, evaluation and Ctrl-C wait for the round's end; not with
            FSDP
        outer_lr: with --local-steps λ > 1: the step taken along the ranks' averaged update,
            normalised by λ: 1 is the paper's (one step's worth per round, about λ times
            slower per sample), λ averages the ranks' models (local SGD, as PyTorch's
            post-local SGD model averaging), 0.7·λ with --outer-momentum 0.9
            --outer-nesterov is DiLoCo's
        outer_momentum: with --local-steps λ > 1: momentum of the outer step, in [0, 1): 0
            is the paper's plain rule and model averaging's, 0.9 DiLoCo's
        outer_nesterov: with --local-steps λ > 1: Nesterov outer momentum (DiLoCo's; needs
            --outer-momentum)
        shuffle: reshuffle the training data every epoch
        quiet: no progress bar and no end-of-run table
    """

    task: str | None = setting(None)
    batch_size: int | None = setting(None, low=1)
    micro_batch_size: int | Literal["auto"] | None = setting(
        None, low=1, aliases=("--per-device-train-batch-size",)
    )
    gradient_accumulation_steps: int | None = setting(None, low=1)
    micro_batch_tokens: int | Literal["auto"] | None = setting(None, low=1)
    pad_to_multiple_of: int | None = setting(None, low=1)
    trim_padding: bool = setting(True)
    compile: bool = setting(False)
    gradient_checkpointing: bool = setting(False)
    chunked_head: bool = setting(False)
    precision: str = setting("fp32", choices=PRECISIONS, aliases=("--fp16=fp16", "--bf16=bf16"))
    batchnorm: str | None = setting("keep", choices=BATCHNORMS)
    max_grad_norm: float | None = setting(None)
    nonfinite: str = setting("raise", choices=NONFINITE)
    lr: float = setting(1e-3, aliases=("--learning-rate",))
    lr_scaling: str = setting("none", choices=("none", "linear", "sqrt"))
    reference_batch_size: int | None = setting(None, low=1)
    lr_schedule: str = setting("constant", choices=("constant", "cosine"))
    warmup_steps: int = setting(0, low=0)
    steps: int | None = setting(None, low=1, aliases=("--max-steps",))
    epochs: int | None = setting(None, low=1, aliases=("--num-train-epochs",))
    memory_budget: str | int | None = setting(None)
    seed: int = setting(0, low=0)
    out: str = setting("runs/bigbatch", resumable=True)
    save_every: int = setting(0, low=0, resumable=True)
    keep_snapshots: int = setting(2, low=1, resumable=True)
    resume: bool | str = setting(False, choices=(False, True, "auto"), resumable=True)
    eval_every: int = setting(0, low=0, resumable=True)
    log_every: int = setting(0, low=0, resumable=True)
    device: str | None = setting(None, choices=(None, *distributed.DEVICES))
    local_steps: int = setting(
        1,
        low=1,
        allowed="a whole number >= 1, the optimizer steps each "
        "rank takes between two exchanges (1, the default: the exact "
        "data-parallel step)",
    )
    outer_lr: float = setting(1.0)
    outer_momentum: float = setting(0.0)
    outer_nesterov: bool = setting(False)
    shuffle: bool = setting(True)
    quiet: bool = setting(False, resumable=True)

    def __post_init__(self) -> None:
        if self.batchnorm is None:  # the same run as "keep" (the resume identity compares these)
            object.__setattr__(self, "batchnorm", "keep")
        for f in fields(self):
            value = canonical(f, getattr(self, f.name))  # "Auto", "FP16": any case will do
            object.__setattr__(self, f.name, value)
            _check_field(f, value)
        _check_numbers(self)
        resolve_batch(self)  # contradictions are reported when the config is made

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what a TOML file holds)."""
        return asdict(self)


def settings() -> list[Field]:
    """The settings with their metadata (choices, low, aliases, resumable), in order."""
    return list(fields(TrainConfig))


@functools.cache
def helps() -> dict[str, str]:
    """Each setting's help: its entry in ``TrainConfig``'s Attributes, on one line."""
    text = inspect.cleandoc(TrainConfig.__doc__ or "").partition("Attributes:\n")[2]
    entries = re.findall(r"^ {4}(\w+): (.*(?:\n {8}.*)*)", text, re.MULTILINE)  # and indented lines
    return {name: " ".join(body.split()) for name, body in entries}


@functools.cache
def kinds(f: Field) -> tuple[Any, ...]:
    """The types setting ``f`` admits: ``(int, Literal["auto"], NoneType)``."""
    hint = get_type_hints(TrainConfig)[f.name]
    return get_args(hint) or (hint,)


def words(f: Field) -> list[Any]:
    """The values of setting ``f`` that are words (choices, ``"auto"``), as written."""
    literals = [w for k in kinds(f) if get_origin(k) is Literal for w in get_args(k)]
    return [w for w in (f.metadata["choices"] or literals) if isinstance(w, str)]


def canonical(f: Field, value: Any) -> Any:
    """``value`` as setting ``f`` spells it when it is one of its words in another case."""
    if isinstance(value, str):
        return next((w for w in words(f) if w.lower() == value.strip().lower()), value)
    return value


def closest(given: str, known: Iterable[str]) -> str | None:
    """The name in ``known`` that ``given`` most likely means: the first it begins, else the
    most similar (``None``: none is close). For "did you mean" in every error about a name."""
    known = list(known)
    close = [k for k in known if k.startswith(given)] or difflib.get_close_matches(given, known, 1)
    return close[0] if close else None


def _check_field(f: Field, value: Any) -> None:
    """The value's type, its choices or its least value, as ``setting(...)`` declares them."""
    meta, admits = f.metadata, kinds(f)
    if meta["choices"] is not None:  # "1" is not 1, 1 is not True
        if not any(value == a and type(value) is type(a) for a in meta["choices"]):
            shown = ", ".join(repr(a) for a in meta["choices"] if a is not None)
            raise ValueError(f"{f.name}={value!r} is not allowed: use one of {shown}.")
    elif meta["low"] is not None:
        if (value is None and type(None) in admits) or value in words(f):
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < meta["low"]:
            what = meta["allowed"] or f"a {'positive' if meta['low'] else 'non-negative'} integer"
            what += "".join(f' or "{w}"' for w in words(f))
            raise ValueError(f"{f.name}={value!r} is not allowed: use {what}.")
    elif int not in admits and type(value) not in admits:  # (int where float is: fine)
        if type(value) is int and float in admits:
            return
        wanted = " or ".join(_KINDS[k] for k in admits if k in _KINDS)
        wanted += " (or is left out)" if type(None) in admits else ""
        raise TypeError(f"{f.name}={value!r} is {described(type(value))}: {f.name} takes {wanted}.")


def _check_numbers(c: TrainConfig) -> None:
    """What one field's type and range do not say."""
    if c.steps is not None and c.epochs is not None:
        raise ValueError(
            f"steps={c.steps} and epochs={c.epochs} are both given: choose one "
            "(--steps N: N optimizer steps; --epochs N: N passes over the data)."
        )
    for name, right, allowed in [
        ("lr", positive(c.lr), "a positive number (finite), e.g. lr=3e-4"),
        (
            "max_grad_norm",
            positive(c.max_grad_norm),
            "a positive number (finite, e.g. 1.0), or leave it out for no clipping",
        ),
        ("seed", c.seed < 2**63, "an integer from 0 to 2**63 - 1"),
        ("outer_lr", positive(c.outer_lr), "a positive number (1: the paper, λ: model averaging)"),
        ("outer_momentum", 0 <= c.outer_momentum < 1, "a number in [0, 1), e.g. 0.9 (DiLoCo's)"),
    ]:
        if not right:
            raise ValueError(f"{name}={getattr(c, name)!r} is not allowed: use {allowed}.")
    parse_bytes(c.memory_budget)  # refuses what is not a finite, positive size
    if c.lr_scaling != "none" and c.reference_batch_size is None:
        raise ValueError(
            f"lr_scaling={c.lr_scaling!r} needs reference_batch_size, the batch "
            "size lr was tuned for: e.g. --reference-batch-size 256."
        )
    if c.outer_nesterov and c.outer_momentum == 0:
        raise ValueError(
            "outer_nesterov=True needs outer momentum: add --outer-momentum 0.9 "
            "(DiLoCo's), or drop --outer-nesterov."
        )
    outer = [
        f"{f.name}={getattr(c, f.name)!r}"
        for f in fields(c)  # used only with local_steps > 1
        if f.name.startswith("outer_") and getattr(c, f.name) != f.default
    ]
    if c.local_steps == 1 and outer:
        raise ValueError(
            f"{', '.join(outer)} has no effect with local_steps=1, the exact "
            "data-parallel step: add --local-steps λ > 1, or drop it."
        )


def resolve_batch(config: TrainConfig) -> tuple[int, int | str, int | None]:
    """``(batch_size, micro_batch_size, gradient_accumulation_steps)`` (Note [batch arithmetic]).

    ``gradient_accumulation_steps`` is ``None`` with ``micro_batch_size="auto"`` and with
    ``micro_batch_tokens`` (then ``micro_batch_size`` caps the rows, or is ``None``).

    Raises:
        ValueError: the given values contradict each other.

    Example:
        >>> resolve_batch(TrainConfig(batch_size=10, micro_batch_size=4))
        (10, 4, 3)
    """
    k, given_m = config.gradient_accumulation_steps, config.micro_batch_size
    tokens = config.micro_batch_tokens is not None  # micro_batch_size then caps the rows
    if k is not None and tokens:
        raise ValueError(
            f"gradient_accumulation_steps={k} has no meaning with micro_batch_tokens: "
            "the tokens decide the number of micro-batches. Drop one of the two."
        )
    if k is not None and given_m == "auto":
        raise ValueError(
            f"micro_batch_size='auto' chooses the accumulation steps itself: drop "
            f"gradient_accumulation_steps={k}, or give an integer micro_batch_size."
        )
    if tokens or given_m == "auto":
        return (config.batch_size or DEFAULT_BATCH_SIZE), given_m, None  # type: ignore[return-value]
    b = config.batch_size or (given_m or DEFAULT_BATCH_SIZE) * (k or 1)
    m = min(given_m or math.ceil(b / (k or 1)), b)
    steps = math.ceil(b / m)
    if k is not None and steps != k and given_m is not None and config.batch_size is not None:
        raise ValueError(
            f"batch_size={b}, micro_batch_size={given_m} and gradient_accumulation_"
            f"steps={k} contradict each other: {b} samples at {m} per micro-batch "
            f"take {steps} micro-batches. Give only two of the three."
        )
    if k is not None and steps != k:
        raise ValueError(
            f"batch_size={b} cannot be cut into gradient_accumulation_steps={k} micro-"
            f"batches: at {m} samples per micro-batch it takes {steps} (only the last "
            f"may be smaller). Use gradient_accumulation_steps={steps}, or give "
            "micro_batch_size instead."
        )
    return b, m, steps


def run_length(config: TrainConfig, dataset_size: int) -> tuple[int, int]:
    """``(steps_per_epoch, total_steps)`` of a run over ``dataset_size`` samples.

    Example:
        >>> run_length(TrainConfig(batch_size=10, epochs=2), 25)
        (3, 6)
    """
    steps_per_epoch = math.ceil(dataset_size / resolve_batch(config)[0])
    return steps_per_epoch, config.steps or (config.epochs or 1) * steps_per_epoch


def scaled_lr(config: TrainConfig, batch_size: int) -> float:
    """The learning rate used at ``batch_size`` (Note [learning-rate scaling]).

    Example:
        >>> scaled_lr(TrainConfig(lr=0.1, lr_scaling="linear", reference_batch_size=256), 1024)
        0.4
    """
    ratio = batch_size / int(config.reference_batch_size or batch_size)
    scale = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[config.lr_scaling]
    return float(config.lr) * scale


def resumable_changes() -> frozenset[str]:
    """Settings that may change between a run and its resume (they do not change the result)."""
    return frozenset(f.name for f in fields(TrainConfig) if f.metadata["resumable"])


def make_config(
    config: TrainConfig | dict[str, Any] | None = None, **overrides: Any
) -> TrainConfig:
    """A ``TrainConfig`` from a config, a dict of settings and/or keyword arguments.

    Raises:
        ValueError: a key is not a setting (the message lists the allowed ones and the closest
            name, HF's names included), or a value is bad.
        TypeError: a value of the wrong type (``shuffle = "false"`` in a TOML file).
    """
    base = config.to_dict() if isinstance(config, TrainConfig) else dict(config or {})
    given = {**base, **overrides}
    names = [f.name for f in fields(TrainConfig)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        aliases = [(a, f.name) for f in fields(TrainConfig) for a in f.metadata["aliases"]]
        spelled = {a[2:].split("=")[0].replace("-", "_"): n for a, n in aliases}
        spelled.update({n: n for n in names})
        close = [closest(key.lstrip("-").replace("-", "_"), spelled) for key in unknown]
        hints = "".join(f" Did you mean {spelled[c]!r}?" for c in close if c)
        raise ValueError(
            f"unknown setting(s) {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(names)}.{hints}"
        )
    return TrainConfig(**given)


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file into a dict of settings (keys and types checked by ``make_config``).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not valid TOML (the message names the file and the line).
    """
    tomllib = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r} does not exist.") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {path!r} is not valid TOML: {exc}.") from None
    except OSError as exc:
        raise ValueError(f"config file {path!r} cannot be read: {exc.strerror}.") from None


# ---------------------------------------------------------------------------- the task
OptimizerFactory = Callable[..., torch.optim.Optimizer]
"""``optimizer(params, lr) -> Optimizer``."""
SchedulerFactory = Callable[[torch.optim.Optimizer, int], Any]
"""``scheduler(optimizer, total_steps) -> LR scheduler`` stepped once per optimizer step."""
Metric = Callable[[torch.nn.Module, Any], Any]
"""``metric(model, batch) -> (metric_sum, count)`` or a scalar mean, like a ``loss_fn``."""


class TaskError(ValueError):
    """A task path or a task function that cannot be used; the message says what to fix."""


@dataclass
class Task:
    """A model, its training data and its loss: everything ``bigbatch train`` needs.

    Args:
        model: the module to train.
        train_data: a map-style dataset (or anything a ``DataLoader`` takes); one item per sample.
        loss_fn: ``loss_fn(model, micro_batch)`` returning a scalar mean or ``(loss_sum, count)``.
        eval_data: optional dataset to evaluate on after training (and every ``eval_every`` steps).
        metric: optional ``metric(model, batch)`` returning ``(metric_sum, count)`` or a mean,
            e.g. the number of correct predictions and the number of samples.
        optimizer: optional factory ``optimizer(params, lr)``; default ``AdamW``.
        scheduler: optional factory ``scheduler(optimizer, total_steps)``, stepped once per
            optimizer step (``ReduceLROnPlateau`` with the step's loss); default: the settings'
            ``lr_schedule``. A per-epoch schedule is one that changes every
            ``ceil(len(train_data) / batch_size)`` steps: write it as a step schedule, e.g.
            ``LambdaLR(opt, lambda step: 0.1 ** (step // steps_per_epoch))``.
        collate_fn: optional ``collate_fn`` for the ``DataLoader``.
        lengths: optional ``lengths(batch)`` -> each sample's tokens, for ``--micro-batch-tokens``
            when the batch has no ``attention_mask``.
        count_fn: optional ``count_fn(micro_batch)``, the count the loss will return for it
            (e.g. non-padding tokens): fp16 then back-propagates at the full batch's scale
            (Note [backward scale] in ``bigbatch.core.engine``).
        pad_values: optional ``{key: pad value}`` for a mapping batch's per-token tensors
            beyond transformers' keys, ``{key: None}`` for a 2-D tensor that is not per-token
            (Note [per-token tensors] in ``bigbatch.core._tokens``).

    Example:
        >>> def my_task():  # in my_project/tasks.py, run as `bigbatch train my_project.tasks:my_task`
        ...     data = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
        ...     loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        ...     return Task(model=torch.nn.Linear(3, 1), train_data=data, loss_fn=loss)
    """

    model: torch.nn.Module
    train_data: Any
    loss_fn: LossFn
    eval_data: Any = None
    metric: Metric | None = None
    optimizer: OptimizerFactory | None = None
    scheduler: SchedulerFactory | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    count_fn: Callable[[Any], Any] | None = None
    lengths: Callable[[Any], Any] | None = None
    pad_values: Mapping[str, float | None] | None = None


def check_task(task: object) -> None:
    """Refuse a task the trainer cannot use, naming the field and what it must be.

    Raises:
        TaskError: not a ``Task``, a model that is not a module, a loss or factory that is not
            callable, training data that is not a non-empty map-style dataset.
    """
    if not isinstance(task, Task):
        raise TaskError(
            f"the task is a {type(task).__name__}, not a bigbatch.Task: end the task "
            "function with `return bigbatch.Task(model=, train_data=, loss_fn=)`."
        )
    if not isinstance(task.model, torch.nn.Module):
        kind = type(task.model).__name__
        raise TaskError(f"Task.model is a {kind}; it must be a torch.nn.Module.")
    for name in ("loss_fn", "metric", "optimizer", "scheduler", "collate_fn", "count_fn"):
        value = getattr(task, name)
        if (value is not None or name == "loss_fn") and not callable(value):
            what = " loss_fn(model, batch) returning a mean or (loss_sum, count)"
            raise TaskError(
                f"Task.{name} is {value!r}; it must be a function"
                f"{what if name == 'loss_fn' else ''}."
            )
    data = task.train_data
    if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
        raise TaskError(
            f"Task.train_data is a {type(data).__name__}; the trainer needs a "
            "map-style dataset (len() and [i]), e.g. a TensorDataset(x, y) or a list."
        )
    if len(data) == 0:
        raise TaskError("Task.train_data is empty: the trainer needs at least one sample.")


def canonical_path(path: str) -> str:
    """One spelling per task: ``./tasks.py:small`` and ``/abs/tasks.py:small`` are the same run."""
    module, sep, func = path.partition(":")
    return f"{os.path.realpath(module)}:{func}" if sep and module.endswith(".py") else path


def load_task(path: str, **kwargs: Any) -> Task:
    """Import ``module:function`` (or ``file.py:function``), call it and check it returns a Task.

    Raises:
        TaskError: the path is malformed, the module or function is missing, or the function
            returns something other than a usable ``Task`` (the message starts with the path).
    """
    module_name, sep, func_name = path.partition(":")
    if not sep or not module_name or not func_name:
        raise TaskError(_no_function(path, module_name))
    with _current_folder_importable():
        func = getattr(_import(module_name, path), func_name, None)
        if func is None or not callable(func):
            raise TaskError(f"task {path!r}: module {module_name!r} has no function {func_name!r}.")
        task = func(**kwargs)
    try:
        check_task(task)
    except TaskError as exc:
        raise TaskError(f"task {path!r}: {exc}") from None
    return task


def _no_function(path: str, module_name: str) -> str:
    """Why ``path`` is not a task: the two forms, and the module's functions returning a Task."""
    names: list[str] = []
    if module_name:
        with _current_folder_importable():
            module = _import(module_name, path)
        names = [
            name
            for name, f in vars(module).items()
            if inspect.isfunction(f)  # -> Task
            and str(f.__annotations__.get("return")).rstrip("'>").endswith("Task")
        ]
    example = f"{module_name}:{names[0]}" if names else "my_project.tasks:mnist"
    return (
        f"task {path!r} names no function: give module:function or file.py:function, e.g. "
        f"{example} (its functions that return a bigbatch.Task: "
        f"{', '.join(names) or 'none'})."
    )


def _import(module_name: str, path: str) -> Any:
    """The module, imported by name or run from its file; a syntax error in the user's words."""
    file = module_name.endswith(".py")
    if file and not os.path.exists(module_name):
        raise TaskError(f"task {path!r}: file {module_name!r} does not exist.")
    try:
        if not file:
            return importlib.import_module(module_name)
        name = os.path.basename(module_name)[:-3]
        spec = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module
    except ModuleNotFoundError as exc:
        if file:  # the user's file imports something missing: the user's line says it
            raise
        raise TaskError(
            f"task {path!r}: cannot import {module_name!r} ({exc}); run from the "
            "folder that holds it or install it."
        ) from None
    except SyntaxError as exc:  # the user's file, line and caret; not importlib's frame
        raise TaskError(f"task {path!r}: {_syntax_error(exc)}") from None


def _syntax_error(exc: SyntaxError) -> str:
    """``file:line: SyntaxError: message``, then the line and a caret under the fault."""
    where = f"{os.path.relpath(exc.filename)}:{exc.lineno}" if exc.filename else "<unknown>"
    head = f"{where}: {type(exc).__name__}: {exc.msg}"
    if not exc.text:
        return head
    code = (line := exc.text.rstrip("\n")).lstrip()
    column = max(0, (exc.offset or 1) - 1 - (len(line) - len(code)))
    same_line = exc.end_offset and exc.end_lineno == exc.lineno
    width = max(1, exc.end_offset - (exc.offset or 0)) if same_line else 1  # type: ignore[operator]
    return f"{head}\n    {code.rstrip()}\n    {' ' * column}{'^' * width}"


@contextlib.contextmanager
def _current_folder_importable() -> Iterator[None]:
    """Like ``python -m``: modules next to the user resolve while the task is loaded and built;
    ``sys.path`` is given back as it was afterwards."""
    added = os.getcwd() not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        if added and os.getcwd() in sys.path:
            sys.path.remove(os.getcwd())


def first_batch(task: Task, batch_size: int) -> Any:
    """The first ``batch_size`` training samples of ``task``, collated, in order (no shuffling):
    what ``bigbatch check`` and ``bigbatch plan`` measure on.

    Raises:
        ValueError: ``batch_size`` is below 1 or larger than the training data (the batch
            measured would not be the batch asked for).
    """
    samples = len(task.train_data)
    if batch_size < 1:
        raise ValueError(
            f"--batch-size {batch_size} is not allowed: use a positive integer, at "
            f"most the task's {samples} training samples."
        )
    if batch_size > samples:
        raise ValueError(
            f"--batch-size {batch_size} is larger than the task's {samples} training "
            f"samples: the batch measured would hold only {samples}. Give "
            f"--batch-size {samples} or less."
        )
    collate = task.collate_fn or torch.utils.data.default_collate
    return collate([task.train_data[i] for i in range(batch_size)])


# ---------------------------------------------------------------------------- what fit builds from them
def trained_batch(config: TrainConfig, samples: int, is_main: bool) -> int:
    """The batch a step trains on: ``batch_size``, or every sample when the data hold fewer
    (said in a warning: the learning rate is then scaled for the batch really trained)."""
    batch_size = resolve_batch(config)[0]
    if batch_size <= samples:
        return batch_size
    if is_main:
        scaled = config.lr_scaling != "none"
        lr = f", and --lr is scaled for {samples} samples, not {batch_size}" if scaled else ""
        warnings.warn(
            f"--batch-size {batch_size} is larger than the task's {samples} training "
            f"samples: every step trains on all {samples} (full-batch gradient descent)"
            f"{lr}. Give --batch-size {samples} or less.",
            BigBatchWarning,
            stacklevel=5,
        )
    return samples


def checked_lr(config: TrainConfig, batch_size: int, model: torch.nn.Module) -> float:
    """The scaled learning rate, refused when an optimizer's step would overflow the model's
    floats inside torch (Adam's first steps move by up to 1,000 x lr).

    Raises:
        ValueError: naming ``--lr``, the rate at ``batch_size``, the dtype and a rate that works.
    """
    lr = scaled_lr(config, batch_size)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtype = min(dtypes, key=lambda d: torch.finfo(d).max, default=torch.float64)
    largest = torch.finfo(dtype).max
    if not lr < largest / 1000:
        raise ValueError(
            f"--lr {config.lr:g} gives a rate of {lr:g} at batch {batch_size}, and "
            f"the model's {dtype} parameters hold at most {largest:.3g}: an optimizer "
            f"step would overflow. Use a rate below {largest / 1000:.3g}, e.g. 1e-3."
        )
    return lr


def prepare_model(
    model: torch.nn.Module, config: TrainConfig, ranks: distributed.Ranks
) -> torch.nn.Module:
    """Checkpointing and the BatchNorm policy on; DDP around it (not under local rounds)."""
    if config.gradient_checkpointing:
        from bigbatch.memory.checkpointing import enable_checkpointing

        enable_checkpointing(model)
    if config.batchnorm != "keep":
        bn.batchnorm(model, config.batchnorm or "keep")  # before DDP wraps the modules
    model.train()
    # under local rounds each rank steps its own replica (Note [local rounds])
    model = model.to(ranks.device) if config.local_steps > 1 else distributed.wrap(model, ranks)
    return torch.compile(model) if config.compile else model  # type: ignore[return-value]


def schedule(
    config: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps``, then constant or cosine to 0 at the last step."""
    warmup = config.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if config.lr_schedule == "cosine" else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def identity(task: Task, config: TrainConfig, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What makes a run the same run: the task, the settings that change the result, the model,
    the optimizer's class (its state only loads into the same kind)."""
    settings = {k: v for k, v in config.to_dict().items() if k not in resumable_changes()}
    settings["task"] = canonical_path(config.task) if config.task else None
    shapes = {k: list(p.shape) for k, p in distributed.unwrap(task.model).state_dict().items()}
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    return {**settings, "model": shapes, "train_samples": len(task.train_data), "optimizer": kind}


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def positive(value: float | None) -> bool:
    """``None``, or a finite number above 0."""
    return value is None or 0 < value < math.inf


def described(*kinds: type) -> str:
    """``"an int or None"``: types as a sentence says them."""
    names = [k.__name__.replace("NoneType", "None") for k in kinds]
    return " or ".join(n if n == "None" else f"a{'n' * (n[0] in 'aeiou')} {n}" for n in names)

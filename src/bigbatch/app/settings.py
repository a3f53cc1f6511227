"""The trainer's settings: ``TrainConfig``, one frozen dataclass = CLI flags = TOML keys.

Every field is a ``bigbatch train`` flag (``micro_batch_size`` -> ``--micro-batch-size``) and a
key of a ``--config`` TOML file; the CLI overrides the file, the file overrides the defaults.
Each field carries its help text, its allowed values (imported from the module that owns them),
the least value of an integer and the other names users type for it (``setting(...)``): the
command line, its reference (docs/cli.md), the TOML reader and the checks are all made from this
one list, so adding a setting is one field here (docs/design-settings.md). A config is checked
whole when it is made, and works out its batch arithmetic then, once (``TrainConfig.batch``).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import re
import sys
from collections.abc import Iterable
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, Literal, NamedTuple, get_args, get_origin, get_type_hints

from bigbatch.core import batchnorm as bn
from bigbatch.core._precision import PRECISIONS
from bigbatch.core._stepping import NONFINITE
from bigbatch.core._units import parse_bytes
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
    """Everything ``bigbatch train`` / ``bigbatch.fit`` can be told: the batch and how it is cut
    (Note [batch arithmetic]), the learning rate (Note [learning-rate scaling] in ``app.run``).

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
        pack: pack each batch's samples whole into rows of this many tokens, positions
            restarting at each sample (a causal LM, attention kept within each sample:
            docs/token_windows.md); --micro-batch-size rows per micro-batch, or what
            --micro-batch-tokens holds (--pad-to-multiple-of pads the last micro-batch's
            rows: one shape); the first window is checked against its samples unpacked
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
        peak_tflops: the device's peak TFLOP/s for the model FLOPs utilisation (MFU) of text
            runs (default: measured once, one matrix product in the model's dtype)
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
    pack: int | None = setting(None, low=1)
    compile: bool = setting(False)
    gradient_checkpointing: bool = setting(False)
    chunked_head: bool = setting(False)
    precision: str = setting("fp32", choices=PRECISIONS, aliases=("--fp16=fp16", "--bf16=bf16"))
    batchnorm: str | None = setting("keep", choices=BATCHNORMS)
    max_grad_norm: float | None = setting(None)
    nonfinite: str = setting("raise", choices=NONFINITE)
    peak_tflops: float | None = setting(None, resumable=True)
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
        # the batch arithmetic, worked out once, here: a contradiction is refused when it is made
        self.batching  # noqa: B018 - a cached property, computed here and kept

    @functools.cached_property
    def batching(self) -> Batching:
        """How the effective batch is cut, worked out once (``resolve_batch``)."""
        return resolve_batch(self)

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
    for name, right, allowed in _number_rules(c):
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


def _number_rules(c: TrainConfig) -> list[tuple[str, bool, str]]:
    """``(setting, whether its value is allowed, what is)`` for the numbers' ranges."""
    return [
        ("lr", positive(c.lr), "a positive number (finite), e.g. lr=3e-4"),
        (
            "max_grad_norm",
            positive(c.max_grad_norm),
            "a positive number (finite, e.g. 1.0), or leave it out for no clipping",
        ),
        ("seed", c.seed < 2**63, "an integer from 0 to 2**63 - 1"),
        ("outer_lr", positive(c.outer_lr), "a positive number (1: the paper, λ: model averaging)"),
        ("peak_tflops", positive(c.peak_tflops), "a positive number (TFLOP/s), or leave it out"),
        ("outer_momentum", 0 <= c.outer_momentum < 1, "a number in [0, 1), e.g. 0.9 (DiLoCo's)"),
    ]


class Batching(NamedTuple):
    """How the effective batch is cut (Note [batch arithmetic]): ``gradient_accumulation_steps``
    is ``None`` with ``micro_batch_size="auto"`` and with ``micro_batch_tokens`` (then
    ``micro_batch_size`` caps the rows, or is ``None``)."""

    batch_size: int
    micro_batch_size: int | str | None
    gradient_accumulation_steps: int | None


def resolve_batch(config: TrainConfig) -> Batching:
    """``(batch_size, micro_batch_size, gradient_accumulation_steps)``, the two not given from
    those given; a config keeps its own (``TrainConfig.batching``).

    Note [batch arithmetic]
        ``batch_size`` is the effective batch, the samples one optimizer step averages over.
        ``micro_batch_size`` (m) and ``gradient_accumulation_steps`` (k) say how it is cut. Any
        two of the three determine the third: ``batch_size = m * k``; ``m = ceil(batch_size /
        k)``; ``k = ceil(batch_size / m)`` (the last micro-batch may be smaller, which stays
        exact). When all three are given they must agree. With ``micro_batch_size="auto"``
        bigbatch picks m (and so k) itself, so ``gradient_accumulation_steps`` must not be
        given. Nothing given: ``batch_size=32`` in one piece.

    Raises:
        ValueError: the given values contradict each other.

    Example:
        >>> TrainConfig(batch_size=10, micro_batch_size=4).batching
        Batching(batch_size=10, micro_batch_size=4, gradient_accumulation_steps=3)
    """
    k, given_m = config.gradient_accumulation_steps, config.micro_batch_size
    tokens = config.micro_batch_tokens is not None or config.pack is not None  # (rows: the cap)
    if k is not None and tokens:
        by = "micro_batch_tokens" if config.pack is None else "pack"
        raise ValueError(
            f"gradient_accumulation_steps={k} has no meaning with {by}: the tokens decide the "
            "number of micro-batches. Drop one of the two."
        )
    if k is not None and given_m == "auto":
        raise ValueError(
            f"micro_batch_size='auto' chooses the accumulation steps itself: drop "
            f"gradient_accumulation_steps={k}, or give an integer micro_batch_size."
        )
    if tokens or given_m == "auto":
        return Batching(config.batch_size or DEFAULT_BATCH_SIZE, given_m, None)
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
    return Batching(b, m, steps)


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


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def positive(value: float | None) -> bool:
    """``None``, or a finite number above 0."""
    return value is None or 0 < value < math.inf


def described(*kinds: type) -> str:
    """``"an int or None"``: types as a sentence says them."""
    names = [k.__name__.replace("NoneType", "None") for k in kinds]
    return " or ".join(n if n == "None" else f"a{'n' * (n[0] in 'aeiou')} {n}" for n in names)

"""The float64 runs ``check`` compares, and what it learns by running them under observation.

Each run works on its own float64 deep copy of the model (``copy_float64``) from the same seed
with dropout off (``seeded``), so the user's model, its running statistics and the global RNG are
left as they were: the full batch (``full_run``) and what ``train_step`` steps with
(``accumulated_grads``). Every run computes with dropout off (``Watch``, Note [dropout in
check]); the full-batch run also records where the copy computes below float64, where dropout
was on and where a NaN or inf first appears (``observe``); ``probe_coupling`` replays every
module to find those that couple the samples.

Note [float32 islands]
    A model cast to float64 does not always compute in float64: transformers' RMSNorm and rotary
    embeddings (Llama, Mistral), GPT-Neo's attention and the ``labels=`` loss of every family
    cast to float32 on purpose. Their gradients then differ between a full batch and its
    micro-batches by float32 rounding (1e-7 relative on those families), far above float64's
    1e-10, although accumulation is exact. ``observe`` watches every torch function called
    during the float64 forward and loss (a ``TorchFunctionMode``, public torch API) and records
    each call that returns a floating tensor below float64 on the gradient path (it requires
    grad) from tensor arguments (constants made from Python numbers are not computation, a metric
    under ``no_grad`` is not on the path: neither counts), with the innermost module it ran in. The lowest such dtype sets the tolerance, ``ROUNDING[dtype]`` (1e-5 for float32: a
    hundred times the rounding measured, while a wrong loss or a coupled module differs by 1e-3
    to 1), and ``check`` reports the dtype and the modules, so "exact" says how exact. Observing
    finds islands in any model, including ones written after this note, and names them.

Note [dropout in check]
    Dropout draws its masks per call: a micro-batch draws other masks than the same samples
    drew in the full batch (several dropout calls per layer interleave their draws differently),
    so with dropout on the accumulated gradient is another, equally likely sample of the same
    distribution, never the same numbers. ``check`` therefore computes every run with dropout
    off and says so ("exact (dropout off); with dropout on, equal in distribution"): the same
    ``TorchFunctionMode`` sets the probability of every dropout call to 0 (``nn.Dropout`` and
    its kin, ``F.dropout``, attention kernels called with ``dropout_p``, ``nn.MultiheadAttention``),
    which is what ``eval()`` does to dropout and nothing else: BatchNorm keeps its training mode.

Note [replay without caches]
    ``probe_coupling`` records every module's first call and calls the module again with the
    recorded arguments. Arguments that are state mutated by the call must not be reused:
    transformers' key/value ``Cache`` objects grow on every call, so a replayed attention layer
    saw twice the sequence length and failed. A replay therefore
    (1) passes ``None`` in place of every cache object (``is_kv_cache``): within one training
        forward that is what the layer computed with (its cache slot is empty until the layer
        fills it); a layer that cannot run without it is reported as not probed (3);
    (2) clones every tensor argument, so a module working in place cannot alter a recording;
    (3) when sample 0's output changed with the other samples, runs the unperturbed input again;
        if that changes the output too (the call changed state that the next call reads), or
        when a replay raises, the module is reported as not probed instead of guessing.
    Rejected: ``use_cache=False`` in the copy's config (only transformers, and bypassed by a
    ``loss_fn`` that passes ``use_cache=True``); deep copies of the arguments at record time (a
    cache costs its whole size once per layer: quadratic in depth).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from bigbatch.core._tree import tensor_leaves
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.engine import Accumulator
from bigbatch.core.loss import LossFn, Term, WindowLoss, as_terms, mean_of
from bigbatch.core.split import Batch, batch_size, split
from bigbatch.memory.checkpointing import disable_checkpointing, is_kv_cache

ROUNDING = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}
"""Relative gradient difference that computing partly in each dtype can make (~100 float32 ulps;
a few for the half types, whose rounding leaves check little to tell)."""

LOSS_FN = "loss_fn"
"""How ``Observed`` names operations run outside every module."""

# Dropout calls: (position, keyword, default) of the probability, then of the training flag
# (``None``: no flag). Setting the probability to 0 turns each into the identity.
_P = (1, "p", 0.5)
_DROPOUT: dict[Any, tuple[tuple[int, str, Any], tuple[int, str, bool] | None]] = {
    **{f: (_P, (2, "training", True)) for f in [F.dropout, F.dropout1d, F.dropout2d, F.dropout3d]},
    torch.dropout: (_P, (2, "train", True)),
    **dict.fromkeys([F.alpha_dropout, F.feature_alpha_dropout], (_P, (2, "training", False))),
    F.scaled_dot_product_attention: ((4, "dropout_p", 0.0), None),
    F.multi_head_attention_forward: ((10, "dropout_p", 0.0), (13, "training", True)),
}


@dataclass
class Observed:
    """What the full-batch run computed in, and where dropout was turned off.

    Attributes:
        dtype: the lowest floating dtype an operation returned (``torch.float64`` if none).
        where: the innermost module (by name, ``""`` for the model itself) of each operation
            that computed in ``dtype``, or ``"loss_fn"`` outside the model; first-seen order.
        dropout: the innermost module of each dropout call turned off (Note [dropout in check]).
        nonfinite: the first module (in the order calls finish) whose output holds NaN or inf.
    """

    dtype: torch.dtype = torch.float64
    where: list[str] = field(default_factory=list)
    dropout: list[str] = field(default_factory=list)
    nonfinite: str | None = None

    def add(self, dtype: torch.dtype, where: str) -> None:
        """Record one operation that returned ``dtype``."""
        if torch.finfo(dtype).eps > torch.finfo(self.dtype).eps:
            self.dtype, self.where = dtype, []
        if dtype == self.dtype and where not in self.where:
            self.where.append(where)


class Watch(TorchFunctionMode):
    """Turns dropout off (Note [dropout in check]); records low precision and dropout in
    ``observed`` when given one."""

    def __init__(self, observed: Observed | None = None, stack: list[str] | None = None) -> None:
        super().__init__()
        self.observed, self.stack = observed, [] if stack is None else stack

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        args, kwargs = list(args), dict(kwargs or {})
        off = func in _DROPOUT and _dropout_off(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.observed is None:
            return out
        where = self.stack[-1] if self.stack else LOSS_FN
        if off and where not in self.observed.dropout:
            self.observed.dropout.append(where)
        if next(tensor_leaves((args, kwargs)), None) is not None:  # computed, not a constant
            for _, t in tensor_leaves(out):  # on the gradient path (not a metric under no_grad)
                if t.is_floating_point() and t.dtype != torch.float64 and t.requires_grad:
                    self.observed.add(t.dtype, where)
        return out


def _dropout_off(func: Any, args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Set the probability of an active dropout call to 0 in place; was it active?"""
    (i, name, default), flag = _DROPOUT[func]
    p = args[i] if len(args) > i else kwargs.get(name, default)
    on = flag is None or (args[flag[0]] if len(args) > flag[0] else kwargs.get(*flag[1:]))
    if on and p:
        place: Any = args if len(args) > i else kwargs
        place[i if place is args else name] = 0.0
    return bool(on and p)


def finite(t: torch.Tensor) -> bool:
    """Every element of ``t`` is finite (integer tensors always are); records no graph (inside
    a checkpointed block, a recorded op would change what the recompute must save)."""
    return bool(torch.isfinite(t.detach()).all())


@contextlib.contextmanager
def observe(model: nn.Module) -> Iterator[Observed]:
    """Within the block, turn dropout off and record where (Note [dropout in check]), the
    operations that compute below float64 (Note [float32 islands]) and the first module whose
    output is not finite.

    Args:
        model: the float64 copy whose modules name where each operation ran.

    Returns:
        A context manager yielding the ``Observed`` it fills.
    """
    observed, stack = Observed(), list[str]()
    names = {m: name for name, m in model.named_modules()}

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        stack.pop()
        if observed.nonfinite is None and not all(finite(t) for _, t in tensor_leaves(out)):
            observed.nonfinite = names[module]

    with contextlib.ExitStack() as hooks, Watch(observed, stack):
        for m in names:
            hooks.enter_context(m.register_forward_pre_hook(lambda m, _: stack.append(names[m])))
            hooks.enter_context(m.register_forward_hook(leave, always_call=True))
        yield observed


def probe_coupling(
    work: nn.Module, run: Callable[[], Any], n: int, seeded: Callable[[], Any], rtol: float
) -> tuple[list[str], list[str]]:
    """Which modules of ``work`` couple the ``n`` samples of their input.

    Args:
        work: a model copy the probe may change.
        run: calls ``loss_fn`` on ``work`` and the batch (records every module's first call).
        n: samples in the batch.
        seeded: returns a context manager that seeds the RNG, for each replay alike.
        rtol: relative difference of sample 0's output counted as rounding.

    Returns:
        ``(coupled, unprobed)``: the innermost modules whose output for sample 0 changes with the
        other samples (a container of a BatchNorm is coupled through it), and those whose replay
        raised or did not repeat itself (Note [replay without caches]).
    """
    names, inputs = {m: name for name, m in work.named_modules()}, dict[nn.Module, dict[Any, Any]]()

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs.setdefault(module, {**dict(enumerate(args)), **kwargs})

    with contextlib.ExitStack() as hooks, seeded(), torch.no_grad():
        for m in names:
            hooks.enter_context(m.register_forward_pre_hook(record, with_kwargs=True))
        run()
    found: dict[str | None, list[str]] = {"coupled": [], "unprobed": [], None: []}
    for module, recorded in inputs.items():
        found[_replay(module, recorded, n, seeded, rtol)].append(names[module])
    return _innermost(found["coupled"]), _innermost(found["unprobed"])


def _innermost(names: list[str]) -> list[str]:
    """Leave out containers of other names (``""`` is the model, container of all)."""
    return [c for c in names if not any(o != c and (not c or o.startswith(c + ".")) for o in names)]


def _replay(
    module: nn.Module, recorded: dict[Any, Any], n: int, seeded: Callable[[], Any], rtol: float
) -> str | None:
    """``"coupled"``, ``"unprobed"``, or ``None`` (independent, or no batch-shaped input).

    ``recorded`` holds the call's arguments by position (int) and keyword (str).
    """
    where, x = next(((k, v) for k, v in recorded.items() if _batch_shaped(v, n)), (None, None))
    if x is None:
        return None

    def row_0(first: torch.Tensor) -> torch.Tensor | None:
        call = {
            k: v.clone() if isinstance(v, torch.Tensor) else None if is_kv_cache(v) else v
            for k, v in {**recorded, where: first}.items()
        }
        args = [call.pop(i) for i in range(len(call)) if i in call]
        with seeded(), torch.no_grad():
            out = module(*args, **call)
        return next((t[0] for _, t in tensor_leaves(out) if _batch_shaped(t, n)), None)

    try:
        a, b = row_0(x), row_0(torch.cat([x[:1], x[1:] * 1.7 + 0.3]))  # the others changed
        if a is None or b is None or _close(a, b, rtol):
            return None
        again = row_0(x)  # only a difference needs confirming: did the call change state?
    except Exception:  # not callable again on its recorded inputs: say so rather than fail check
        return "unprobed"
    return "coupled" if again is not None and _close(a, again, rtol) else "unprobed"


def _batch_shaped(value: Any, n: int) -> bool:
    is_float = isinstance(value, torch.Tensor) and value.is_floating_point()
    return is_float and value.dim() > 0 and value.shape[0] == n


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=1e-12, equal_nan=True)


Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Case:
    """What ``check`` was asked about: the model, the float64 batch, the loss, the micro-batch
    size compared and the seed of every run."""

    model: nn.Module
    batch: Batch
    loss_fn: LossFn
    size: int
    seed: int

    def sums(self, model: nn.Module, size: int) -> list[dict[str, tuple[float, float]]]:
        """``loss_fn``'s ``(loss_sum, count)`` per term (one ``"loss"`` term for a plain loss) on
        each piece of the batch cut at ``size`` (the last may be smaller), as floats, without
        gradients, each from the seed."""
        out = []
        for piece in split(self.batch, size):
            with seeded(self.seed), torch.no_grad():
                terms = as_terms(self.loss_fn(model, piece), batch_size(piece))
            out.append({k: (float(t.loss_sum), float(t.count)) for k, t in terms.items()})
        return out


@dataclass
class FullRun:
    """A full-batch run: the gradient of the mean loss, the loss, what was observed, and the
    names of the loss's terms when it returns named terms (else empty)."""

    grads: Grads
    loss: float
    observed: Observed
    terms: tuple[str, ...] = ()

    @property
    def finite(self) -> bool:
        """The loss and every gradient are finite."""
        return math.isfinite(self.loss) and all(finite(g) for g in self.grads.values())


def full_run(case: Case, checkpointing: bool = True) -> FullRun:
    """The full batch's gradient of the mean loss on a float64 copy, observed (``observe``).

    Args:
        checkpointing: keep the model's activation checkpointing (else disabled on the copy).

    Raises:
        ValueError: the loss carries no gradient, or none reaches a parameter.
    """
    work = copy_float64(case.model, checkpointing)
    with seeded(case.seed):
        with observe(work) as observed:
            out = case.loss_fn(work, case.batch)
        loss = mean_of(as_terms(out, batch_size(case.batch)))
        if not loss.requires_grad:
            raise ValueError(
                "loss_fn's loss does not depend on the model's parameters (no gradient): compute "
                "it from the model's outputs, without torch.no_grad(), .detach() or .item()."
            )
        loss.backward()
    grads = {n: p.grad.detach() for n, p in work.named_parameters() if p.grad is not None}
    if not grads:
        raise ValueError(
            "no gradient reaches any of the model's trainable parameters from loss_fn's loss: "
            "compute it from the outputs of the model passed to check, not another model's."
        )
    named = isinstance(out, Mapping) and not isinstance(case.loss_fn, WindowLoss)
    return FullRun(grads, float(loss.detach()), observed, tuple(out) if named else ())


def term_difference(case: Case, name: str) -> float:
    """The largest relative difference (``differences``) between the gradient ``train_step``
    accumulates from the named term ``name`` alone and the full batch's; 0 for a term that no
    gradient reaches (``full_run`` raises ``ValueError``)."""
    one = replace(case, loss_fn=functools.partial(_only, case.loss_fn, name))
    with contextlib.suppress(ValueError):
        full = full_run(one).grads
        return max(differences(accumulated_grads(one)[0], full).values(), default=0.0)
    return 0.0


def _only(loss_fn: LossFn, name: str, model: nn.Module, micro_batch: Batch) -> dict[str, Term]:
    """Term ``name`` of ``loss_fn``'s output alone, at weight 1."""
    term = as_terms(loss_fn(model, micro_batch), batch_size(micro_batch))[name]
    return {name: term._replace(weight=1.0)}


def accumulated_grads(case: Case) -> tuple[Grads, float]:
    """The gradient ``Accumulator.train_step`` steps with (captured by a recording optimizer),
    and the window's mean loss.

    A window the engine refuses as non-finite (``NonFiniteError``, a ``FloatingPointError``)
    gives NaN: ``check`` then says where the NaN comes from.
    """
    work = copy_float64(case.model)
    named = {p: name for name, p in work.named_parameters() if p.requires_grad}
    grads: Grads = {}
    recorder = torch.optim.SGD(list(named), lr=0.0)  # a step with lr 0 changes nothing
    recorder.register_step_pre_hook(
        lambda *_: grads.update({named[p]: p.grad.clone() for p in named if p.grad is not None})
    )
    with seeded(case.seed), warnings.catch_warnings():
        warnings.simplefilter("ignore", BigBatchWarning)  # check reports the cause itself
        try:
            acc = Accumulator(work, recorder, micro_batch_size=case.size)
            return grads, acc.train_step(case.batch, case.loss_fn).loss
        except FloatingPointError:
            return dict.fromkeys(named.values(), torch.full((), math.nan)), math.nan


def copy_float64(model: nn.Module, checkpointing: bool = True) -> nn.Module:
    """A float64 deep copy of ``model`` without gradients (without activation checkpointing
    unless ``checkpointing``)."""
    work = copy.deepcopy(model).double()
    work.zero_grad(set_to_none=True)
    return work if checkpointing else disable_checkpointing(work)


def differences(got: Grads, want: Grads) -> dict[str, float]:
    """Per parameter ``‖got − want‖ / max(‖want‖, 1e-6 ‖all of want‖)``.

    The floor keeps a gradient that is zero in exact arithmetic (a bias before a normalisation)
    from turning rounding noise into a relative difference of 1.
    """
    norm = torch.linalg.vector_norm
    floor = max(1e-6 * float(norm(torch.stack([norm(g) for g in want.values()]))), 1e-300)
    return {
        name: float(norm(got.get(name, torch.zeros_like(g)) - g)) / max(float(norm(g)), floor)
        for name, g in want.items()
    }


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Fork the global RNG (CPU and initialised CUDA devices), seed it, turn dropout off
    (Note [dropout in check]); restore the RNG afterwards.

    Only the generators forked are seeded: ``torch.manual_seed`` would also queue a lazy seed for
    every uninitialised device type, recording a stack trace each time (a third of check's time
    on a small model).
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), Watch():
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed_all(seed)
        yield

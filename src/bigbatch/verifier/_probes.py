"""What ``check`` learns by running a float64 copy of the model under observation.

Three probes, each a function over a model copy that ``check`` owns:

* ``observe_precision``: which operations of the float64 run really compute in a lower
  precision (float32 islands), and in which modules (Note [float32 islands]
    A model cast to float64 does not always compute in float64: transformers' RMSNorm and rotary
    embeddings (Llama, Mistral), GPT-Neo's attention and the ``labels=`` loss of every family
    cast to float32 on purpose. Their gradients then differ between a full batch and its
    micro-batches by float32 rounding (1e-7 relative on those families), far above float64's
    1e-10, although accumulation is exact. ``observe_precision`` watches every torch function
    called during the float64 forward and loss (a ``TorchFunctionMode``, public torch API) and
    records each call that returns a floating tensor below float64 from tensor arguments
    (constants made from Python numbers are not computation and do not count), with the
    innermost module it ran in. The lowest such dtype sets the tolerance, ``ROUNDING[dtype]``
    (1e-5 for float32: a hundred times the rounding measured, while a wrong loss or a coupled
    module differs by 1e-3 to 1), and ``check`` reports the dtype and the modules, so "exact"
    says how exact. Observing is used rather than a list of module classes: it finds islands in
    any model, including ones written after this note, and names them.

Note [replay without caches]
    ``probe_coupling`` records every module's first call and calls the module again with the
    recorded arguments. Arguments that are state mutated by the call must not be reused:
    transformers' key/value ``Cache`` objects grow on every call, so a replayed attention layer
    saw twice the sequence length and failed ("The size of tensor a (128) must match the size
    of tensor b (64)"). A replay therefore
    (1) passes ``None`` in place of every cache object (``is_cache``). Within one training
        forward that is what the layer computed with: its cache slot is empty until the layer
        fills it. A cache the caller filled beforehand (a prefix) is dropped too; both replays
        see the same arguments, so the comparison stays fair, and a layer that cannot run
        without it is reported as not probed (3);
    (2) clones every tensor argument, so a module working in place cannot alter a recording;
    (3) when sample 0's output changed with the other samples, runs the unperturbed input again;
        if that changes the output too (the call changed state that the next call reads: a
        counter, a cache not recognised), or when a replay raises, the module is reported as
        not probed instead of guessing.
    Rejected: ``use_cache=False`` in the copy's config (only transformers, bypassed by a
    ``loss_fn`` that passes ``use_cache=True``, and it changes a ``loss_fn`` that chains calls
    through ``past_key_values``); deep copies of the arguments at record time (a cache costs
    its whole size once per layer: quadratic in depth).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from bigbatch.core._tree import tensor_leaves

ROUNDING = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}
"""Relative gradient difference that computing partly in each dtype can make (~100 float32 ulps;
a few for the half types, whose rounding leaves check little to tell)."""

LOSS_FN = "loss_fn"
"""How ``Precision.where`` names operations run outside every module."""


@dataclass
class Precision:
    """The lowest precision a float64 run computed in, and where.

    Attributes:
        dtype: the lowest floating dtype an operation returned (``torch.float64`` if none).
        where: the innermost module (by name, ``""`` for the model itself) of each operation
            that computed in ``dtype``, or ``"loss_fn"`` outside the model; first-seen order.
    """

    dtype: torch.dtype = torch.float64
    where: list[str] = field(default_factory=list)

    def add(self, dtype: torch.dtype, where: str) -> None:
        """Record one operation that returned ``dtype``."""
        if torch.finfo(dtype).eps > torch.finfo(self.dtype).eps:
            self.dtype, self.where = dtype, []
        if dtype == self.dtype and where not in self.where:
            self.where.append(where)


class _LowPrecisionWatch(TorchFunctionMode):
    """Records calls whose floating results are below float64 (Note [float32 islands])."""

    def __init__(self, precision: Precision, stack: list[str]) -> None:
        super().__init__()
        self.precision, self.stack = precision, stack

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        low = [t.dtype for _, t in tensor_leaves(out) if _is_low(t)]
        if low and any(True for _ in tensor_leaves((args, kwargs))):
            where = self.stack[-1] if self.stack else LOSS_FN
            for dtype in set(low):
                self.precision.add(dtype, where)
        return out


def _is_low(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.dtype != torch.float64


@contextlib.contextmanager
def observe_precision(model: nn.Module) -> Iterator[Precision]:
    """Within the block, record the operations that compute below float64 (Note [float32 islands]).

    Args:
        model: the float64 copy whose modules name where each operation ran.

    Returns:
        A context manager yielding the ``Precision`` it fills.
    """
    precision, stack = Precision(), []
    names = {m: name for name, m in model.named_modules()}

    def enter(module: nn.Module, args: Any) -> None:
        stack.append(names[module])

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        stack.pop()

    hooks = [m.register_forward_pre_hook(enter) for m in names]
    hooks += [m.register_forward_hook(leave, always_call=True) for m in names]
    try:
        with _LowPrecisionWatch(precision, stack):
            yield precision
    finally:
        for h in hooks:
            h.remove()


@dataclass
class Coupling:
    """What ``probe_coupling`` found.

    Attributes:
        coupled: innermost modules whose output for sample 0 changes with the other samples.
        unprobed: innermost modules whose replay raised or did not repeat itself
            (Note [replay without caches]).
    """

    coupled: list[str]
    unprobed: list[str]


Recorded = tuple[tuple[Any, ...], dict[str, Any]]


def probe_coupling(
    work: nn.Module, run: Callable[[], Any], n: int, seeded: Callable[[], Any], rtol: float
) -> Coupling:
    """Which modules of ``work`` couple the ``n`` samples of their input.

    Args:
        work: a model copy the probe may change.
        run: calls ``loss_fn`` on ``work`` and the batch (records every module's first call).
        n: samples in the batch.
        seeded: returns a context manager that seeds the RNG, for each replay alike.
        rtol: relative difference of sample 0's output counted as rounding.

    Returns:
        The ``Coupling``: coupled modules (innermost only: a container of a BatchNorm is coupled
        through it) and modules that could not be probed.
    """
    names = {m: name for name, m in work.named_modules()}
    inputs: dict[nn.Module, Recorded] = {}

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs.setdefault(module, (args, kwargs))

    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in names]
    try:
        with seeded(), torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    found: dict[str, list[str]] = {"coupled": [], "unprobed": []}
    for module, recorded in inputs.items():
        verdict = _replay(module, recorded, n, seeded, rtol)
        if verdict is not None:
            found[verdict].append(names[module])
    return Coupling(_innermost(found["coupled"]), _innermost(found["unprobed"]))


def _innermost(names: list[str]) -> list[str]:
    """Leave out containers of other names (``""`` is the model, container of all)."""
    return [
        c for c in names if not any(o != c and (c == "" or o.startswith(c + ".")) for o in names)
    ]


def _replay(
    module: nn.Module, recorded: Recorded, n: int, seeded: Callable[[], Any], rtol: float
) -> str | None:
    """``"coupled"``, ``"unprobed"``, or ``None`` (independent, or no batch-shaped input)."""
    args, kwargs = recorded
    where = _probe_position(args, kwargs, n)
    if where is None:
        return None
    x = _argument(args, kwargs, where)
    other = x.clone()
    other[1:] = x[1:] * 1.7 + 0.3

    def row_0(first: torch.Tensor) -> torch.Tensor | None:
        call_args, call_kwargs = _fresh(args, kwargs, where, first)
        with seeded(), torch.no_grad():
            return _first_rows(module(*call_args, **call_kwargs), n)

    try:
        a, b = row_0(x), row_0(other)
        if a is None or b is None or _close(a, b, rtol):
            return None
        again = row_0(x)  # only a difference needs confirming: did the call change state?
    except Exception:  # not callable again on its recorded inputs: say so rather than fail check
        return "unprobed"
    return "coupled" if again is not None and _close(a, again, rtol) else "unprobed"


Position = tuple[str, int | str]


def _probe_position(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> Position | None:
    """Where the first floating tensor with ``n`` rows is: positional index or keyword."""
    candidates: list[tuple[Position, Any]] = [(("args", i), a) for i, a in enumerate(args)]
    candidates += [(("kwargs", k), v) for k, v in kwargs.items()]
    for where, value in candidates:
        if (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.dim()
            and value.shape[0] == n
        ):
            return where
    return None


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], where: Position) -> torch.Tensor:
    kind, key = where
    return args[key] if kind == "args" else kwargs[key]  # type: ignore[index]


def _fresh(
    args: tuple[Any, ...], kwargs: dict[str, Any], where: Position, first: torch.Tensor
) -> tuple[list[Any], dict[str, Any]]:
    """The recorded arguments for one replay: tensors cloned, caches dropped, the probe in place."""
    call_args = [_fresh_value(a) for a in args]
    call_kwargs = {k: _fresh_value(v) for k, v in kwargs.items()}
    kind, key = where
    if kind == "args":
        call_args[key] = first.clone()  # type: ignore[index]
    else:
        call_kwargs[key] = first.clone()  # type: ignore[index]
    return call_args, call_kwargs


def _fresh_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    return None if is_cache(value) else value


def is_cache(value: Any) -> bool:
    """Is ``value`` a transformers key/value cache (Note [replay without caches])?

    Read from ``sys.modules``: a model that holds such a cache has imported transformers, and
    ``import bigbatch`` must not import it.
    """
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(cache_utils, "Cache", None)
    return isinstance(cache_type, type) and isinstance(value, cache_type)


def _first_rows(out: Any, n: int) -> torch.Tensor | None:
    for _, t in tensor_leaves(out):
        if t.dim() and t.shape[0] == n and t.is_floating_point():
            return t[0]
    return None


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=1e-12, equal_nan=True)


def first_nonfinite_output(work: nn.Module, run: Callable[[], Any]) -> str | None:
    """The first module (by name, in the order calls finish) whose output holds NaN or inf.

    Args:
        work: the model copy ``run`` calls.
        run: calls ``loss_fn`` on ``work`` and the batch.

    Returns:
        The module's name (``""`` for the model itself), or ``None`` when every output is finite.
    """
    names = {m: name for name, m in work.named_modules()}
    found: list[str] = []

    def watch(module: nn.Module, args: Any, out: Any) -> None:
        if not found and any(
            t.is_floating_point() and not bool(torch.isfinite(t).all())
            for _, t in tensor_leaves(out)
        ):
            found.append(names[module])

    hooks = [m.register_forward_hook(watch) for m in names]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return found[0] if found else None

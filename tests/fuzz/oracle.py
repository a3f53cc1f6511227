"""The one oracle: bigbatch's step equals the plain float64 full-batch step (tests/reference.py) to
1e-10 relative on the parameters, or bigbatch refuses with a ValueError / TypeError whose message
names the offending argument or key (and changes nothing).

Each way to fail is its own exception class, raised from its own line, so that hypothesis
reports distinct faults of one property separately (``report_multiple_bugs``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cases
import torch
from reference import full_batch_step

import bigbatch

TOLERANCE = 1e-10
# AdamW's first step moves a parameter by lr * g / (|g| + eps): a gradient component near 0 carries
# its float64 rounding (~1e-16 of the gradient's scale) amplified by lr / eps, 1e6 at eps=1e-8,
# which reaches the tolerance on its own (found: 1.03e-10 with two samples). At eps=1e-6 the
# amplification is 1e4, and a normalisation fault (a relative error of 1e-3 or more) still shows.
OPTIMIZERS = {
    **cases.OPTIMIZERS,
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, eps=1e-6),
}


@dataclass(frozen=True)
class Expect:
    """``names``: what a refusal of the case may name (none: the case must step);
    ``must_refuse``: the case is bad input (a step, exact or not, fails); ``warns``: a step
    must come with a ``BigBatchWarning`` (a window with no item, a term left out)."""

    names: frozenset[str] = frozenset()
    must_refuse: bool = False
    warns: bool = False


class SilentWrongStep(AssertionError):
    """No error, and the parameters are off the full batch's."""


class SilentStepOnBadInput(AssertionError):
    """Input that must be refused (it defines no step) was trained on, silently."""


class UnnamedRefusal(AssertionError):
    """A ValueError / TypeError that names none of the arguments or keys at fault."""


class RawError(AssertionError):
    """Another exception (torch's, Python's): nothing says which argument is at fault."""


class RefusedValidInput(AssertionError):
    """A refusal of a case that the full batch trains on (and nothing in it is refusable)."""


class ChangedOnRefusal(AssertionError):
    """A refused step left the parameters or gradients changed."""


class NoWarning(AssertionError):
    """A window with no item, or a term left out, stepped without a BigBatchWarning."""


def reference(
    init: torch.nn.Module,
    optimizer: str,
    loss_fn: Callable[[torch.nn.Module, Any], Any],
    windows: list,
) -> torch.nn.Module:
    """The plain full-batch steps from ``init``, one per window: the model after them."""
    model = copy.deepcopy(init)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for batch in windows:
        full_batch_step(model, opt, loss_fn, batch)
    return model


def floored_error(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """``max_relative_error``, each tensor's norm floored at 1e-8 of the largest: a parameter
    that stays 0 but for rounding (a final LayerNorm's bias whose gradients cancel exactly, found
    at 1e-19 on both sides, 3.05 "relative" apart) is compared as the model's rounding."""
    floor = 1e-8 * max(float(torch.linalg.vector_norm(p.detach())) for p in a.parameters())
    worst = 0.0
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        diff = float(torch.linalg.vector_norm(pa.detach() - pb.detach()))
        worst = max(worst, diff / max(float(torch.linalg.vector_norm(pa.detach())), floor, 1e-30))
    return worst


def judge(
    expect: Expect,
    expected: torch.nn.Module,
    run: Callable[[], Any],
    tolerance: float = TOLERANCE,
    error: Callable[[torch.nn.Module, torch.nn.Module], float] = floored_error,
) -> None:
    """Run ``run()`` (bigbatch's side: the trained model) and hold it to the oracle: the
    parameters of ``expected`` (the full batch's model) within ``tolerance`` (``error`` measures
    how far: by default relative to each parameter), or a refusal ``expect`` allows."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = run()
        except (ValueError, TypeError) as exc:
            message = f"{type(exc).__name__}: {exc}"
            if not expect.names:
                raise RefusedValidInput(
                    f"refused a case the full batch trains on: {message}"
                ) from exc
            if not any(name in str(exc) for name in expect.names):
                raise UnnamedRefusal(f"{message}\n(names none of {sorted(expect.names)})") from exc
            return
        except (AssertionError, KeyboardInterrupt):
            raise
        except Exception as exc:
            raise RawError(f"{type(exc).__name__}: {exc}") from exc
    if expect.must_refuse:
        names = sorted(expect.names)
        raise SilentStepOnBadInput(f"stepped on input that must be refused, naming one of {names}")
    off = error(expected, model)
    if not off < tolerance:
        raise SilentWrongStep(f"parameters {off:.3g} (relative) off the full-batch step")
    if expect.warns and not any(issubclass(w.category, bigbatch.BigBatchWarning) for w in caught):
        raise NoWarning(
            "stepped without a BigBatchWarning (a window with no item, a term left out)"
        )


@contextlib.contextmanager
def unchanged_on_refusal(model: torch.nn.Module) -> Iterator[None]:
    """A ValueError / TypeError inside must leave the parameters and their gradients as they were."""
    before = [p.detach().clone() for p in model.parameters()]
    try:
        yield
    except (ValueError, TypeError) as exc:
        params = list(model.parameters())
        moved = any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
        if moved or any(p.grad is not None for p in params):
            raise ChangedOnRefusal(
                f"refused ({exc}) but changed the model or left gradients"
            ) from exc
        raise

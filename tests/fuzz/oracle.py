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

import torch
from cases import OPTIMIZERS
from reference import full_batch_step, max_relative_error

import bigbatch

TOLERANCE = 1e-10


@dataclass(frozen=True)
class Expect:
    """``names``: what a refusal of the case may name (none: the case must step);
    ``must_refuse``: the case is bad input (a step, exact or not, fails)."""

    names: frozenset[str] = frozenset()
    must_refuse: bool = False


class Undefined(Exception):
    """The full batch's loss is not defined: terms with no items but a nonzero sum."""

    def __init__(self, names: list[Any]) -> None:
        super().__init__(names)
        self.names = names


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
    """A window with no item to average over stepped without a BigBatchWarning."""


def reference(
    init: torch.nn.Module,
    optimizer: str,
    loss_fn: Callable[[torch.nn.Module, Any], Any],
    windows: list,
) -> tuple[torch.nn.Module | None, list[str]]:
    """The plain full-batch steps, one per window: ``(model after, names of undefined terms)``
    (``None`` and the names when a window's loss has a term with no item but a nonzero sum)."""
    model = copy.deepcopy(init)
    opt = OPTIMIZERS[optimizer](model.parameters())
    try:
        for batch in windows:
            full_batch_step(model, opt, loss_fn, batch)
    except Undefined as exc:
        return None, [repr(str(name)) for name in exc.names]
    return model, []


def judge(
    expect: Expect, expected: torch.nn.Module | None, undefined: list[str], run: Callable[[], Any],
    empty_window: bool = False,
) -> None:  # fmt: skip
    """Run ``run()`` (bigbatch's side: the trained model) and hold it to the oracle against
    ``expected`` (the full batch's model; ``None``: undefined, then ``undefined`` names the terms
    a refusal must name). ``empty_window``: some window had no item at all; the full batch takes
    a zero-gradient step there, and bigbatch must warn."""
    names = set(expect.names) | set(undefined)
    must_refuse = expect.must_refuse or expected is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = run()
        except (ValueError, TypeError) as exc:
            message = f"{type(exc).__name__}: {exc}"
            if not names:
                raise RefusedValidInput(
                    f"refused a case the full batch trains on: {message}"
                ) from exc
            if not any(name in str(exc) for name in names):
                raise UnnamedRefusal(f"{message}\n(names none of {sorted(names)})") from exc
            return
        except (AssertionError, KeyboardInterrupt):
            raise
        except Exception as exc:
            raise RawError(f"{type(exc).__name__}: {exc}") from exc
    if must_refuse:
        raise SilentStepOnBadInput(
            f"stepped on input that must be refused, naming one of {sorted(names)}"
        )
    assert expected is not None
    error = max_relative_error(expected, model)
    if not error < TOLERANCE:
        raise SilentWrongStep(f"parameters {error:.3g} (relative) off the full-batch step")
    if empty_window and not any(issubclass(w.category, bigbatch.BigBatchWarning) for w in caught):
        raise NoWarning("a window with no item stepped without a BigBatchWarning")


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

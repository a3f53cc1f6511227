"""``assert_refused``: a call refused in one line, and nothing changed by it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch


@contextlib.contextmanager
def assert_refused(
    model: torch.nn.Module, error: Any = (ValueError, TypeError), match: str | None = None
) -> Iterator[Any]:
    """The block raises ``error`` matching ``match`` (``pytest.raises``) and leaves ``model`` as
    it was: every parameter and buffer bitwise equal, no gradient in any ``.grad``."""
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match) as raised:
        yield raised
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "the refusal changed the model"
    assert all(p.grad is None for p in model.parameters()), "the refusal left a gradient"

"""Random-generator state: save it, put it back, seed it. One place for every module that must.

Two scopes:

* ``capture(device)`` / ``restore(state, device)``: torch's CPU generator and the CUDA generator of
  ``device``, what a window's forwards draw from (dropout). The engine restores them before it
  redoes a window, so the redone window draws the same masks as the first attempt.
* ``capture_all()`` / ``restore_all(state)``: every generator a training run may draw from (torch
  CPU, every CUDA device, numpy's global generator, Python's ``random``), as plain tensors, lists
  and numbers so that a snapshot holding them loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import torch

RngState = tuple[torch.Tensor, torch.Tensor | None]
"""torch's CPU generator state and the CUDA device's (``None`` on the CPU)."""


def capture(device: torch.device) -> RngState:
    """The state of torch's CPU generator and of ``device``'s CUDA generator."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def restore(state: RngState, device: torch.device) -> None:
    """Put back what ``capture(device)`` saved."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def capture_all() -> dict[str, Any]:
    """Every random generator's state: torch CPU and CUDA, numpy (if installed), Python."""
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": (version, list(internal), gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    with contextlib.suppress(ImportError):
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]  # legacy
        # Plain lists, not arrays: the snapshot then loads with torch.load(weights_only=True).
        state["numpy"] = (str(kind), list(map(int, keys)), int(pos), int(has_gauss), float(cached))
    return state


def restore_all(state: dict[str, Any]) -> None:
    """Put back what ``capture_all`` saved."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy's global generator (if installed) and Python's ``random``."""
    torch.manual_seed(seed)
    random.seed(seed)
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed % 2**32)

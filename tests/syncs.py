"""Count the host reads of device values a piece of code makes: on a GPU each one waits for the device.

``HostReads`` is a ``TorchFunctionMode``: every tensor method that hands a value to Python
(``item``, ``tolist``, ``bool(t)``, ``float(t)``, ``int(t)``, ``torch.equal``, ``nonzero``, a copy
to the CPU) passes through it and is counted, with the Python line that made it. The optimizer's
own ``step`` is not counted (``pause_during``): PyTorch's CPU AdamW reads its step counter, which
lives on the host on a GPU too, and a hand-written loop pays the same.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "equal", "nonzero",
         "cpu", "numpy", "is_nonzero", "allclose"}  # fmt: skip


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...``; ``reads.count``, ``reads.where`` (file:line of each)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []
        self.paused = False

    @property
    def count(self) -> int:
        return len(self.where)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused and getattr(func, "__name__", "") in READS:
            caller = traceback.extract_stack(limit=3)[0]
            self.where.append(f"{func.__name__} at {caller.filename}:{caller.lineno}")
        return func(*args, **(kwargs or {}))

    def pause_during(self, optimizer: torch.optim.Optimizer) -> None:
        """Do not count what ``optimizer.step()`` reads (the optimizer's own business)."""
        optimizer.register_step_pre_hook(lambda *_: setattr(self, "paused", True))
        optimizer.register_step_post_hook(lambda *_: setattr(self, "paused", False))

"""Recognising out-of-memory errors: the one place in bigbatch that inspects an exception.

Only real allocator failures count, so that auto micro-batch never hides a genuine bug:

* ``torch.OutOfMemoryError`` (CUDA's ``torch.cuda.OutOfMemoryError`` is the same class),
* the CPU allocator's failure, which torch raises as a plain ``RuntimeError`` whose text holds
  ``DefaultCPUAllocator: can't allocate memory``,
* ``MemoryBudgetExceeded``, raised by bigbatch itself when a step went over ``memory_budget``,
* a ``RuntimeError`` holding ``CUDA error: out of memory`` (a CUDA library, e.g. cuBLAS,
  failing to allocate outside the caching allocator),
* any of these as the ``__cause__`` / ``__context__`` of another exception (a wrapper
  re-raising it; a context hidden by ``raise ... from None`` is not followed), but never a
  ``RuntimeError`` that merely mentions memory.
"""

from __future__ import annotations

import gc

import torch

_ALLOCATOR_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "CUDA error: out of memory")


class MemoryBudgetExceeded(RuntimeError):
    """A step used more memory than the ``memory_budget`` it was given.

    Attributes:
        micro_batch_size, used_bytes, budget_bytes: what went over, when the raiser knows
            (``None`` otherwise), for callers that word their own advice (the trainer's flags).
    """

    def __init__(
        self,
        message: str,
        *,
        micro_batch_size: int | None = None,
        used_bytes: int | None = None,
        budget_bytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.micro_batch_size, self.used_bytes = micro_batch_size, used_bytes
        self.budget_bytes = budget_bytes


_OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryBudgetExceeded, MemoryError)


def is_out_of_memory(exc: BaseException) -> bool:
    """Return ``True`` if ``exc`` (or what caused it) is a real out-of-memory error.

    Example:
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
        True
        >>> is_out_of_memory(RuntimeError("shape mismatch"))
        False
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current) if isinstance(current, RuntimeError) else ""
        if isinstance(current, _OUT_OF_MEMORY) or any(t in text for t in _ALLOCATOR_FAILURES):
            return True
        hidden = current.__suppress_context__ and current.__cause__ is None
        current = current.__cause__ or (None if hidden else current.__context__)
    return False


def release_memory(device: torch.device) -> None:
    """Give back what a failed micro-batch left behind: collect garbage, empty the CUDA cache.

    Call it *after* leaving the ``except`` block: while the exception is alive its traceback
    pins the failed step's tensors (pytorch/pytorch#18853).
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

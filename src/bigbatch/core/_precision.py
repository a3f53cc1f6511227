"""Numerical precision of a step: an autocast context plus, for fp16, a gradient scaler.

One small object chosen once from ``precision=`` (no ``if precision == ...`` in the engine).

Note [fp16 and accumulation]
    Following the PyTorch AMP notes, the scale stays constant during the window: every
    micro-batch back-propagates ``scale * loss_sum``; the gradients are unscaled exactly once,
    just before clipping and the optimizer step; inf/NaN checks, step skipping and the scale
    update happen once per optimizer step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from bigbatch.core.split import check_choice

PRECISIONS = ("fp32", "bf16", "fp16")
_NULL = contextlib.nullcontext()  # reusable: it holds no state


@dataclass
class Precision:
    """Autocast dtype and optional ``GradScaler`` for one device type."""

    name: str
    device_type: str
    scaler: Any = None  # torch.amp.GradScaler for fp16, else None
    autocast_dtype: torch.dtype | None = field(init=False)  # None: no autocast (fp32)

    def __post_init__(self) -> None:
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Run the forward pass in this precision (no-op for fp32)."""
        dtype = self.autocast_dtype
        return torch.autocast(self.device_type, dtype) if dtype else _NULL

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (scaled for fp16), outside autocast as PyTorch recommends."""
        with torch.autocast(self.device_type, enabled=False) if self.autocast_dtype else _NULL:
            (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale, once per step (no-op without a scaler)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any] | None:
        """The loss scaler's state (``None`` without a scaler)."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore ``state_dict``'s result.

        Raises:
            ValueError: a scaler state for a precision without one, or the other way round.
        """
        if (state is None) != (self.scaler is None):
            saved = "fp16 (a loss scaler)" if state is not None else "no loss scaler"
            raise ValueError(
                f"the state was saved with {saved}; this Accumulator uses precision="
                f"{self.name!r}: build it with the precision the state was saved with."
            )
        if self.scaler is not None:
            self.scaler.load_state_dict(state)

    def discard(self) -> None:
        """Forget a window that will not step: the scaler may have unscaled its gradients.

        GradScaler refuses a second ``unscale_`` before ``update()``; a discarded window never
        reaches ``update()``, so its per-optimizer record is dropped (the scale is unchanged).
        """
        if self.scaler is not None:
            self.scaler._per_optimizer_states.clear()  # no public reset; the scale is kept

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer``; return ``True`` if the scaler skipped it for inf/NaN gradients."""
        if self.scaler is None:
            optimizer.step()
            return False
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # GradScaler lowers its scale exactly when it found inf/NaN and skipped the step.
        return bool(self.scaler.get_scale() < scale_before)


def make_precision(precision: object, device: torch.device) -> Precision:
    """Build the ``Precision`` for ``precision`` ("fp32" | "bf16" | "fp16") on ``device``; an
    object with ``Precision``'s methods is an integration's own (Keras' loss scaling) and is used
    as it is.

    Raises:
        ValueError: an unknown precision name.
    """
    if all(hasattr(precision, a) for a in ("autocast", "backward", "step", "unscale_")):
        return precision  # type: ignore[return-value]  # duck-typed: Precision's methods
    check_choice("precision", precision, PRECISIONS)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    return Precision(str(precision), device.type, scaler)

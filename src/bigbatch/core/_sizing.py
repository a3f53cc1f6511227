"""How a window is cut: a micro-batch sizing policy, chosen once when the ``Accumulator`` is built.

One ``Sizing`` object behind a small interface (``size_for`` / ``after_oom`` / ``after_success``
and ``state_dict``), so the engine never branches on ``"auto"``:

* ``Sizing(8)``: every window is cut at 8 samples; an out-of-memory error is raised to the
  caller (``retries`` is ``False``) after the window is discarded.
* ``Sizing("auto")``: Note [auto micro-batch]: the first window runs whole, an out-of-memory
  error shrinks the size and the same window is redone, later windows probe back up. Its
  decisions are pure functions over an explicit ``AutoState`` (``size_for``, ``after_oom``,
  ``after_success``: no model); this object only holds that state (a fixed size is an
  ``AutoState`` that never moves).

``WindowMeter`` measures one attempt of a window: it enforces ``memory_budget`` after every
micro-batch (``MemoryBudgetExceeded``, which auto mode treats like an out-of-memory error) and
gives the attempt's peak, so a step that was redone reports the peak of the attempt that
succeeded, not of the one that ran out of memory.

Note [auto micro-batch]
    The first window runs whole (micro-batch = the logical batch). An out-of-memory error in
    a window halves the micro-batch (or, when a smaller size already completed a window, goes
    back to that size) and the same window is redone; the size that failed becomes a ceiling
    that is never tried again. After ``grow_after`` clean windows the size probes half-way
    towards the ceiling, so the search ends at the largest size that fits (a binary search
    spread over steps between the largest size known to fit and the smallest known to fail)
    instead of staying at the first power-of-two fraction that happened to fit. The effective
    batch never changes: only how it is cut.

Note [re-measure before shrinking]
    A ``memory_budget`` overrun is a reading, not an allocator failure, and readings right after
    a failed attempt, or in the first step of a fresh process (a resumed run), carry pages that
    a warm process does not need. So an overrun at a size that has already completed a window
    is re-measured once in a fresh attempt of the same window before the size is given up;
    only a second overrun shrinks it. That holds for the size a failed growth probe falls back
    to as well: its first reading is the one taken right after the probe. Real allocator
    failures shrink at once. This keeps a size that works, and lets a resumed run take the same
    decisions as an uninterrupted one. (A window re-measures at most once: the re-measured size
    is the largest known to fit, and a second overrun there forgets it.)
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from bigbatch.core._units import format_bytes, parse_bytes
from bigbatch.core.oom import MemoryBudgetExceeded
from bigbatch.core.peak import PeakMemory, PeakProbe, fix_mmap_threshold
from bigbatch.core.split import check_micro_batch_size


@dataclass(frozen=True)
class AutoState:
    """Where the search for the largest micro-batch stands.

    Attributes:
        size: micro-batch to use next; ``None`` before the first window (use the whole batch).
        ceiling: smallest size known to run out of memory; ``None`` if none has.
        clean_windows: windows completed since the size last changed.
        fits: largest size known to have completed a window; ``None`` if none has.
        rechecked: the current window already re-measured a budget overrun (Note [re-measure
            before shrinking]).
    """

    size: int | None = None
    ceiling: int | None = None
    clean_windows: int = 0
    fits: int | None = None
    rechecked: bool = False


def size_for(state: AutoState, n_samples: int, floor: int = 1) -> int:
    """Micro-batch size to use for a window of ``n_samples`` samples (or tokens), at least
    ``floor`` (one sample: the longest sample's length for a token budget)."""
    size = n_samples if state.size is None else state.size
    if state.ceiling is not None:
        size = min(size, state.ceiling - 1)
    return max(floor, 1, min(size, n_samples))


def after_oom(
    state: AutoState,
    failed_size: int,
    measured: bool = False,
    floor: int = 1,
    name: str = "micro_batch_size",
    used: int | None = None,
) -> AutoState:
    """The window ran out of memory at ``failed_size``: shrink and lower the ceiling.

    The next size is the largest one known to fit if it is below ``failed_size`` (a failed
    growth probe goes back to it), else half of ``failed_size``. A ``measured`` failure (over
    the memory budget, not an allocator failure) at a size that already fit is tried once more
    first (Note [re-measure before shrinking]).

    Raises:
        MemoryError: ``failed_size`` was already ``floor`` (one sample per micro-batch: 1, or the
            longest sample's tokens for ``name="micro_batch_tokens"``); nothing smaller exists.
            ``used``: what that attempt used, over the budget (said in the message).
    """
    if measured and failed_size <= (state.fits or 0) and not state.rechecked:  # a size that fit
        return replace(state, rechecked=True)
    if failed_size <= max(1, floor):
        one = "" if floor <= 1 else f" (one sample per micro-batch: the longest has {floor} tokens)"
        took = "" if used is None else f" (it used {format_bytes(used)})"
        raise MemoryError(
            f"out of memory (or over memory_budget) with {name}={failed_size}{one}: a single "
            f"sample does not fit{took}. Free memory, raise memory_budget, enable gradient "
            "checkpointing (bigbatch.enable_checkpointing(model)), for a language model compute "
            "its loss with the chunked head (bigbatch.head_cross_entropy, --chunked-head), or use "
            "a smaller model or sequence length."
        )
    ceiling = failed_size if state.ceiling is None else min(state.ceiling, failed_size)
    fits = state.fits if state.fits is not None and state.fits < failed_size else None
    size = fits if fits is not None else max(1, floor, failed_size // 2)
    # A fallback to a size that fit may re-measure once (Note [re-measure before shrinking]).
    return AutoState(size=size, ceiling=ceiling, clean_windows=0, fits=fits, rechecked=False)


def after_success(state: AutoState, used_size: int, grow_after: int = 10) -> AutoState:
    """A window completed at ``used_size``; maybe probe a larger size."""
    fits = used_size if state.fits is None else max(state.fits, used_size)
    if state.size is None:
        return AutoState(size=used_size, ceiling=state.ceiling, fits=fits)
    clean = state.clean_windows + 1
    # Grow half-way to the ceiling when there is room, and only when the window was really cut at
    # the current size (a short last batch says nothing).
    bigger = state.size if state.ceiling is None else (state.size + state.ceiling) // 2
    if clean >= grow_after and used_size == state.size < bigger:
        return AutoState(size=bigger, ceiling=state.ceiling, fits=fits)
    return replace(state, clean_windows=clean, fits=fits, rechecked=False)


class Sizing:
    """The micro-batch sizing policy: a fixed size, or ``"auto"`` (see the module docstring).

    Args:
        size: a positive integer, or ``"auto"``.
        name: the setting's name, for messages (``micro_batch_size`` / ``micro_batch_tokens``).

    Raises:
        TypeError, ValueError: neither a positive integer nor ``"auto"`` (the message says so).
    """

    def __init__(self, size: object, name: str = "micro_batch_size") -> None:
        self.name, self.retries = name, size == "auto"  # retries: redo a window that ran out
        self.state = AutoState(size=None if self.retries else check_micro_batch_size(size, name))

    def size_for(self, n_samples: int, floor: int = 1) -> int:
        """Samples (or tokens) per micro-batch for a window of ``n_samples``; a fixed size
        ignores ``floor`` (a sample longer than a token budget gets a micro-batch of its own)."""
        return size_for(self.state, n_samples, floor if self.retries else 1)

    def after_oom(
        self, failed_size: int, measured: bool = False, floor: int = 1, used: int | None = None
    ) -> None:
        """The window ran out of memory at ``failed_size`` (only called when ``retries``);
        ``measured``: over the memory budget (``used`` bytes), not an allocator failure."""
        self.state = after_oom(self.state, failed_size, measured, floor, self.name, used)

    def after_success(self, used_size: int) -> None:
        """A window completed at ``used_size``."""
        if self.retries:
            self.state = after_success(self.state, used_size)

    def state_dict(self) -> dict[str, Any]:
        """What must be saved to take the same decisions after a restart."""
        fixed = {"policy": "fixed", "name": self.name, "size": self.state.size}
        return (
            {"policy": "auto", "name": self.name, **asdict(self.state)} if self.retries else fixed
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s result.

        Raises:
            ValueError: saved with the other policy, or with another fixed size.
        """
        found, policy = state.get("policy"), "auto" if self.retries else "fixed"
        name = state.get("name", self.name)  # (states saved before the name was kept: as ours)
        if name != self.name:
            size = '"auto"' if found == "auto" else state.get("size")
            raise ValueError(
                f"the state was saved with {name}={size} (the window cut by "
                f"{'tokens' if name == 'micro_batch_tokens' else 'samples'}), this Accumulator "
                f"sizes {self.name}: build it with {name}={size} to load it."
            )
        if found != policy:
            size = '"auto"' if found == "auto" else state.get("size")
            raise ValueError(
                f"the state was saved with a {found} micro-batch size, this Accumulator uses a "
                f"{policy} one: build it with micro_batch_size={size} to load it."
            )
        if not self.retries and state["size"] != self.state.size:
            raise ValueError(
                f"the state holds {self.name}={state['size']}, this Accumulator uses "
                f"{self.state.size}: build it with {self.name}={state['size']} to load it."
            )
        self.state = AutoState(**{k: v for k, v in state.items() if k not in ("policy", "name")})


class WindowMeter:
    """Peak memory of one attempt of a window, checked against ``budget`` after every micro-batch.

    Measuring costs a reset of the peak counter per attempt (on the CPU: a ``malloc_trim`` and a
    write to ``/proc/self/clear_refs``), so it only runs with a budget or when ``always``.

    Args:
        device: where the window runs.
        budget: what a window may add (``"6GiB"``, bytes: ``parse_bytes``); ``None``: no budget.
        always: auto mode: measure even without a budget (to report the adopted attempt's
            peak), and when a budget is below ``gradient_bytes`` say so at the first overrun
            instead of shrinking to one sample first.
        optimizer: whose trainable parameters' gradients (``gradient_bytes``) are the part of
            every window no micro-batch size can shrink.

    Raises:
        ValueError: ``budget`` is not a size (``parse_bytes``).
    """

    def __init__(self, device: torch.device, budget: object, always: bool, optimizer: Any) -> None:
        self.budget, self.auto = parse_bytes(budget), always
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in params)
        self._probe = PeakProbe(device) if self.budget is not None or always else None
        self._record: PeakMemory | None = None
        if self.budget is not None and device.type == "cpu":
            fix_mmap_threshold()  # Note [honest CPU peaks]: a failed attempt's pages leave
            gc.collect()  # ... and garbage from before the run is not freed inside a window

    def start(self) -> None:
        """Begin measuring an attempt."""
        if self._probe is not None:
            self._record = self._probe.reset()

    def check(self, micro_batch_size: int) -> None:
        """Raise ``MemoryBudgetExceeded`` when the attempt went over the budget."""
        if self.budget is None or self._probe is None or self._record is None:
            return
        used = self._probe.peak_bytes(self._record)
        if used > self.budget and self.auto and self.gradient_bytes >= self.budget:
            budget, grads, now = map(format_bytes, (self.budget, self.gradient_bytes, used))
            raise ValueError(
                f"memory_budget={budget} is below what any micro-batch needs: the gradients alone "
                f"take {grads} in every window (this attempt used {now}; the trained parameters "
                f"({grads}) and the optimizer state, already in use, are not counted). Raise the "
                "budget (--memory-budget) above the gradients plus one sample's activations, "
                "train fewer parameters, or use a lower precision."
            )
        if used > self.budget:
            raise MemoryBudgetExceeded(
                f"micro_batch_size={micro_batch_size} used {format_bytes(used)}, over "
                f'memory_budget={format_bytes(self.budget)}; use micro_batch_size="auto" '
                "(--micro-batch-size auto), a smaller micro-batch or a larger budget.",
                micro_batch_size=micro_batch_size,
                used_bytes=used,
                budget_bytes=self.budget,
            )

    def peak_bytes(self) -> int | None:
        """The attempt's peak above its start, or ``None`` when not measured."""
        if self._probe is None or self._record is None:
            return None
        return self._probe.finish(self._record).peak_bytes

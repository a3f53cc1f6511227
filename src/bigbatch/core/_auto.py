"""Automatic micro-batch sizing: pure decisions over an explicit state, no model.

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

from dataclasses import dataclass, replace


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
) -> AutoState:
    """The window ran out of memory at ``failed_size``: shrink and lower the ceiling.

    The next size is the largest one known to fit if it is below ``failed_size`` (a failed
    growth probe goes back to it), else half of ``failed_size``. A ``measured`` failure (over
    the memory budget, not an allocator failure) at a size that already fit is tried once more
    first (Note [re-measure before shrinking]).

    Raises:
        MemoryError: ``failed_size`` was already ``floor`` (one sample per micro-batch: 1, or the
            longest sample's tokens for ``name="micro_batch_tokens"``); nothing smaller exists.
    """
    known_good = state.fits is not None and failed_size <= state.fits
    if measured and known_good and not state.rechecked:
        return replace(state, rechecked=True)
    if failed_size <= max(1, floor):
        one = "" if floor <= 1 else f" (one sample per micro-batch: the longest has {floor} tokens)"
        raise MemoryError(
            f"out of memory (or over memory_budget) with {name}={failed_size}{one}: a single "
            "sample does not fit. Free memory, raise memory_budget, enable gradient checkpointing "
            "(bigbatch.enable_checkpointing(model)) or use a smaller model or sequence length."
        )
    ceiling = failed_size if state.ceiling is None else min(state.ceiling, failed_size)
    fits = state.fits if state.fits is not None and state.fits < failed_size else None
    size = fits if fits is not None else max(1, floor, failed_size // 2)
    # A fallback to a size that fit may re-measure once (Note [re-measure before shrinking]).
    return AutoState(size=size, ceiling=ceiling, clean_windows=0, fits=fits, rechecked=False)


def after_success(state: AutoState, used_size: int, grow_after: int = 10) -> AutoState:
    """A window completed at ``used_size``; maybe probe a larger size."""
    fits = used_size if state.fits is None else max(state.fits, used_size)
    state = replace(state, rechecked=False)
    if state.size is None:
        return AutoState(size=used_size, ceiling=state.ceiling, fits=fits)
    clean = state.clean_windows + 1
    # Only grow when the window was really cut at the current size (a short last batch says nothing).
    if clean >= grow_after and state.ceiling is not None and used_size == state.size:
        bigger = (state.size + state.ceiling) // 2
        if bigger > state.size:
            return AutoState(size=bigger, ceiling=state.ceiling, fits=fits)
    return replace(state, clean_windows=clean, fits=fits)

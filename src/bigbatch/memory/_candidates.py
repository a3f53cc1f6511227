"""Measured configurations, and how the planner chooses between them: pure, no model.

``Candidate`` is one way to run a step (micro-batch size and checkpointing option) with what its
measurement cost; ``decide`` chooses among candidates (Note [ties and headroom]), and
``explain`` says why in words. ``bigbatch.memory.planner`` measures the candidates.

Note [ties and headroom]
    Two configurations whose times differ by less than the noise of their measurements cannot
    be ordered: another run may order them the other way, and a choice that follows the order
    flips between runs. The noise of a pair is the larger spread of their timed steps (twice
    the median absolute deviation from their median: a load spike during one step of three
    does not widen it, as it does not move the median; for a configuration measured twice, the
    larger of its two passes', since a load that changed between the passes is no scatter),
    and at least 2% of the faster time (below that, runs on one machine do not agree either). Every fitting configuration within that noise of the fastest ties with it, and the
    tie goes to the most headroom: the lowest peak, where peaks within 2% of the lowest count as
    equal (a CPU reading moves by a few pages between runs; an equal choice must not follow
    them). Among those, the simplest wins: no checkpointing before a policy (selective, then
    full, then offload), fewer blocks checkpointed, then fewer micro-batches. The choice then
    rests on memory readings and on the configurations themselves, not on which of two equal
    times came out lower. When a configuration is not clearly apart from the fastest (closer
    than twice their noise), the planner measures the fastest and the configurations a tie
    could turn on (the lowest peaks among those close, three at most) once more, in the
    reverse order of its first pass, so a load that rose or fell while planning weighs on all
    of them alike, and each takes the lower median of its two passes: another job's load only
    ever slows a step down, so the less disturbed pass is the better estimate
    (``too_close_to_call``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bigbatch.core._units import format_bytes

POLICIES = ("none", "selective", "full", "offload")
"""Checkpointing options in the order they are measured (``none``: no checkpointing)."""
NOISE_FLOOR = 0.02  # Note [ties and headroom]: times closer than 2% are never told apart
SAME_PEAK = 0.02  # peaks within 2% are equal, for ties and for what checkpointing saved
REMEASURED_AT_MOST = 4  # configurations measured again when the best are too close to call
Option = tuple[str, float]  # (policy, fraction of the blocks)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to run a step of the effective batch, and what it cost.

    Attributes:
        micro_batch_size: samples per micro-batch.
        gradient_accumulation_steps: micro-batches per optimizer step (the last may be smaller).
        checkpointing: fraction of the repeated blocks checkpointed (0 = none, 1 = all).
        policy: how they are checkpointed: ``"none"``, ``"selective"``, ``"full"`` or
            ``"offload"`` (``enable_checkpointing``'s ``policy``).
        peak_bytes: peak memory of a step (measured, or predicted by the fit when not measured).
        seconds_per_step: median time of one optimizer step; ``None`` when not measured.
        samples_per_s: effective batch / seconds_per_step; ``None`` when not measured.
        fits: whether ``peak_bytes`` is within the budget less the safety margin.
        measured: ``False`` when the size was only predicted (a smaller one already did not fit).
        out_of_memory: the measurement itself ran out of memory.
        step_seconds: every timed step, in the order run (both passes when re-measured; then
            ``seconds_per_step`` is the lower of the two passes' medians).
        saved_bytes: peak saved against no checkpointing at the same micro-batch (``None`` when
            not checkpointed or not both measured).
        remeasured: measured a second time because the best were too close to call.
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    checkpointing: float
    policy: str
    peak_bytes: int
    seconds_per_step: float | None
    samples_per_s: float | None
    fits: bool
    measured: bool = True
    out_of_memory: bool = False
    step_seconds: tuple[float, ...] = ()
    saved_bytes: int | None = None
    remeasured: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES or (self.policy == "none") != (self.checkpointing == 0):
            raise ValueError(
                f"policy={self.policy!r} with checkpointing={self.checkpointing!r}: use "
                "policy='none' with checkpointing=0, else one of 'selective', 'full', 'offload' "
                "with a fraction in (0, 1]."
            )

    @property
    def noise_seconds(self) -> float:
        """Twice the median absolute deviation of the timed steps from their median (the range
        of two steps; one slow step of three does not widen it), the larger of the two passes'
        when measured twice (a load that changed between passes is not scatter); 0 with fewer
        than two steps."""
        steps, half = self.step_seconds, len(self.step_seconds) // 2
        passes = (steps[:half], steps[half:]) if self.remeasured else (steps,)
        return max(_spread(p) for p in passes)

    @property
    def saves_nothing(self) -> bool:
        """Checkpointed, yet its peak is within 2% of the same micro-batch without it."""
        if self.saved_bytes is None:
            return False
        return self.saved_bytes <= SAME_PEAK * (self.peak_bytes + self.saved_bytes)

    @property
    def label(self) -> str:
        """``"none"``, ``"selective"``, ``"full 50%"``, ``"full"``, ``"offload"``."""
        return option_label((self.policy, self.checkpointing))

    def describe(self) -> str:
        """``"micro-batch 16 x 4 steps with 50% of the blocks checkpointed"``."""
        return (
            f"micro-batch {self.micro_batch_size} x {self.gradient_accumulation_steps} steps "
            + describe_option((self.policy, self.checkpointing))
        )


def _spread(seconds: Sequence[float]) -> float:
    if len(seconds) < 2:
        return 0.0
    middle = statistics.median(seconds)
    return 2 * statistics.median(abs(t - middle) for t in seconds)


def option_label(option: Option) -> str:
    """Short name of a checkpointing option for tables: ``"full 50%"``."""
    policy, fraction = option
    return policy if fraction in (0, 1) else f"{policy} {fraction:.0%}"


def describe_option(option: Option) -> str:
    """``"with every block checkpointed"``, ``"with selective checkpointing of 50% of the blocks"``."""
    policy, fraction = option
    blocks = "every block" if fraction == 1 else f"{fraction:.0%} of the blocks"
    return {
        "none": "without checkpointing",
        "full": f"with {blocks} checkpointed",
        "selective": f"with selective checkpointing of {blocks}",
        "offload": f"with {blocks} offloaded to host memory",
    }[policy]


def usable(memory_budget: int, margin: float) -> int:
    """``memory_budget`` less the safety margin (Note [safety margin])."""
    return int(memory_budget * (1 - margin))


def with_savings(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Each checkpointed measurement with the bytes it saved against none at its micro-batch."""
    plain = {
        c.micro_batch_size: c.peak_bytes
        for c in candidates
        if c.policy == "none" and c.measured and not c.out_of_memory
    }
    return [
        dataclasses.replace(c, saved_bytes=plain[c.micro_batch_size] - c.peak_bytes)
        if c.policy != "none" and c.measured and not c.out_of_memory and c.micro_batch_size in plain
        else c
        for c in candidates
    ]


def noise_between(a: Candidate, b: Candidate) -> float:
    """Seconds within which ``a`` and ``b`` tie (Note [ties and headroom])."""
    floor = NOISE_FLOOR * min(a.seconds_per_step or math.inf, b.seconds_per_step or math.inf)
    return max(a.noise_seconds, b.noise_seconds, floor)


def ranked(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The measured configurations that fit, fastest first."""
    fitting = [c for c in candidates if c.fits and c.seconds_per_step is not None]
    return sorted(fitting, key=lambda c: c.seconds_per_step or math.inf)


def decide(candidates: Sequence[Candidate]) -> tuple[Candidate, Candidate | None, list[Candidate]]:
    """``(choice, runner-up, those tied with the fastest)`` (Note [ties and headroom]).

    Raises:
        ValueError: no measured configuration fits.
    """
    order = ranked(candidates)
    if not order:
        raise ValueError("no measured configuration fits")
    fastest = order[0]
    tied = [c for c in order if _gap(c, fastest) <= noise_between(c, fastest)]
    least = min(c.peak_bytes for c in tied)
    choice = min((c for c in tied if c.peak_bytes <= least * (1 + SAME_PEAK)), key=_simplest)
    runner_up = next((c for c in order if c is not choice), None)
    return choice, runner_up, tied


def too_close_to_call(candidates: Sequence[Candidate]) -> list[Candidate]:
    """What a tie could turn on: the fastest, and (lowest peak first) up to three configurations
    within twice their noise of it; ``[]`` when none is that close."""
    order = ranked(candidates)
    if not order:
        return []
    fastest = order[0]
    close = [c for c in order[1:] if _gap(c, fastest) <= 2 * noise_between(c, fastest)]
    if not close:
        return []
    return [fastest, *sorted(close, key=lambda c: c.peak_bytes)[: REMEASURED_AT_MOST - 1]]


def _simplest(c: Candidate) -> tuple[int, float, int]:
    return POLICIES.index(c.policy), c.checkpointing, -c.micro_batch_size


def _gap(c: Candidate, fastest: Candidate) -> float:
    return (c.seconds_per_step or math.inf) - (fastest.seconds_per_step or math.inf)


def explain(candidates: Sequence[Candidate], naive: Candidate, budget: int, margin: float) -> str:
    """Why ``decide(candidates)`` chose what it chose, in sentences: the room it leaves under the
    budget less the margin, the runner-up and why it lost, a faster configuration memory ruled
    out, a re-measure, checkpointing that saves nothing, and the speed-up over ``naive``."""
    choice, runner_up, tied = decide(candidates)
    room = (
        f"{format_bytes(choice.peak_bytes)} of the {format_bytes(usable(budget, margin))} usable "
        f"({format_bytes(budget)} less the {margin:.0%} safety margin)"
    )
    if choice is ranked(candidates)[0]:
        parts = [_capital(f"{choice.describe()} is the fastest that fits: {room}.")]
    else:
        parts = [
            _capital(
                f"{choice.describe()} ties with the fastest that fits and has the most headroom: {room}."
            )
        ]
    if runner_up is not None:
        parts.append(_why_it_lost(choice, runner_up, any(c is runner_up for c in tied)))
    parts += _what_did_not_fit(candidates, choice, budget)
    if any(c.remeasured for c in candidates):
        parts.append(
            "Configurations too close to call were measured again, in reverse order; each "
            "takes the lower median of its two passes."
        )
    parts += _saves_nothing(candidates)
    if naive is not choice and naive.seconds_per_step and choice.seconds_per_step:
        speedup = naive.seconds_per_step / choice.seconds_per_step
        parts.append(f"{speedup:.2f}x the speed of the naive {naive.describe()}.")
    return " ".join(parts)


def _why_it_lost(choice: Candidate, runner_up: Candidate, tied: bool) -> str:
    t = choice.seconds_per_step or math.nan
    gap = ((runner_up.seconds_per_step or math.nan) - t) / t
    noise = noise_between(choice, runner_up) / t
    head = (
        f"Runner-up: {runner_up.describe()} ({format_bytes(runner_up.peak_bytes)}, "
        f"{abs(gap):.1%} {'faster' if gap < 0 else 'slower'})"
    )
    if not tied:
        return f"{head}: it lost on time, slower by more than the measured noise (±{noise:.1%})."
    more = runner_up.peak_bytes - choice.peak_bytes
    if more > SAME_PEAK * choice.peak_bytes:
        return (
            f"{head}: within the measured noise (±{noise:.1%}), a tie, and it needs "
            f"{format_bytes(more)} more, so it lost on headroom."
        )
    return (
        f"{head}: within the measured noise (±{noise:.1%}) and within 2% of its peak, a tie "
        "on both, so it lost to the simpler configuration (less checkpointing, fewer "
        "micro-batches)."
    )


def _what_did_not_fit(candidates: Sequence[Candidate], choice: Candidate, budget: int) -> list[str]:
    """The fastest measured configuration ruled out by memory, or the next larger size."""
    t = choice.seconds_per_step or math.nan
    faster = [c for c in candidates if not c.fits and (c.seconds_per_step or math.inf) < t]
    if faster:
        best = min(faster, key=lambda c: c.seconds_per_step or math.inf)
        gain = 1 - (best.seconds_per_step or t) / t
        return [
            _capital(
                f"{best.describe()} would be {gain:.1%} faster but peaks at "
                f"{format_bytes(best.peak_bytes)}, {_where(best, budget)}."
            )
        ]
    option = (choice.policy, choice.checkpointing)
    bigger = [
        c
        for c in candidates
        if (c.policy, c.checkpointing) == option and c.micro_batch_size > choice.micro_batch_size
    ]
    if not bigger or bigger[0].fits:
        return []
    b = bigger[0]
    if b.out_of_memory:
        return [f"Micro-batch {b.micro_batch_size} ran out of memory."]
    how = "needs" if b.measured else "would need (predicted)"
    return [
        f"Micro-batch {b.micro_batch_size} {how} {format_bytes(b.peak_bytes)}, {_where(b, budget)}."
    ]


def _where(c: Candidate, budget: int) -> str:
    return "within the budget but not its margin" if c.peak_bytes <= budget else "over the budget"


def _capital(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def _saves_nothing(candidates: Sequence[Candidate]) -> list[str]:
    """Call out checkpointing options that saved no memory at any size they were measured at."""
    plain = {c.micro_batch_size: c for c in candidates if c.policy == "none" and c.measured}
    by_option: dict[Option, list[Candidate]] = {}
    for c in candidates:
        if c.saved_bytes is not None:
            by_option.setdefault((c.policy, c.checkpointing), []).append(c)
    useless = [cs[0] for cs in by_option.values() if all(c.saves_nothing for c in cs)]
    if not useless:
        return []
    shown = "; ".join(
        f"{c.label} at micro-batch {c.micro_batch_size}: {format_bytes(c.peak_bytes)} against "
        f"{format_bytes(plain[c.micro_batch_size].peak_bytes)} without, for "
        f"{_ratio(c, plain[c.micro_batch_size]):.2f}x the time"
        for c in useless
    )
    if len(useless) < len(by_option):
        return [f"Some checkpointing saves nothing measurable here ({shown})."]
    return [
        f"Checkpointing saves nothing measurable on this model ({shown}): its peak is not the "
        "blocks' activations but the parameters, gradients and optimizer state (or activations "
        "outside the blocks), which checkpointing does not reduce."
    ]


def _ratio(c: Candidate, base: Candidate) -> float:
    return (c.seconds_per_step or math.nan) / (base.seconds_per_step or math.nan)


def nothing_fits(measured: Sequence[Candidate], budget: int, margin: float) -> str:
    """The message of the planner's ``MemoryBudgetExceeded`` when no configuration fits."""
    smallest = min(measured, key=lambda c: c.peak_bytes, default=None)
    lowest = (
        f"{format_bytes(smallest.peak_bytes)} ({smallest.describe()})"
        if smallest
        else "none (all ran out of memory)"
    )
    return (
        f"no configuration fits memory_budget={format_bytes(budget)} less the {margin:.0%} "
        f"safety margin ({format_bytes(usable(budget, margin))}): the smallest peak measured was "
        f"{lowest}. Raise memory_budget, lower margin (--margin), try smaller micro_batch_sizes "
        "(down to 1), checkpointing=('full',), a lower precision, or a smaller model or "
        "sequence length."
    )


def parse_option(option: object) -> Option | None:
    """``0.5`` -> ``("full", 0.5)``, ``"selective"`` -> ``("selective", 1.0)``; ``None`` if invalid."""
    if isinstance(option, (int, float)) and not isinstance(option, bool):
        if not 0 <= option <= 1:
            return None
        return ("none", 0.0) if option == 0 else ("full", float(option))
    if not isinstance(option, str):
        return None
    name, _, text = option.partition(":")
    if name == "none":
        return None if text else ("none", 0.0)
    try:
        fraction = float(text) if text else 1.0
    except ValueError:
        return None
    return (name, fraction) if name in POLICIES and 0 < fraction <= 1 else None

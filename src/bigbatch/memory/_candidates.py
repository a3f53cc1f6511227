"""Measured configurations, and how the planner chooses between them: pure, no model.

``Candidate`` is one way to run a step (micro-batch size or token budget, checkpointing
option) with what its measurement cost; ``timed`` turns rounds of timed steps into times and
spreads, ``MemoryFit`` (``fit_memory``) predicts the peaks of sizes not run (``predicted``),
``decide`` chooses among candidates (Note [ties and headroom]), and ``explain`` says why in
words.
``bigbatch.memory.planner`` measures the candidates.

Note [ties and headroom]
    A configuration's time is the median of its timed steps and its spread their interquartile
    range (Note [timing under load] in the planner). Two configurations tie only when their
    spreads overlap (another plan could order them the other way) and the slower median is
    within ``TIE_COST`` (5%) of the faster: speed beyond that is not given up for headroom,
    since the safety margin already keeps the headroom a step needs. Every fitting configuration
    tied with the fastest competes, and the tie goes to the most headroom: the lowest peak,
    where peaks within 2% of the lowest count as equal (a CPU reading moves by a few pages
    between runs; an equal choice must not follow them). Among those, the simplest wins: no
    checkpointing before a policy (selective, then full, then offload), fewer blocks
    checkpointed, then fewer micro-batches. A checkpointed configuration that saves nothing
    (``saves_nothing``: its peak within 2% of the same micro-batch's without) does not compete
    while another does: it recomputes for nothing, so a faster reading of it is noise (a 4 MiB
    MLP's plan chose "full" in one run of three). (The rule before issue 21 tied a pair within the
    larger of their two noises: one noisy slow configuration then tied with the fastest and won
    on headroom, and plans chose configurations 2.3-3.3x slower than the fastest measured.)
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from bigbatch.core._units import format_bytes

POLICIES = ("none", "selective", "full", "offload")
"""Checkpointing options in the order they are measured (``none``: no checkpointing)."""
TIE_COST = 0.05  # Note [ties and headroom]: at most 5% of speed is given up for headroom
SAME_PEAK = 0.02  # peaks within 2% are equal, for ties and for what checkpointing saved
Option = tuple[str, float]  # (policy, fraction of the blocks)
# How ``describe`` says a policy; {} is the blocks.
_HOW = {
    "none": "without checkpointing",
    "selective": "with selective checkpointing of {}",
    "full": "with {} checkpointed",
    "offload": "with {} offloaded to host memory",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to run a step of the effective batch, and what it cost.

    Attributes:
        micro_batch_size: samples per micro-batch (by tokens: the largest micro-batch's rows).
        gradient_accumulation_steps: micro-batches per optimizer step (the last may be smaller).
        checkpointing: fraction of the repeated blocks checkpointed (0 = none, 1 = all).
        policy: how they are checkpointed: ``"none"``, ``"selective"``, ``"full"`` or
            ``"offload"`` (``enable_checkpointing``'s ``policy``).
        peak_bytes: peak memory of a step (measured, or predicted by the fit when not measured).
        seconds_per_step: median time of one optimizer step; ``None`` when not timed (it does
            not fit, or was not run).
        samples_per_s: effective batch / seconds_per_step; ``None`` when not timed.
        fits: whether ``peak_bytes`` is within the budget less the safety margin.
        measured: ``False`` when the size was only predicted (a smaller one already did not fit).
        out_of_memory: the measurement itself ran out of memory.
        step_seconds: every timed step, one per round, in the order run.
        spread_seconds: the interquartile range of the timed steps, ``(q1, q3)`` (Note [timing
            under load]); ``None`` when not timed.
        saved_bytes: peak saved against no checkpointing at the same micro-batch (``None`` when
            not checkpointed or not both measured).
        micro_batch_tokens: the token budget of a cut by tokens (Note [token windows] in
            ``bigbatch.core._tokens``); ``None`` when cut by samples.
        padding: the fraction of the tokens computed that is padding (``None`` without lengths);
            cut by samples, each micro-batch of text with an ``attention_mask`` is trimmed to its
            longest sample (Note [per-token tensors]), other batches count the whole width.
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    checkpointing: float
    policy: str
    peak_bytes: int
    seconds_per_step: float | None = None
    samples_per_s: float | None = None
    fits: bool = False
    measured: bool = True
    out_of_memory: bool = False
    step_seconds: tuple[float, ...] = ()
    spread_seconds: tuple[float, float] | None = None
    saved_bytes: int | None = None
    micro_batch_tokens: int | None = None
    padding: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES or (self.policy == "none") != (self.checkpointing == 0):
            raise ValueError(
                f"policy={self.policy!r} with checkpointing={self.checkpointing!r}: "
                "use policy='none' with checkpointing=0, else 'selective', 'full' or "
                "'offload' with a fraction in (0, 1]."
            )

    @property
    def saves_nothing(self) -> bool:
        """Checkpointed, yet its peak is within 2% of the same micro-batch without it."""
        saved = self.saved_bytes
        return saved is not None and saved <= SAME_PEAK * (self.peak_bytes + saved)

    @property
    def size(self) -> tuple[bool, int]:
        """What the planner sweeps: ``(by tokens, the token budget or the micro-batch size)``."""
        return self.micro_batch_tokens is not None, self.micro_batch_tokens or self.micro_batch_size

    @property
    def cut(self) -> str:
        """``"micro-batch 16"`` or ``"token budget 4096 (up to 16 rows)"``."""
        m, tokens = self.micro_batch_size, self.micro_batch_tokens
        return f"token budget {tokens} (up to {m} rows)" if tokens else f"micro-batch {m}"

    @property
    def label(self) -> str:
        """``"none"``, ``"selective"``, ``"full 50%"``, ``"full"``, ``"offload"``."""
        return option_label((self.policy, self.checkpointing))

    def describe(self) -> str:
        """``"micro-batch 16 x 4 steps with 50% of the blocks checkpointed"``, or ``"... with
        selective checkpointing of every block"``, ``"... offloaded to host memory"``."""
        f = self.checkpointing
        how = _HOW[self.policy].format("every block" if f == 1 else f"{f:.0%} of the blocks")
        return f"{self.cut} x {self.gradient_accumulation_steps} steps {how}"


def timed(
    fitting: Sequence[Candidate], seconds: Sequence[Sequence[float]], samples: int
) -> list[Candidate]:
    """``fitting`` with their times: ``seconds[i][r]`` is candidate ``i``'s timed step in round
    ``r`` (Note [timing under load]; one no longer timed has fewer). Each round's times are
    divided by the round's median over the candidates timed in every round;
    a candidate's time is the median of its relative times and its spread their interquartile
    range, both times the median round."""
    every = [t for t in seconds if len(t) == max(map(len, seconds))]  # timed in every round
    rounds = [statistics.median(column) for column in zip(*every, strict=True)]
    scale, out = statistics.median(rounds), []
    for c, times in zip(fitting, seconds, strict=True):
        relative = [t / level * scale for t, level in zip(times, rounds, strict=False)]
        q1, t, q3 = (
            statistics.quantiles(relative, n=4, method="inclusive")
            if len(times) > 1
            else relative * 3
        )
        out.append(
            dataclasses.replace(
                c,
                seconds_per_step=t,
                samples_per_s=samples / t,
                spread_seconds=(q1, q3),
                step_seconds=tuple(times),
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    """Least-squares line ``peak_bytes ≈ base_bytes + bytes_per_sample · micro_batch_size`` (per
    token of the budget when ``tokens``)."""

    checkpointing: float
    base_bytes: float
    bytes_per_sample: float
    policy: str = "full"
    tokens: bool = False

    @property
    def label(self) -> str:
        """The option's short name (``Candidate.label``)."""
        return option_label((self.policy, self.checkpointing))

    def predict(self, micro_batch_size: int) -> int:
        """Predicted peak bytes at ``micro_batch_size``."""
        return int(self.base_bytes + self.bytes_per_sample * micro_batch_size)

    def largest_fitting(self, memory_budget: int) -> int:
        """Largest micro-batch the line keeps within ``memory_budget`` (0 if none)."""
        if self.bytes_per_sample <= 0:
            return 0 if self.base_bytes > memory_budget else 2**31
        return max(0, math.floor((memory_budget - self.base_bytes) / self.bytes_per_sample))


def fit_memory(measured: Sequence[Candidate]) -> MemoryFit | None:
    """Least-squares ``peak ≈ a + b·m`` over measured candidates of one option; ``None`` with
    fewer than two sizes."""
    if len({c.size for c in measured}) < 2:
        return None
    sizes, peaks = [c.size[1] for c in measured], [c.peak_bytes for c in measured]
    slope, base = statistics.linear_regression(sizes, peaks)
    first = measured[0]
    return MemoryFit(first.checkpointing, base, slope, first.policy, first.size[0])


def predicted(
    larger: Sequence[Candidate], fit: MemoryFit | None, last: Candidate
) -> list[Candidate]:
    """``larger`` configurations than ``last`` (which did not fit), their peaks predicted by
    ``fit``: not run, the peak only grows with the micro-batch."""
    peak = lambda c: max(fit.predict(c.size[1]) if fit else 0, last.peak_bytes)  # noqa: E731
    return [dataclasses.replace(c, peak_bytes=peak(c), fits=False, measured=False) for c in larger]


def option_label(option: Option) -> str:
    """Short name of a checkpointing option for tables: ``"full 50%"``."""
    return option[0] if option[1] in (0, 1) else f"{option[0]} {option[1]:.0%}"


def parse_option(option: object) -> Option | None:
    """``0.5`` -> ``("full", 0.5)``, ``"selective"`` -> ``("selective", 1.0)``; ``None`` if invalid."""
    if isinstance(option, (int, float)) and not isinstance(option, bool):
        option = "none" if option == 0 else f"full:{option}"
    if not isinstance(option, str):
        return None
    name, _, text = option.partition(":")
    try:
        fraction = float(text or name != "none")
    except ValueError:
        return None
    valid = (name == "none" and not text) or (name in POLICIES[1:] and 0 < fraction <= 1)
    return (name, fraction) if valid else None


def usable(memory_budget: int, margin: float) -> int:
    """``memory_budget`` less the safety margin (Note [safety margin])."""
    return int(memory_budget * (1 - margin))


def ran(c: Candidate) -> bool:
    """Measured, without running out of memory."""
    return c.measured and not c.out_of_memory


def with_savings(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Each checkpointed measurement with the bytes it saved against none at its micro-batch."""
    plain = {c.size: c.peak_bytes for c in candidates if c.policy == "none" and ran(c)}
    return [
        dataclasses.replace(c, saved_bytes=plain[c.size] - c.peak_bytes)
        if c.policy != "none" and ran(c) and c.size in plain
        else c
        for c in candidates
    ]


def ranked(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The timed configurations that fit, fastest first."""
    return sorted((c for c in candidates if c.fits and c.seconds_per_step), key=_seconds)


def ties(a: Candidate, b: Candidate) -> bool:
    """Do ``a`` and ``b`` tie (Note [ties and headroom])?"""
    slower, faster = max(_seconds(a), _seconds(b)), min(_seconds(a), _seconds(b))
    return _overlap(a, b) and slower <= faster * (1 + TIE_COST)


def _overlap(a: Candidate, b: Candidate) -> bool:
    (a1, a3), (b1, b3) = a.spread_seconds or (0, 0), b.spread_seconds or (0, 0)
    return a1 <= b3 and b1 <= a3


def decide(candidates: Sequence[Candidate]) -> tuple[Candidate, Candidate | None, list[Candidate]]:
    """``(choice, runner-up, those tied with the fastest)`` (Note [ties and headroom]), among
    candidates of which at least one fits and was timed."""
    order = ranked(candidates)  # not empty: plan raised MemoryBudgetExceeded when none fits
    order = [c for c in order if not c.saves_nothing] or order  # Note [ties and headroom]
    tied = [c for c in order if ties(c, order[0])]
    least = min(c.peak_bytes for c in tied)
    choice = min((c for c in tied if c.peak_bytes <= least * (1 + SAME_PEAK)), key=_simplest)
    return choice, next((c for c in order if c is not choice), None), tied


def _simplest(c: Candidate) -> tuple[int, float, int, int]:
    return POLICIES.index(c.policy), c.checkpointing, c.gradient_accumulation_steps, -c.size[1]


def _seconds(c: Candidate) -> float:
    return c.seconds_per_step or math.inf


def explain(candidates: Sequence[Candidate], naive: Candidate, budget: int, margin: float) -> str:
    """Why ``decide(candidates)`` chose what it chose, in sentences: the room it leaves under the
    budget less the margin, the runner-up and why it lost, a faster configuration memory ruled
    out, checkpointing that saves nothing, and the speed-up over ``naive``."""
    choice, runner_up, tied = decide(candidates)
    verdict = "is the fastest" if choice is tied[0] else "ties with the fastest"
    parts = [
        f"{choice.describe().capitalize()} {verdict} that fits"
        f"{'' if choice is tied[0] else ' and has the most headroom'}: "
        f"{format_bytes(choice.peak_bytes)} of the {format_bytes(usable(budget, margin))} "
        f"usable ({format_bytes(budget)} less the {margin:.0%} safety margin)."
    ]
    if runner_up is not None:
        parts.append(_why_it_lost(choice, runner_up, any(c is runner_up for c in tied)))
    parts += _what_did_not_fit(candidates, choice, budget) + _saves_nothing(candidates)
    if naive is not choice and naive.seconds_per_step and choice.seconds_per_step:
        speedup = naive.seconds_per_step / choice.seconds_per_step
        parts.append(f"{speedup:.2f}x the speed of the naive {naive.describe()}.")
    return " ".join(parts)


def _why_it_lost(choice: Candidate, runner_up: Candidate, tied: bool) -> str:
    gap = _seconds(runner_up) / _seconds(choice) - 1
    head = (
        f"Runner-up: {runner_up.describe()} ({format_bytes(runner_up.peak_bytes)}, "
        f"{abs(gap):.1%} {'faster' if gap < 0 else 'slower'})"
    )
    if not tied:
        apart = not _overlap(runner_up, choice)
        why = "the spreads do not overlap" if apart else f"more than {TIE_COST:.0%} slower"
        return f"{head}: it lost on time ({why})."
    more = runner_up.peak_bytes - choice.peak_bytes
    tie = f"{head}: the spreads overlap and it is within {TIE_COST:.0%}"
    if more > SAME_PEAK * choice.peak_bytes:
        return f"{tie}, a tie, and it needs {format_bytes(more)} more, so it lost on headroom."
    return (
        f"{tie} and within 2% of its peak, a tie on both, so it lost to the simpler "
        "configuration (less checkpointing, fewer micro-batches)."
    )


def _what_did_not_fit(candidates: Sequence[Candidate], choice: Candidate, budget: int) -> list[str]:
    """The next larger size of the chosen option, when memory ruled it out."""
    b = next(
        (
            c
            for c in candidates
            if c.label == choice.label
            and c.size[0] == choice.size[0]
            and c.size[1] > choice.size[1]
        ),
        None,
    )
    if b is None or b.fits:
        return []
    if b.out_of_memory:
        return [f"{b.cut.capitalize()} ran out of memory."]
    how = "needs" if b.measured else "would need (predicted)"
    where = "within the budget but not its margin" if b.peak_bytes <= budget else "over the budget"
    return [f"{b.cut.capitalize()} {how} {format_bytes(b.peak_bytes)}, {where}."]


def _saves_nothing(candidates: Sequence[Candidate]) -> list[str]:
    """Call out checkpointing options that saved no memory at any size they were measured at."""
    plain = {c.size: c for c in candidates if c.policy == "none" and c.measured}
    saved = [c for c in candidates if c.saved_bytes is not None]
    by_option = {c.label: [d for d in saved if d.label == c.label] for c in saved}
    if not (useless := [cs[0] for cs in by_option.values() if all(c.saves_nothing for c in cs)]):
        return []
    shown = "; ".join(_against(c, plain[c.size]) for c in useless)
    if len(useless) < len(by_option):
        return [f"Some checkpointing saves nothing measurable here ({shown})."]
    return [
        f"Checkpointing saves nothing measurable on this model ({shown}): its peak is not the "
        "blocks' activations but the parameters, gradients and optimizer state (or "
        "activations outside the blocks), which checkpointing does not reduce."
    ]


def _against(c: Candidate, plain: Candidate) -> str:
    """``"full at micro-batch 8: 47.90 MiB against 48.00 MiB without, for 1.37x the time"``."""
    ratio = (c.seconds_per_step or math.nan) / (plain.seconds_per_step or math.nan)
    time = f", for {ratio:.2f}x the time" if math.isfinite(ratio) else ""
    peaks = f"{format_bytes(c.peak_bytes)} against {format_bytes(plain.peak_bytes)}"
    return f"{c.label} at {c.cut}: {peaks} without{time}"


def nothing_fits(candidates: Sequence[Candidate], budget: int, margin: float) -> str:
    """The message of the planner's ``MemoryBudgetExceeded`` when no configuration fits."""
    smallest = min(filter(ran, candidates), key=lambda c: c.peak_bytes, default=None)
    lowest = (
        f"{format_bytes(smallest.peak_bytes)} ({smallest.describe()})"
        if smallest
        else "none (all ran out of memory)"
    )
    return (
        f"no configuration fits memory_budget={format_bytes(budget)} less the {margin:.0%} "
        f"safety margin ({format_bytes(usable(budget, margin))}): the smallest peak measured "
        f"was {lowest}. Raise memory_budget, lower margin (--margin), try smaller "
        "micro_batch_sizes (down to 1), checkpointing=('full',), a lower precision, or a "
        "smaller model or sequence length."
    )

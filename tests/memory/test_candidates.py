"""The planner's choice between measured configurations, pure: ties, headroom, margin, words.

The candidates here are written out (their times and peaks as a measurement would give them), so
each rule of Note [ties and headroom] is pinned without a timing; the planner's real
measurements are tested in test_planner.py.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from bigbatch.memory._candidates import (
    Candidate,
    decide,
    explain,
    noise_between,
    parse_option,
    too_close_to_call,
    with_savings,
)

MiB = 2**20
BATCH = 32


def cand(
    m: int,
    seconds: list[float] | None,
    peak_mib: float,
    policy: str = "none",
    fraction: float = 0.0,
    usable_mib: float = 90,
) -> Candidate:
    """A configuration measured at ``seconds`` per timed step, peaking at ``peak_mib``."""
    t = statistics.median(seconds) if seconds else None
    return Candidate(
        micro_batch_size=m, gradient_accumulation_steps=BATCH // m, checkpointing=fraction,
        policy=policy, peak_bytes=int(peak_mib * MiB), seconds_per_step=t,
        samples_per_s=BATCH / t if t else None, fits=peak_mib <= usable_mib,
        step_seconds=tuple(seconds or ()),
    )  # fmt: skip


def test_times_within_the_noise_tie_and_the_tie_goes_to_more_headroom():
    fast = cand(32, [1.00, 1.04, 1.02], 80)  # the fastest, noise 0.04 s
    close = cand(16, [1.03, 1.05, 1.01], 50)  # 0.01 s slower: within the noise, 30 MiB less
    slow = cand(4, [1.50, 1.52, 1.51], 20, "full", 1.0)  # least memory, clearly slower
    choice, runner_up, tied = decide([fast, close, slow])
    assert choice is close and runner_up is fast and tied == [fast, close]
    assert noise_between(fast, close) == pytest.approx(0.04)


def test_a_difference_beyond_the_noise_goes_to_the_faster():
    fast = cand(32, [1.00, 1.01, 1.00], 80)
    slower = cand(16, [1.10, 1.11, 1.10], 50)  # 10% slower, noise 1%
    choice, runner_up, tied = decide([slower, fast])
    assert (choice, runner_up, tied) == (fast, slower, [fast])


def test_times_closer_than_two_percent_tie_even_without_spread():
    # Note [ties and headroom]: one timed step each (no spread), 1% apart: a tie all the same
    choice, _, tied = decide([cand(32, [1.00], 80), cand(16, [1.01], 50)])
    assert choice.micro_batch_size == 16 and len(tied) == 2
    choice, _, tied = decide([cand(32, [1.00], 80), cand(16, [1.03], 50)])
    assert choice.micro_batch_size == 32 and len(tied) == 1


def test_the_choice_does_not_depend_on_which_tied_time_came_out_lower():
    """Two runs of the same plan that order two tied configurations differently choose alike."""
    run_1 = [cand(32, [1.00, 1.03], 80), cand(16, [1.02, 1.04], 50), cand(8, [1.3, 1.32], 30)]
    run_2 = [cand(32, [1.03, 1.05], 80.1), cand(16, [0.99, 1.02], 50.1), cand(8, [1.3], 30)]
    picks = [decide(run)[0] for run in (run_1, run_2)]
    assert [(c.micro_batch_size, c.policy) for c in picks] == [(16, "none"), (16, "none")]


def test_peaks_within_two_percent_are_equal_and_the_simplest_configuration_wins():
    """Weights dominate the peak: every configuration within 1.5%, so headroom cannot decide."""
    run_1 = [
        cand(16, [0.24, 0.25], 110.0, usable_mib=180),
        cand(32, [0.24, 0.25], 110.9, usable_mib=180),
        cand(32, [0.25, 0.26], 109.2, "full", 1.0, usable_mib=180),  # lowest peak, by 1.5%
    ]
    run_2 = [
        cand(16, [0.25], 110.1, usable_mib=180),
        cand(32, [0.23], 111.0, usable_mib=180),
        cand(32, [0.24], 109.3, "full", 1.0, usable_mib=180),
    ]
    picks = [decide(run)[0] for run in (run_1, run_2)]
    assert [(c.micro_batch_size, c.policy) for c in picks] == [(32, "none"), (32, "none")]
    text = explain(run_1, run_1[0], 200 * MiB, 0.1)
    assert "a tie on both, so it lost to the simpler configuration" in text


def test_what_does_not_fit_the_margin_is_never_chosen():
    over_margin = cand(32, [0.5, 0.5], 95)  # within a 100 MiB budget, not within its 90 usable
    fitting = cand(16, [1.0, 1.0], 60)
    assert not over_margin.fits
    assert decide([over_margin, fitting])[0] is fitting
    text = explain([over_margin, fitting], fitting, 100 * MiB, 0.1)
    assert "60.00 MiB of the 90.00 MiB usable (100.00 MiB less the 10% safety margin)" in text
    assert (
        "Micro-batch 32 x 1 steps without checkpointing would be 50.0% faster but peaks at "
        "95.00 MiB, within the budget but not its margin." in text
    )


def test_too_close_to_call_when_the_best_two_are_within_twice_their_noise():
    a, b = cand(32, [1.00, 1.02], 80), cand(16, [1.03, 1.05], 50)  # 0.03 s apart, noise 0.02
    c = cand(8, [1.5, 1.52], 30)
    assert too_close_to_call([a, b, c]) == [a, b]
    assert too_close_to_call([a, cand(16, [1.2, 1.21], 50), c]) == []  # clearly apart
    assert too_close_to_call([a]) == []


def test_a_noisy_configuration_a_tie_could_turn_on_is_measured_again():
    """Not only the best two: a slower configuration whose own steps scatter widely could tie
    with the fastest and win on headroom, so it is measured again with the fastest."""
    fastest, second = cand(16, [1.00, 1.01, 1.02], 85), cand(8, [1.10, 1.11, 1.12], 60)
    noisy = cand(8, [0.9, 1.6, 2.3], 70, "full", 0.5)  # median 1.6, noise 1.4 s
    assert too_close_to_call([fastest, second, noisy]) == [fastest, noisy]
    many = [cand(m, [1.0 + m / 100, 1.3], 80 - m, "full", 1.0) for m in (1, 2, 4, 8, 16)]
    assert [c.micro_batch_size for c in too_close_to_call(many)] == [1, 16, 8, 4]


def test_explain_names_the_runner_up_and_why_it_lost():
    fast, close = cand(32, [1.00, 1.04], 80), cand(16, [1.03, 1.05], 50)
    text = explain([fast, close], close, 100 * MiB, 0.1)
    assert text.startswith(
        "Micro-batch 16 x 2 steps without checkpointing ties with the fastest that fits and has "
        "the most headroom: 50.00 MiB of the 90.00 MiB usable"
    )
    assert (
        "Runner-up: micro-batch 32 x 1 steps without checkpointing (80.00 MiB, 1.9% faster): "
        "within the measured noise (±3.8%), a tie, and it needs 30.00 MiB more, so it lost on "
        "headroom." in text
    )
    slower = cand(16, [1.30, 1.31], 50)
    text = explain([fast, slower], slower, 100 * MiB, 0.1)
    assert text.startswith(
        "Micro-batch 32 x 1 steps without checkpointing is the fastest that fits"
    )
    assert "(50.00 MiB, 27.9% slower): it lost on time, slower by more than the measured noise" in (
        text
    )


def test_checkpointing_that_saves_nothing_is_called_out():
    """An MLP whose peak is its gradients and optimizer state: checkpointing costs time only."""
    plain = cand(8, [1.00, 1.01], 48.0)
    full = cand(8, [1.37, 1.38], 47.9, "full", 1.0)
    selective = cand(8, [1.10, 1.11], 48.1, "selective", 1.0)
    candidates = with_savings([plain, selective, full])
    assert [c.saved_bytes for c in candidates] == [None, -104857, 104858]  # 0.1 MiB each way
    assert candidates[1].saves_nothing and candidates[2].saves_nothing
    text = explain(candidates, candidates[2], 100 * MiB, 0.1)
    assert (
        "Checkpointing saves nothing measurable on this model (selective at micro-batch 8: "
        "48.10 MiB against 48.00 MiB without, for 1.10x the time; full at micro-batch 8: "
        "47.90 MiB against 48.00 MiB without, for 1.37x the time): its peak is not the blocks' "
        "activations but the parameters, gradients and optimizer state" in text
    )
    saving = with_savings([plain, selective, cand(8, [1.37, 1.38], 30.0, "full", 1.0)])
    text = explain(saving, saving[0], 100 * MiB, 0.1)
    assert "Some checkpointing saves nothing measurable here (selective at micro-batch 8" in text


@pytest.mark.parametrize(
    "given,expected",
    [
        (0, ("none", 0.0)),
        (0.5, ("full", 0.5)),
        (1, ("full", 1.0)),
        ("none", ("none", 0.0)),
        ("full", ("full", 1.0)),
        ("selective", ("selective", 1.0)),
        ("selective:0.25", ("selective", 0.25)),
        ("offload", ("offload", 1.0)),
        (1.5, None),
        (True, None),
        ("none:0.5", None),
        ("selective:0", None),
        ("selective:half", None),
        ("everything", None),
    ],
)
def test_parse_option(given, expected):
    assert parse_option(given) == expected


def test_candidate_policy_must_match_its_fraction():
    with pytest.raises(
        ValueError, match=r"policy='full' with checkpointing=0\.0: use policy='none'"
    ):
        cand(8, [1.0], 10, "full", 0.0)
    with pytest.raises(ValueError, match=r"policy='none' with checkpointing=0\.5"):
        cand(8, [1.0], 10, "none", 0.5)


def test_one_slow_step_does_not_widen_the_noise():
    """A load spike during one timed step moves neither the median nor the noise: a
    configuration 30% slower does not tie with the fastest because one of its steps was."""
    fast = cand(16, [1.00, 1.01, 1.60], 80)  # one step hit by a load spike
    slow = cand(4, [1.30, 1.31, 1.32], 20, "full", 1.0)
    assert fast.noise_seconds == pytest.approx(0.02) and fast.seconds_per_step == 1.01
    assert decide([fast, slow])[0] is fast
    assert cand(8, [1.0, 1.1], 10).noise_seconds == pytest.approx(0.1)  # two steps: their range


def test_a_load_that_changed_between_two_passes_is_not_noise():
    once = cand(16, [1.00, 1.01, 1.02], 80)
    twice = dataclasses.replace(once, step_seconds=(1.00, 1.01, 1.02, 1.40, 1.41, 1.42))
    assert twice.noise_seconds == pytest.approx(0.4)  # as one pass: the drift would count
    remeasured = dataclasses.replace(twice, remeasured=True)
    assert remeasured.noise_seconds == pytest.approx(0.02)  # each pass: +-0.01 around its median

"""The planner's choice between measured configurations, pure: ties, headroom, margin, words.

The candidates here are written out (their times and peaks as a measurement would give them), so
each rule of Note [ties and headroom] is pinned without a timing; the planner's real
measurements are tested in test_planner.py.
"""

from __future__ import annotations

import statistics

import pytest

from bigbatch.memory._candidates import (
    Candidate,
    decide,
    explain,
    parse_option,
    ties,
    timed,
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
    """A configuration timed at ``seconds`` per step (under a steady load: its time is their
    median, its spread their interquartile range), peaking at ``peak_mib``; ``None``: not timed."""
    points = (seconds or []) * (2 if seconds and len(seconds) == 1 else 1)  # quantiles need 2
    quartiles = statistics.quantiles(points, n=4, method="inclusive") if points else []
    q1, t, q3 = quartiles or [None] * 3
    return Candidate(
        micro_batch_size=m, gradient_accumulation_steps=BATCH // m, checkpointing=fraction,
        policy=policy, peak_bytes=int(peak_mib * MiB), seconds_per_step=t,
        samples_per_s=BATCH / t if t else None, fits=peak_mib <= usable_mib,
        step_seconds=tuple(seconds or ()), spread_seconds=(q1, q3) if seconds else None,
    )  # fmt: skip


def test_overlapping_spreads_within_five_percent_tie_and_the_tie_goes_to_more_headroom():
    fast = cand(32, [1.00, 1.04, 1.02], 80)  # the fastest: 1.02, spread 1.01-1.03
    close = cand(16, [1.03, 1.05, 1.01], 50)  # 1.03, spread 1.02-1.04: overlaps, 30 MiB less
    slow = cand(4, [1.50, 1.52, 1.51], 20, "full", 1.0)  # least memory, clearly slower
    assert fast.spread_seconds == pytest.approx((1.01, 1.03))
    choice, runner_up, tied = decide([fast, close, slow])
    assert choice is close and runner_up is fast and tied == [fast, close]


def test_spreads_apart_go_to_the_faster():
    fast = cand(32, [1.00, 1.01, 1.00], 80)
    slower = cand(16, [1.02, 1.03, 1.02], 50)  # 2% slower, but every step of it is slower
    choice, runner_up, tied = decide([slower, fast])
    assert (choice, runner_up, tied) == (fast, slower, [fast])


def test_one_timed_step_has_no_spread_and_ties_only_an_equal_time():
    choice, _, tied = decide([cand(32, [1.00], 80), cand(16, [1.001], 50)])
    assert choice.micro_batch_size == 32 and len(tied) == 1
    choice, _, tied = decide([cand(32, [1.00], 80), cand(16, [1.00], 50)])
    assert choice.micro_batch_size == 16 and len(tied) == 2


def test_a_noisy_slow_configuration_does_not_tie_with_the_fastest():
    """The cause of plans 2.3-3.3x slower than the fastest: a configuration whose own steps
    scatter widely tied with the fastest (within the larger of their noises) and won on
    headroom. Its spread overlaps the fastest's, but its median is 29% slower: not a tie."""
    fastest = cand(16, [1.00, 1.01, 1.02, 1.01, 1.00], 85)
    noisy = cand(8, [0.95, 1.3, 2.3, 2.4, 1.0], 20, "full", 1.0)  # 1.3, spread 1.0-2.3
    assert noisy.spread_seconds == pytest.approx((1.0, 2.3))
    assert not ties(fastest, noisy)
    assert decide([fastest, noisy])[0] is fastest
    text = explain([fastest, noisy], noisy, 100 * MiB, 0.1)
    assert "28.7% slower): it lost on time (more than 5% slower)." in text


def test_the_choice_does_not_depend_on_which_tied_time_came_out_lower():
    """Two runs of the same plan that order two tied configurations differently choose alike."""
    run_1 = [cand(32, [1.00, 1.03], 80), cand(16, [1.01, 1.04], 50), cand(8, [1.3, 1.32], 30)]
    run_2 = [cand(32, [1.03, 1.05], 80.1), cand(16, [0.99, 1.03], 50.1), cand(8, [1.3], 30)]
    picks = [decide(run)[0] for run in (run_1, run_2)]
    assert [(c.micro_batch_size, c.policy) for c in picks] == [(16, "none"), (16, "none")]


def test_peaks_within_two_percent_are_equal_and_the_simplest_configuration_wins():
    """Weights dominate the peak: every configuration within 1.5%, so headroom cannot decide."""
    run_1 = [
        cand(16, [0.24, 0.25], 110.0, usable_mib=180),
        cand(32, [0.24, 0.25], 110.9, usable_mib=180),
        cand(32, [0.245, 0.255], 109.2, "full", 1.0, usable_mib=180),  # lowest peak, by 1.5%
    ]
    run_2 = [
        cand(16, [0.25, 0.24], 110.1, usable_mib=180),
        cand(32, [0.23, 0.25], 111.0, usable_mib=180),
        cand(32, [0.24, 0.25], 109.3, "full", 1.0, usable_mib=180),
    ]
    picks = [decide(run)[0] for run in (run_1, run_2)]
    assert [(c.micro_batch_size, c.policy) for c in picks] == [(32, "none"), (32, "none")]
    text = explain(run_1, run_1[0], 200 * MiB, 0.1)
    assert "a tie on both, so it lost to the simpler configuration" in text


def test_what_does_not_fit_the_margin_is_never_chosen():
    over_margin = cand(32, None, 95)  # within a 100 MiB budget, not within its 90 usable
    fitting = cand(16, [1.0, 1.0], 60)
    assert not over_margin.fits and over_margin.seconds_per_step is None  # not timed
    assert decide([fitting, over_margin])[0] is fitting
    text = explain([fitting, over_margin], fitting, 100 * MiB, 0.1)
    assert "60.00 MiB of the 90.00 MiB usable (100.00 MiB less the 10% safety margin)" in text
    assert "Micro-batch 32 needs 95.00 MiB, within the budget but not its margin." in text


def test_explain_names_the_runner_up_and_why_it_lost():
    fast, close = cand(32, [1.00, 1.04], 80), cand(16, [1.01, 1.05], 50)
    text = explain([fast, close], close, 100 * MiB, 0.1)
    assert text.startswith(
        "Micro-batch 16 x 2 steps without checkpointing ties with the fastest that fits and has "
        "the most headroom: 50.00 MiB of the 90.00 MiB usable"
    )
    assert (
        "Runner-up: micro-batch 32 x 1 steps without checkpointing (80.00 MiB, 1.0% faster): "
        "the spreads overlap and it is within 5%, a tie, and it needs 30.00 MiB more, so it "
        "lost on headroom." in text
    )
    slower = cand(16, [1.30, 1.31], 50)
    text = explain([fast, slower], slower, 100 * MiB, 0.1)
    assert text.startswith(
        "Micro-batch 32 x 1 steps without checkpointing is the fastest that fits"
    )
    assert "(50.00 MiB, 27.9% slower): it lost on time (the spreads do not overlap)." in text


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


def test_one_slow_step_does_not_widen_the_spread():
    """A load spike during one timed step of five moves neither the median nor the spread: a
    configuration 30% slower does not tie with the fastest because one of its steps was."""
    fast = cand(16, [1.00, 1.01, 1.60, 1.01, 1.02], 80)  # one step hit by a load spike
    slow = cand(4, [1.30, 1.31, 1.32, 1.31, 1.30], 20, "full", 1.0)
    assert fast.spread_seconds == pytest.approx((1.01, 1.02)) and fast.seconds_per_step == 1.01
    assert decide([fast, slow])[0] is fast


def test_a_load_that_slowed_a_whole_round_cancels():
    """Round 2 ran at half speed for everyone (another job): divided by the round's median, it
    reads like the others, and the spreads stay those of the configurations themselves."""
    a, b = cand(16, None, 50), cand(32, None, 80)
    steps = [[1.00, 2.02, 1.01, 1.00], [0.90, 1.80, 0.91, 0.90]]  # b 10% faster in every round
    ta, tb = timed([a, b], steps, BATCH)
    assert tb.seconds_per_step / ta.seconds_per_step == pytest.approx(0.9, abs=0.01)
    assert ta.step_seconds == (1.00, 2.02, 1.01, 1.00)  # as measured
    assert not ties(ta, tb) and decide([ta, tb])[0] is tb
    raw_a, raw_b = cand(16, steps[0], 50), cand(32, steps[1], 80)  # each on its own
    assert raw_a.spread_seconds[1] > raw_b.spread_seconds[0]  # the load alone made them overlap


def test_configurations_no_longer_timed_keep_their_rounds():
    """After two rounds only those within 1.5x of the fastest are timed again (Note [timing
    under load]): the rounds' level is read from those timed in every round."""
    a, b, slow = cand(16, None, 50), cand(32, None, 80), cand(1, None, 10)
    ta, tb, ts = timed([a, b, slow], [[1.0, 2.0, 1.0, 1.0], [1.1, 2.2, 1.1, 1.1], [3.0, 6.0]], 32)
    assert ts.step_seconds == (3.0, 6.0) and ts.seconds_per_step == pytest.approx(3.0, rel=0.05)
    assert tb.seconds_per_step / ta.seconds_per_step == pytest.approx(1.1)
    assert decide([ta, tb, ts])[0] is ta


def test_a_checkpointed_configuration_that_saves_nothing_does_not_win_on_a_faster_reading():
    """A 4 MiB MLP's plan chose "full" in one run of three: its peak is the plain one's (it
    saves nothing), and one reading of it came out faster, spreads apart. It does not compete
    while another configuration does; alone, it is still the choice."""
    plain = cand(8, [1.02, 1.03, 1.02], 40)
    full = cand(8, [0.97, 0.98, 0.97], 40, "full", 1.0)
    both = with_savings([plain, full])
    assert both[1].saves_nothing and not ties(*both)
    choice, runner_up, tied = decide(both)
    assert (choice, runner_up, tied) == (both[0], None, [both[0]])
    assert decide(with_savings([full]))[0].policy == "full"

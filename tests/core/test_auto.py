"""The auto micro-batch policy, pure: halving, ceiling, growth toward the ceiling, floor, sizes."""

from __future__ import annotations

import pytest

from bigbatch.core._sizing import AutoState, after_oom, after_success, size_for
from bigbatch.core._units import format_bytes, parse_bytes


def test_first_window_whole_then_halves_until_it_fits():
    state = AutoState()
    assert size_for(state, 10) == 10
    state = after_oom(state, 10)
    assert (state.size, state.ceiling, size_for(state, 10)) == (5, 10, 5)
    state = after_oom(state, 5)
    assert (state.size, state.ceiling, size_for(state, 10)) == (2, 5, 2)
    state = after_success(state, 2)
    assert (state.size, state.fits, state.clean_windows) == (2, 2, 1)


def test_ceiling_is_never_reached_again():
    state = AutoState(size=8, ceiling=6)  # a size at or above a failed one is never tried
    assert size_for(state, 100) == 5
    assert size_for(AutoState(size=8), 3) == 3  # a short batch is cut at its own size


def test_growth_probes_half_way_toward_the_ceiling_and_falls_back_to_what_fits():
    state = after_oom(AutoState(), 16)  # 16 failed: try 8
    sizes = []
    for _ in range(40):
        size = size_for(state, 16)
        sizes.append(size)
        if size > 11:  # the true limit: 11 fits, 12 does not
            state = after_oom(state, size)
        else:
            state = after_success(state, size, grow_after=2)
    assert sizes[:3] == [8, 8, 12]  # half-way from 8 to 16 after 2 clean windows
    assert sizes[3] == 8  # the failed probe goes back to the size known to fit, not 12 // 2
    assert sizes[-1] == 11 and state.ceiling == 12 and state.fits == 11
    assert sizes.count(12) == 1  # a failed size is never tried again


def test_short_window_does_not_trigger_growth():
    state = AutoState(size=4, ceiling=8, clean_windows=5)
    assert after_success(state, 3, grow_after=6).size == 4  # cut at 3, says nothing about 4
    assert after_success(state, 4, grow_after=6).size == 6


def test_fits_forgotten_when_it_fails_later():
    state = AutoState(size=6, ceiling=12, fits=6)
    assert after_oom(state, 6) == AutoState(size=3, ceiling=6, fits=None)


def test_floor_at_one_raises_a_clear_memory_error():
    with pytest.raises(
        MemoryError, match=r"micro_batch_size=1: a single sample does not fit.*enable_checkpointing"
    ):
        after_oom(AutoState(size=1, ceiling=2), 1)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("6GiB", 6 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5G", int(1.5 * 2**30)),
        (" 64 mib ", 64 * 2**20),
        (1000, 1000),
        (2.5e9, 2_500_000_000),
        ("123", 123),
        (None, None),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["six gigs", "6 parsecs", "", "-1GiB", "1e9"])
def test_parse_bytes_rejects_text(bad):
    with pytest.raises(
        ValueError, match=rf"memory_budget={bad!r} is not a size: write a number with a unit"
    ):
        parse_bytes(bad)


@pytest.mark.parametrize("bad", [0, -5, "0GiB", 0.1])
def test_parse_bytes_rejects_non_positive(bad):
    with pytest.raises(ValueError, match=rf"memory_budget={bad!r} is not a positive finite size"):
        parse_bytes(bad)


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 1536 * 2**20, 3 * 2**40)] == [
        "512 B",
        "1.50 GiB",
        "3072.00 GiB",
    ]


def test_a_budget_overrun_at_a_size_that_fit_is_measured_again_first():
    """Note [re-measure before shrinking]: one reading over the budget does not give up a size
    that has completed windows; a second one does; an allocator failure shrinks at once."""
    state = after_success(AutoState(size=8, ceiling=16, fits=8), 8)
    again = after_oom(state, 8, measured=True)
    assert (again.size, again.rechecked) == (8, True)  # the same size, once more
    assert after_oom(again, 8, measured=True).size == 4  # the second overrun shrinks
    assert after_oom(state, 8).size == 4  # a real allocator failure shrinks at once
    assert after_oom(state, 12, measured=True).size == 8  # a growth probe: back to what fits
    assert not after_success(again, 8).rechecked  # the next window may re-measure again


def test_a_token_budget_stops_at_one_sample_per_micro_batch():
    """Below the longest sample's length a token cut changes nothing: that is auto's floor."""
    state = after_oom(AutoState(), 100, floor=48, name="micro_batch_tokens")
    assert state.size == 50 and size_for(state, 100, floor=48) == 50
    state = after_oom(state, 50, floor=48, name="micro_batch_tokens")
    assert state.size == 48  # not 25: one sample per micro-batch already
    with pytest.raises(MemoryError, match=r"micro_batch_tokens=48 \(one sample per micro-batch"):
        after_oom(state, 48, floor=48, name="micro_batch_tokens")

"""``Cut``: the settings of how a window is cut, one checked value (issue 36)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import bigbatch
from bigbatch.core.cut import Cut


def _acc(*args, **kwargs) -> bigbatch.Accumulator:
    model = torch.nn.Linear(3, 1)
    return bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), *args, **kwargs)


def test_the_accumulator_takes_at_most_eight_parameters() -> None:
    params = list(inspect.signature(bigbatch.Accumulator.__init__).parameters)
    assert len(params) - 1 <= 8, params


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((), {}, Cut()),
        ((4,), {}, Cut(micro_batch_size=4)),
        (("auto",), {"memory_budget": "1GiB"}, Cut("auto", memory_budget="1GiB")),
        ((), {"micro_batch_tokens": 64, "micro_batch_size": 2}, Cut(2, 64)),
        ((Cut(micro_batch_tokens=64),), {}, Cut(micro_batch_tokens=64)),
    ],
)
def test_every_spelling_of_a_cut_gives_one_value(args, kwargs, expected) -> None:
    acc = _acc(*args, **kwargs)
    assert acc.cut == expected
    assert acc.micro_batch_size == expected.micro_batch_size


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((Cut(4),), {"micro_batch_tokens": 64}, "a Cut and micro_batch_tokens= were both given"),
        ((4,), {"micro_batch_size": 4}, "micro_batch_size was given twice"),
        ((), {"micro_batch_tokenz": 64}, "unexpected keyword argument 'micro_batch_tokenz'"),
        ((), {"trim_padding": "no"}, "trim_padding='no' is not allowed"),
        ((), {"memory_budget": "lots"}, "memory_budget"),
        ((), {"pad_to_multiple_of": 8}, "give micro_batch_tokens"),
        (("auto",), {"pack": 64}, r"micro_batch_size='auto' with pack: packed rows have one"),
        ((), {"pack": 64, "micro_batch_tokens": 32}, "holds no packed row of pack=64 tokens"),
        ((), {"pack": 64, "pad_to_multiple_of": 7}, r"pad_to_multiple_of=7 with pack=64: packed"),
        ((), {"pack": 0}, r"pack=0 is not allowed"),
    ],
)
def test_a_bad_cut_is_refused_when_made(args, kwargs, match) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        _acc(*args, **kwargs)


def test_a_cut_builds_fresh_state_for_each_accumulator() -> None:
    cut = Cut(micro_batch_tokens=64)
    assert cut.build()[1] is not cut.build()[1]
    assert dataclasses.replace(cut, micro_batch_tokens=32).micro_batch_tokens == 32
    with pytest.raises(ValueError, match="pad_to_multiple_of=128 is larger than"):
        dataclasses.replace(cut, pad_to_multiple_of=128)  # checked again

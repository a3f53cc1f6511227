"""Generated windows on two gloo ranks (DDP, unequal shares): the step equals the full batch of
both shares, or both ranks refuse naming what is at fault. Slow tier only (real processes)."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("hypothesis")  # the test extra's: pip install -e ".[test]"

import torch  # noqa: E402
from distributed.ranks import run_ranks  # noqa: E402
from oracle import judge, reference  # noqa: E402
from scenarios import Plain, batches, expectation, make_model, rank_train  # noqa: E402
from strategies import Ranks, hold, rank_cases  # noqa: E402

REFUSALS = {"ValueError": ValueError, "TypeError": TypeError}


def check_ranks(case: Ranks) -> None:
    init = make_model(case.case.model)
    windows, plain = batches(case.case), Plain(case.case)
    expected = reference(init, case.case.optimizer, plain, windows)

    def run() -> torch.nn.Module:
        outcomes = run_ranks(rank_train, case, timeout_s=60)
        # A rank's refusal first: the other rank may then fail in a collective (gloo's "Connection
        # closed by peer"); the job's error says why on the refusing rank.
        for kind, value in sorted(outcomes, key=lambda o: o[0] not in REFUSALS):
            if kind != "ok":
                raise REFUSALS.get(kind, RuntimeError)(f"({kind} on a rank) {value}")
        (_, first), (_, second) = outcomes
        if any(not torch.equal(a, b) for a, b in zip(first, second, strict=True)):
            raise RuntimeError("the ranks' parameters differ after the step")
        model = copy.deepcopy(init)
        with torch.no_grad():
            for p, value in zip(model.parameters(), first, strict=True):
                p.copy_(value)
        return model

    judge(plain.expect(expectation(case.case)), expected, run)


@pytest.mark.slow
def test_two_ranks_equal_the_full_batch():
    hold(check_ranks, rank_cases(), "long", examples=6)

"""Generated uses of the Trainer drop-in (trainers.py), each held to the stock Trainer's one-batch
run at the rounding of the dtype both compute in, or a refusal naming the argument. Slow tier
only (a case trains two Trainers; its ranks are real gloo processes)."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")  # the test extra's: pip install -e ".[test]"
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import copy  # noqa: E402
import tempfile  # noqa: E402

from distributed.ranks import run_ranks  # noqa: E402
from integrations.hf_models import distance  # noqa: E402
from oracle import judge  # noqa: E402
from strategies import hold  # noqa: E402
from trainers import (  # noqa: E402
    TRAINER_FOCI,
    TrainerCase,
    copied,
    model_of,
    on_rank,
    tolerance,
    trained,
    trainer_cases,
    trainer_expectation,
)

REFUSALS = {"ValueError": ValueError, "TypeError": TypeError}


def check_trainer(case: TrainerCase) -> None:
    init, expect = model_of(case), trainer_expectation(case)
    with tempfile.TemporaryDirectory() as tmp:
        # the stock Trainer's one-batch run (none where no step is defined: the case must refuse)
        stock = init if expect.must_refuse else trained(case, copy.deepcopy(init), True, tmp).model

        def run():
            if case.ranks == 1:
                return trained(case, copy.deepcopy(init), False, tmp).model
            outcomes = run_ranks(on_rank, case, tmp, timeout_s=120)
            for kind, value in sorted(outcomes, key=lambda o: o[0] not in REFUSALS):
                if kind != "ok":  # a rank's refusal first (the other may then fail in gloo)
                    raise REFUSALS.get(kind, RuntimeError)(f"({kind} on a rank) {value}")
            return copied(init, outcomes[0][1])

        judge(expect, stock, run, tolerance(case), lambda a, b: distance(b, a, init))


@pytest.mark.slow
@pytest.mark.parametrize("focus", TRAINER_FOCI)
def test_the_trainer_equals_the_stock_one_batch_run(focus):
    # the quick profile's fixed examples, reported as found (shrinking a Trainer case: minutes)
    hold(check_trainer, trainer_cases(focus), "quick", examples=TRAINER_FOCI[focus][0])

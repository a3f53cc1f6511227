"""Generated uses of the engine's other entry points, each held to the oracle (oracle.py):
gradients handed over with ``accumulate_grads``, ``cached_loss``, and engine state saved under
one sizing policy and loaded under another."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("hypothesis")  # the test extra's: pip install -e ".[test]"

from oracle import OPTIMIZERS, Expect, judge, reference, unchanged_on_refusal  # noqa: E402
from scenarios import (  # noqa: E402
    Encoder,
    Plain,
    batches,
    cached_batches,
    cached_fns,
    cached_plain,
    grads_batch,
    make_model,
    mean_ce,
    resume_case,
    train_by_pieces,
    train_resumed,
)
from strategies import Cached, Grads, Resume, cached_cases, grads_cases, hold, resume_cases  # noqa: E402

import bigbatch

PROFILES = ["quick", pytest.param("long", marks=pytest.mark.slow)]


def check_grads(case: Grads) -> None:
    init = make_model("mlp")
    expected = reference(init, case.optimizer, mean_ce, [grads_batch(case)])
    # A generator is neither of the documented containers: refused (naming it) or taken.
    names = {"grads", "accumulate_grads"} if "generator" in case.routes else set()
    judge(Expect(frozenset(names)), expected, lambda: train_by_pieces(case, init))


def check_cached(case: Cached) -> None:
    init = Encoder(seed=0)
    windows = cached_batches(case)
    expected = reference(init, case.optimizer, cached_plain(case), windows)

    def run() -> Encoder:
        model = copy.deepcopy(init)
        acc = bigbatch.Accumulator(
            model, OPTIMIZERS[case.optimizer](model.parameters()), case.micro_batch_size
        )
        for batch in windows:
            with unchanged_on_refusal(model):
                acc.train_step(batch, bigbatch.cached_loss(*cached_fns(case, model)))
        return model

    judge(Expect(), expected, run)


def check_resume(case: Resume) -> None:
    init = make_model("bag")
    full = resume_case(case, case.first)
    windows, plain = batches(full), Plain(full)
    expected = reference(init, case.optimizer, plain, windows)
    names = set() if case.first == case.second else {"micro_batch_size", "micro_batch_tokens"}
    run = lambda: train_resumed(case, init, windows)  # noqa: E731
    judge(plain.expect(Expect(frozenset(names))), expected, run)


@pytest.mark.parametrize("profile", PROFILES)
def test_accumulated_gradients_equal_the_full_batch(profile):
    hold(check_grads, grads_cases(), profile)


@pytest.mark.parametrize("profile", PROFILES)
def test_cached_losses_equal_the_full_batch(profile):
    hold(check_cached, cached_cases(), profile)


@pytest.mark.parametrize("profile", PROFILES)
def test_engine_state_loads_under_another_policy_or_is_refused(profile):
    hold(check_resume, resume_cases(), profile)

"""Generated windows (tests/fuzz/README.md): an MLP's batches cut by samples, and text cut by
samples or tokens, each step held to the oracle (oracle.py) against the plain full batch.

The quick tier runs each property once over every feature with the fixed-seed quick profile;
the slow tier runs the long profile once per feature family (``strategies.FOCI``: one family
drawn widely, the others benign, so that one family's faults do not hide another's) and on
transformers' models.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("hypothesis")  # the test extra's: pip install -e ".[test]"

from oracle import judge, reference  # noqa: E402
from scenarios import Plain, batches, expectation, make_model, train  # noqa: E402
from strategies import FOCI, Case, hold, sample_cases, token_cases  # noqa: E402

SAMPLE_FOCI = ("everything", "terms", "names", "statistics", "bad_arguments")  # MLPs: no text


def tiers(foci: tuple[str, ...]) -> list:
    """``(profile, focus)``: everything in the quick tier; each focus in the slow tier."""
    slow = [pytest.param("long", f, marks=pytest.mark.slow, id=f"long-{f}") for f in foci]
    return [pytest.param("quick", "everything", id="quick"), *slow]


def check(case: Case) -> None:
    """One generated case against the full batch."""
    init = make_model(case.model)
    windows, plain = batches(case), Plain(case)
    expected = reference(init, case.optimizer, plain, windows)
    judge(plain.expect(expectation(case)), expected, lambda: train(case, init, windows))


@pytest.mark.parametrize("profile, focus", tiers(SAMPLE_FOCI))
def test_sample_windows_equal_the_full_batch(profile, focus):
    hold(check, sample_cases(FOCI[focus]), profile, examples=60 if profile == "quick" else None)


@pytest.mark.parametrize("profile, focus", tiers(tuple(FOCI)))
def test_token_windows_equal_the_full_batch(profile, focus):
    hold(check, token_cases(FOCI[focus]), profile, examples=120 if profile == "quick" else None)


@pytest.mark.slow
@pytest.mark.needs("transformers")
def test_transformers_models_equal_the_full_batch():
    """Tiny GPT-2 and Llama from configs (no download), on valid windows (the features' own
    faults are the properties' above): few examples, a model costs ~20 ms to build."""
    space = replace(FOCI["terms"], stats=("none", "fixed"), multiples=(None, 8))
    hold(check, token_cases(space, models=("gpt2", "llama")), "long", examples=20)

"""``--local-steps`` (bigbatch.app.loop, Note [local rounds]): the settings it is refused
with, where rounds end, and when a snapshot or an evaluation that falls inside a round is taken.

The runs on two ranks under torchrun are in tests/distributed/test_train_local.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from bigbatch.app.cli import main
from bigbatch.app.rounds import crossed, round_end, this_rank
from bigbatch.app.settings import TrainConfig
from bigbatch.distributed.launch import Ranks

TASKS = os.path.join(os.path.dirname(__file__), "tasks.py")


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"local_steps": 0}, r"local_steps=0 is not allowed: use a whole number >= 1"),
        ({"local_steps": -2}, r"local_steps=-2 is not allowed: use a whole number >= 1"),
        ({"local_steps": True}, r"local_steps=True is not allowed"),
        ({"local_steps": 4, "outer_lr": 0.0}, r"outer_lr=0.0 is not allowed: use a positive"),
        ({"local_steps": 4, "outer_lr": float("inf")}, r"outer_lr=inf is not allowed"),
        (
            {"local_steps": 4, "outer_momentum": 1.0},
            r"outer_momentum=1.0 is not allowed: use a number in \[0, 1\)",
        ),
        (
            {"local_steps": 4, "outer_nesterov": True},
            r"outer_nesterov=True needs outer momentum: add --outer-momentum 0.9",
        ),
        (
            {"outer_lr": 4.0, "outer_momentum": 0.9},
            r"outer_lr=4.0, outer_momentum=0.9 has no effect with local_steps=1, the exact "
            r"data-parallel step",
        ),
    ],
)
def test_bad_local_settings_are_named(settings, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**settings)


def test_local_settings_are_part_of_the_run_identity():
    from bigbatch.app.settings import resumable_changes

    assert {"local_steps", "outer_lr", "outer_momentum", "outer_nesterov"}.isdisjoint(
        resumable_changes()
    )


def test_local_steps_in_one_process_is_one_line_and_touches_nothing(capsys, tmp_path):
    out = tmp_path / "run"
    code = main(["train", f"{TASKS}:classify", "--local-steps", "4", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        "bigbatch train: error: --local-steps 4 needs several ranks and this is one process: "
        "there is nothing to average. Launch with `torchrun --nproc_per_node N -m bigbatch "
        "train ...`, or drop --local-steps.\n"
    )
    assert not out.exists()


def test_local_steps_below_one_on_the_command_line(capsys, tmp_path):
    code = main(["train", f"{TASKS}:classify", "--local-steps", "0", "--out", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err.startswith(
        "bigbatch train: error: local_steps=0 is not allowed: use a whole number >= 1"
    )


def test_train_help_says_what_local_steps_and_the_outer_rule_mean(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: no wrapping inside --outer-nesterov
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for words in (
        "--local-steps LOCAL_STEPS under torchrun",
        "1: the exact data-parallel step",
        "Hermans et al. 2017",
        "λ averages the ranks' models (local SGD, as PyTorch's post-local SGD",
        "0.7·λ with --outer-momentum 0.9 --outer-nesterov is DiLoCo's",
        "1 is the paper's",
    ):
        assert words in text, words


def test_rounds_end_every_local_steps_and_at_the_last_step():
    assert [round_end(s, 4, 10) for s in range(1, 11)] == [0, 0, 0, 4, 0, 0, 0, 4, 0, 2]
    assert [round_end(s, 4, 8) for s in range(1, 9)] == [0, 0, 0, 4, 0, 0, 0, 4]
    assert [round_end(s, 1, 5) for s in range(1, 6)] == [1] * 5  # data-parallel: every step


@pytest.mark.parametrize("every", [0, 1, 3, 5, 7])
def test_what_falls_due_in_a_round_is_taken_at_its_end(every):
    """One step per round (data-parallel) is the plain ``step % every == 0``; with rounds of 4
    (and a short last one of 2) each multiple of ``every`` is taken once, at its round's end."""
    assert [crossed(s, 1, every) for s in range(1, 31)] == [
        bool(every) and s % every == 0 for s in range(1, 31)
    ]
    ends = [(s, round_end(s, 4, 30)) for s in range(1, 31)]
    taken = [s for s, n in ends if n and crossed(s, n, every)]
    due = [s for s in range(1, 31) if every and s % every == 0]
    assert taken == sorted({next(e for e, n in ends if n and e >= d) for d in due})


def test_a_snapshot_of_other_ranks_is_refused():
    saved = {"optimizers": [{}, {}], "engines": [{}, {}]}
    assert this_rank(saved, Ranks(1, 2, 1, torch.device("cpu"))) == ({}, {})
    with pytest.raises(ValueError, match=r"written by 2 ranks under --local-steps.*resume on 2"):
        this_rank(saved, Ranks(0, 3, 0, torch.device("cpu")))

"""``bigbatch train`` with token windows and a loss of named terms (issues 22 and 24): the run
equals the same run with the whole batch in one micro-batch (float64), logs the padding, the
real tokens/s and each term, and a run killed mid-window resumes bitwise equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tasks
import torch
from runs import argv, assert_same_run, kill_when_stopped, snapshot_step, train_ok

import bigbatch
from bigbatch.app import report
from bigbatch.app.cli import main
from bigbatch.app.log import read_csv

SETTINGS = {"batch_size": 10, "epochs": 2, "lr": 0.05, "seed": 3, "quiet": True}


def _params(out) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def test_token_windows_train_as_the_whole_batch_and_log_padding_and_terms(tmp_path):
    bigbatch.fit(tasks.text(), out=str(tmp_path / "whole"), micro_batch_size=10, **SETTINGS)
    bigbatch.fit(tasks.text(), out=str(tmp_path / "tokens"), micro_batch_tokens=20, **SETTINGS)
    whole, cut = _params(tmp_path / "whole"), _params(tmp_path / "tokens")
    for name, value in whole.items():
        assert torch.allclose(cut[name], value, rtol=1e-10, atol=1e-13), name
    rows = read_csv(str(tmp_path / "tokens" / "metrics.csv"))
    assert all(int(r["micro_batches"]) > 1 and 0 <= float(r["padding"]) < 0.5 for r in rows)
    assert all(r["terms"].startswith("lm=") and " aux=" in r["terms"] for r in rows)
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    summary = json.loads((tmp_path / "tokens" / "summary.json").read_text())
    assert 0 <= summary["padding"] < 0.5 and summary["terms"].startswith("lm=")


def test_a_packed_run_trains_as_the_whole_batch_and_logs_its_ledger(tmp_path):
    """Issue 38: --pack equals the whole batch in one micro-batch (float64), and metrics.csv
    holds the step's ledger: real and computed tokens, model TFLOPs, MFU against its peak."""
    bigbatch.fit(tasks.text_lm(), out=str(tmp_path / "whole"), micro_batch_size=10, **SETTINGS)
    bigbatch.fit(tasks.text_lm(), out=str(tmp_path / "packed"), pack=24, **SETTINGS)
    whole, packed = _params(tmp_path / "whole"), _params(tmp_path / "packed")
    for name, value in whole.items():
        assert torch.allclose(packed[name], value, rtol=1e-10, atol=1e-13), name
    rows = read_csv(str(tmp_path / "packed" / "metrics.csv"))
    for r in rows:
        assert int(r["computed_tokens"]) == 24 * int(r["micro_batches"])  # one row of 24 each
        assert int(r["input_tokens"]) <= int(r["computed_tokens"]) and float(r["mfu"]) > 0
        assert r["peak"].startswith("measured: one ") and float(r["model_tflops"]) > 0
    assert "MFU " in (tmp_path / "packed" / "train.log").read_text()
    summary = json.loads((tmp_path / "packed" / "summary.json").read_text())
    assert 0 < summary["mfu"] < 1 and summary["peak"].startswith("measured: one ")


def test_packing_a_loss_that_counts_by_column_stops_before_the_first_step(tmp_path):
    """The audit (Note [packing audit]): ``text``'s auxiliary term labels each row's first
    columns, which packing moves: its count differs, and the run stops, naming it."""
    with pytest.raises(ValueError, match=r"packing changed the first window: its count is"):
        bigbatch.fit(tasks.text(), out=str(tmp_path / "packed"), pack=24, **SETTINGS)
    assert not (tmp_path / "packed" / "model.pt").exists()


@pytest.mark.needs("rich")
def test_cli_flags_for_token_windows_and_compile_buckets(tmp_path, capsys):
    out = tmp_path / "run"
    task = f"{tasks.__file__}:text"
    code = main(["train", task, "--batch-size", "10", "--epochs", "1", "--micro-batch-tokens",
                 "24", "--pad-to-multiple-of", "4", "--out", str(out), "--quiet"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert {int(r["micro_batch_tokens"]) for r in read_csv(str(out / "metrics.csv"))} == {24}
    assert " | micro-batch 24 tokens x " in (out / "train.log").read_text()  # the unit, said
    report.print_summary(report.report(str(out))[0])
    assert "10 (micro-batch 24 tokens)" in capsys.readouterr().out
    code = main(["train", task, "--micro-batch-tokens", "24", "--gradient-accumulation-steps",
                 "3", "--out", str(tmp_path / "bad")])  # fmt: skip
    assert code == 2
    assert "gradient_accumulation_steps=3 has no meaning with micro_batch_tokens" in (
        capsys.readouterr().err
    )


def test_the_language_model_example_trains_through_the_cli(tmp_path, capsys):
    """examples/causal_lm.py:task (a GPT-2 on the standard library's docstrings) by tokens and
    by samples: both cut the padded batch into trimmed micro-batches and log their padding."""
    pytest.importorskip("transformers")
    example = Path(__file__).resolve().parents[2] / "examples" / "causal_lm.py"
    for cut in (["--micro-batch-tokens", "512"], ["--micro-batch-size", "4"]):
        out = tmp_path / cut[0]
        code = main(["train", f"{example}:task", "--batch-size", "16", "--steps", "3", *cut,
                     "--out", str(out), "--quiet"])  # fmt: skip
        assert code == 0, capsys.readouterr().err
        rows = read_csv(str(out / "metrics.csv"))
        assert len(rows) == 3 and all(0 < float(r["loss"]) < 10 for r in rows)
        bound = 0.2 if "tokens" in cut[0] else 0.45  # the batch padded whole: about 55%
        assert all(int(r["micro_batches"]) >= 2 and float(r["padding"]) < bound for r in rows)


def test_compile_wraps_the_model_and_snapshots_the_plain_one():
    from bigbatch.app.run import prepare_model
    from bigbatch.app.settings import TrainConfig
    from bigbatch.distributed import launch

    model = tasks.text().model
    compiled = prepare_model(model, TrainConfig(compile=True), launch.setup("cpu"))
    assert compiled is not model and launch.unwrap(compiled) is model
    assert set(launch.unwrap(compiled).state_dict()) == set(model.state_dict())


@pytest.mark.slow  # child processes killed with SIGKILL
def test_a_run_with_a_token_budget_killed_mid_window_resumes_bitwise(tmp_path):
    extra = ("--micro-batch-tokens", "20")
    train_ok(argv(tmp_path / "ref", *extra, task="text_killable", micro="10"))
    out, calls = tmp_path / "run", tmp_path / "calls.log"
    # the count pass and the main pass each call the loss: stop deep into the run, mid-window
    kill_when_stopped(
        argv(out, *extra, task="text_killable", micro="10"), tmp_path / "err",
        KILL_LOG=str(calls), STOP_AT="40",
    )  # fmt: skip
    assert snapshot_step(out) is not None
    train_ok(argv(out, *extra, "--resume", task="text_killable", micro="10"))
    assert_same_run(out, tmp_path / "ref")
